"""Core of jax_scalify: the data model, power-of-two arithmetic, config and the ``scalify`` transform.

The package (``jax_scalify``) exports the user API of the data model and the transform; this
namespace adds the power-of-two arithmetic and the current config. jax-scalify 0.1's names of
``jax_scalify.core`` stay importable from here, listed in :mod:`jax_scalify.compat`. The engine
(registry, interpreter entry points, promotion) is for rule authors, in :mod:`jax_scalify.extend`.
"""

import sys

from .array import ScaledArray, as_scaled_array, asarray, is_scaled_leaf, scaled_array
from .config import Pow2RoundMode, ScalifyConfig, get_scalify_config
from .custom_scale import custom_scale
from .interpreter import scalify
from .policy import RescalePolicy
from .pow2 import get_mantissa, pow2_decompose, pow2_exponent, pow2_round, pow2_round_down, pow2_round_up


def __getattr__(name: str):
    # jax-scalify 0.1's names, from jax_scalify.compat: it imports the layers above core, so it is
    # looked up once the package is imported (it is the package's last import).
    compat = sys.modules.get("jax_scalify.compat")
    if compat is None:
        raise AttributeError(f"module '{__name__}' has no attribute '{name}'")
    return compat.name_of_0_1(__name__, name)


__all__ = [
    "get_mantissa",
    "get_scalify_config",
    "pow2_decompose",
    "pow2_exponent",
    "pow2_round",
    "pow2_round_down",
    "pow2_round_up",
]
