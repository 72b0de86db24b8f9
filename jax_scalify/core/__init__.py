"""Core of jax_scalify: the data model, power-of-two arithmetic, config and the ``scalify`` transform.

This namespace is the user API (plus jax-scalify 0.1's names, kept with their meaning, see
``docs/migration.md``). The engine behind it (registry entries, interpreter entry points,
promotion) is for rule authors, in :mod:`jax_scalify.extend`.
"""

from . import compat
from .array import ScaledArray, as_scaled_array, asarray, is_scaled_leaf, scaled_array
from .compat import (
    Array,
    ArrayTypes,
    DTypeLike,
    Shape,
    Sharding,
    get_numpy_api,
    get_scale_dtype,
    is_static_anyscale,
    is_static_one_scalar,
    is_static_zero,
    make_scaled_scalar,
    safe_div,
    safe_reciprocal,
)
from .config import Pow2RoundMode, ScalifyConfig, get_scalify_config
from .custom_scale import custom_scale
from .interpreter import scalify
from .pow2 import get_mantissa, pow2_decompose, pow2_exponent, pow2_round, pow2_round_down, pow2_round_up
from .registry import ScaledPrimitiveType, find_registered_scaled_op, register_scaled_lax_op, register_scaled_op


def __getattr__(name: str):
    # jax-scalify 0.1 had ``core.debug_callback``; it lives in ``ops`` now, which core must not
    # import while it is itself being imported, hence the lookup on first use.
    if name == "debug_callback":
        from ..ops import debug_callback

        return debug_callback
    raise AttributeError(f"module 'jax_scalify.core' has no attribute '{name}'")


_USER_API = [
    "Pow2RoundMode",
    "ScaledArray",
    "ScalifyConfig",
    "as_scaled_array",
    "asarray",
    "custom_scale",
    "get_mantissa",
    "get_scalify_config",
    "is_scaled_leaf",
    "pow2_decompose",
    "pow2_exponent",
    "pow2_round",
    "pow2_round_down",
    "pow2_round_up",
    "scaled_array",
    "scalify",
]
# jax-scalify 0.1's registry names; the full registry API is in jax_scalify.extend.
_COMPAT_REGISTRY = ["ScaledPrimitiveType", "find_registered_scaled_op", "register_scaled_lax_op", "register_scaled_op"]

__all__ = _USER_API + compat.__all__ + _COMPAT_REGISTRY + ["debug_callback"]
