"""Core of jax_scalify: the data model, power-of-two arithmetic, config and the ``scalify`` transform.

The package (``jax_scalify``) exports the user API of the data model and the transform; this
namespace adds the power-of-two arithmetic and the current config. jax-scalify 0.1's names of
``jax_scalify.core`` stay importable from here, listed in :mod:`jax_scalify.compat`. The engine
(registry, interpreter entry points, promotion) is for rule authors, in :mod:`jax_scalify.extend`.
"""

from .array import ScaledArray, as_scaled_array, asarray, is_scaled_leaf, scaled_array
from .config import Pow2RoundMode, ScalifyConfig, get_scalify_config
from .custom_scale import custom_scale
from .interpreter import scalify
from .pow2 import get_mantissa, pow2_decompose, pow2_exponent, pow2_round, pow2_round_down, pow2_round_up

__all__ = [
    "get_mantissa",
    "get_scalify_config",
    "pow2_decompose",
    "pow2_exponent",
    "pow2_round",
    "pow2_round_down",
    "pow2_round_up",
]
