"""jax_scalify: end-to-end scale propagation for FP16 and FP8 training in JAX."""

from . import analysis, core, extend, lax, nn, ops, optim, quantization, tree
from .core import (
    Pow2RoundMode,
    RescalePolicy,
    ScaledArray,
    ScalifyConfig,
    as_scaled_array,
    asarray,
    custom_scale,
    is_scaled_leaf,
    scaled_array,
    scalify,
)
from .tree.serialization import install_flax_hook as _install_flax_hook
from .tree.sharding import device_put, scaled_shardings

_install_flax_hook()

from . import compat  # noqa: E402  (last: it imports every layer)


def __getattr__(name: str):
    # jax-scalify 0.1's names of the package that are no longer in its API (jax_scalify.compat).
    return compat.name_of_0_1(__name__, name)


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
