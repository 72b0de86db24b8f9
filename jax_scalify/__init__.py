"""jax_scalify: end-to-end scale propagation for FP16 and FP8 training in JAX."""

from . import analysis, core, extend, interop, lax, nn, ops, optim, policy, quantization, tree
from .core import (
    Pow2RoundMode,
    ScaledArray,
    ScalifyConfig,
    as_scaled_array,
    asarray,
    custom_scale,
    is_scaled_leaf,
    scaled_array,
    scalify,
)
from .policy import RescalePolicy
from .tree.serialization import install_flax_hook as _install_flax_hook
from .tree.sharding import device_put, scaled_shardings

_install_flax_hook()

from . import compat  # noqa: E402,F401  (last: it imports every layer, then sets 0.1's names on core, lax and here)

__version__ = "0.2.0.dev0"

__all__ = [
    "Pow2RoundMode",
    "RescalePolicy",
    "ScaledArray",
    "ScalifyConfig",
    "as_scaled_array",
    "asarray",
    "custom_scale",
    "device_put",
    "is_scaled_leaf",
    "scaled_array",
    "scaled_shardings",
    "scalify",
    # user namespaces; the engine for rule authors is jax_scalify.extend
    "analysis",
    "core",
    "lax",
    "nn",
    "ops",
    "optim",
    "quantization",
    "tree",
]
