"""Core of jax_scalify: the data model, power-of-two arithmetic, config, registry, interpreter."""
from .array import ScaledArray, as_scaled_array, asarray, is_floating_dtype, is_scaled_leaf, scaled_array
from . import compat
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
from .custom_scale import custom_scale, custom_scale_call_p
from .interpreter import eval_scaled_jaxpr, observe_equations, scalify, unpromoted_inputs
from .policy import RescalePolicy
from .pow2 import get_mantissa, pow2_decompose, pow2_exponent, pow2_round, pow2_round_down, pow2_round_up
from .promotion import any_scale_array, is_any_scale
from .registry import (
    RegisteredRule,
    ScaledPrimitiveType,
    find_registered_scaled_op,
    primitive_of,
    register_scalar_preserving,
    register_scaled_lax_op,
    register_scaled_op,
    registered_rules,
)

def __getattr__(name: str):
    # jax-scalify 0.1 had ``core.debug_callback``; it lives in ``ops`` now, which core must not
    # import while it is itself being imported, hence the lookup on first use.
    if name == "debug_callback":
        from ..ops import debug_callback

        return debug_callback
    raise AttributeError(f"module 'jax_scalify.core' has no attribute '{name}'")


__all__ = compat.__all__ + [
    "debug_callback",
    "Pow2RoundMode",
    "RegisteredRule",
    "RescalePolicy",
    "ScaledArray",
    "ScaledPrimitiveType",
    "ScalifyConfig",
    "as_scaled_array",
    "any_scale_array",
    "asarray",
    "custom_scale",
    "custom_scale_call_p",
    "eval_scaled_jaxpr",
    "find_registered_scaled_op",
    "get_mantissa",
    "get_scalify_config",
    "is_any_scale",
    "is_floating_dtype",
    "is_scaled_leaf",
    "observe_equations",
    "pow2_decompose",
    "pow2_exponent",
    "pow2_round",
    "pow2_round_down",
    "pow2_round_up",
    "primitive_of",
    "register_scalar_preserving",
    "register_scaled_lax_op",
    "register_scaled_op",
    "registered_rules",
    "scaled_array",
    "scalify",
    "unpromoted_inputs",
]
