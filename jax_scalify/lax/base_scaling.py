"""Small helpers shared by the scale rules: exact power-of-two rescaling and scale choice."""
from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from ..core.array import ScaledArray
from ..core.config import get_scalify_config
from ..core.pow2 import pow2_round
from ..core.promotion import AnyScaleArray, is_any_scale

Array = Any


def scale_dtype() -> np.dtype:
    """The configured scale dtype."""
    return get_scalify_config().scale_dtype


def as_scale(s: Array) -> Array:
    """``s`` in the configured scale dtype (NumPy stays NumPy, so constants fold at trace time)."""
    if isinstance(s, (np.ndarray, np.generic, float, int)):
        return np.asarray(s, scale_dtype())
    return jnp.asarray(s).astype(scale_dtype())


def round_scale(s: Array) -> Array:
    """Round a computed scale to a power of two with the configured rounding mode."""
    return as_scale(pow2_round(as_scale(s)))


def sqrt_size_pow2(size: int) -> np.ndarray:
    """``r = pow2(sqrt(size))``, the unit-scaling factor of a sum of ``size`` terms (NumPy)."""
    return round_scale(np.sqrt(np.float64(max(size, 1))))


def _wide(dtype) -> bool:
    return jnp.finfo(dtype).bits >= 32


def mul_data(data: Array, factor: Array) -> Array:
    """``data * factor`` in the data dtype; ``factor`` a (power-of-two) scalar.

    Narrow dtypes (16 and 8 bits) multiply in float32 and round once, so a factor outside
    their range (e.g. ``2**-30`` for float16) is still applied exactly before rounding.
    """
    if isinstance(factor, (np.ndarray, np.generic)) and np.all(factor == 1):
        return data
    if _wide(data.dtype):
        return data * jnp.asarray(factor).astype(data.dtype)
    return (data.astype(jnp.float32) * jnp.asarray(factor).astype(jnp.float32)).astype(data.dtype)


def rescale(x: ScaledArray, new_scale: Array) -> ScaledArray:
    """The same value as ``x`` with scale ``new_scale``: ``data * (scale / new_scale)``.

    An any-scale operand (0 or ±inf) keeps its data and just takes the new scale.
    """
    new_scale = as_scale(new_scale)
    if is_any_scale(x):
        return ScaledArray(x.data, new_scale)
    if x.scale is new_scale:
        return x
    return ScaledArray(mul_data(x.data, as_scale(x.scale) / new_scale), new_scale)


def largest_scale(operands: Sequence[ScaledArray]) -> Array:
    """The largest scale among the operands that have one (any-scale operands skipped)."""
    scales = [as_scale(x.scale) for x in operands if not is_any_scale(x)]
    if not scales:
        return np.ones((), scale_dtype())
    out = scales[0]
    for s in scales[1:]:
        out = jnp.maximum(out, s) if not (isinstance(out, np.ndarray) and isinstance(s, np.ndarray)) else np.maximum(out, s)
    return out


def align_to_largest(operands: Sequence[ScaledArray]) -> tuple[list[ScaledArray], Array]:
    """Rescale every operand to the largest scale; returns the rescaled operands and that scale."""
    scale = largest_scale(operands)
    return [rescale(x, scale) for x in operands], scale


def to_float32_value(x: ScaledArray) -> Array:
    """The value ``data * scale`` in float32 (or the data dtype if it is wider)."""
    work = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    return x.data.astype(work) * jnp.asarray(x.scale).astype(work)


__all__ = [
    "AnyScaleArray",
    "align_to_largest",
    "as_scale",
    "is_any_scale",
    "largest_scale",
    "mul_data",
    "rescale",
    "round_scale",
    "scale_dtype",
    "sqrt_size_pow2",
    "to_float32_value",
]
