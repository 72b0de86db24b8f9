"""Helpers shared by the scale rules of :mod:`jax_scalify.nn`.

The rules work on the ``(data, scale)`` pair of a ``ScaledArray``: data widened to float32
(float64 stays float64) so that 16- and 8-bit formats are never used for arithmetic, the
scale a scalar of the same work dtype, and results cast back to the data dtype once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..core.array import ScaledArray
from ..core.scaling import as_scale

Array = Any
Axis = int | Sequence[int] | None


def work_dtype(dtype: Any) -> np.dtype:
    """float64 for float64 data, float32 for everything else (float32, 16 and 8 bits)."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def widen(x: Array) -> Array:
    """``x`` in its work dtype (see :func:`work_dtype`)."""
    return jnp.asarray(x).astype(work_dtype(jnp.result_type(x)))


def normalize_axes(name: str, axis: Axis, ndim: int) -> tuple[int, ...]:
    """``axis`` (an int, a sequence of ints or None for all axes) as sorted non-negative ints."""
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    out = []
    for a in axes:
        if not isinstance(a, (int, np.integer)) or not -ndim <= int(a) < ndim:
            raise ValueError(
                f"jsa.nn.{name}: axis {axis!r} is out of range for an array of rank {ndim}; "
                f"use integers in [-{ndim}, {ndim}) or None for all axes."
            )
        out.append(int(a) % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"jsa.nn.{name}: axis {axis!r} repeats an axis.")
    return tuple(sorted(out))


def axes_size(shape: Sequence[int], axes: Sequence[int]) -> int:
    """Number of elements along ``axes``."""
    return int(np.prod([shape[a] for a in axes], dtype=np.int64))


def scalar_scale(name: str, x: ScaledArray) -> Array:
    """The scale of ``x`` in the work dtype of its data; the rules need a scalar scale."""
    if np.ndim(x.scale) != 0:
        raise ValueError(
            f"The scale rule of jsa.nn.{name} needs a ScaledArray with a scalar scale, got a scale of "
            f"shape {np.shape(x.scale)}. Give the input one scale first, e.g. with "
            "jsa.lax.set_scaling(x, s) or jsa.ops.dynamic_rescale_l2(x)."
        )
    return jnp.asarray(x.scale).astype(work_dtype(x.dtype))


def scaled_output(data: Array, dtype: Any, scale: Array) -> ScaledArray:
    """``ScaledArray(data.astype(dtype), scale)`` with the scale in the configured scale dtype."""
    return ScaledArray(jnp.asarray(data).astype(dtype), as_scale(scale))


def pow2_scale(scale: Array) -> Array:
    """``scale``, a power of two by construction (or 0/inf/nan), in the scale dtype.

    Every scale is a power of two by contract (see :func:`jax_scalify.core.pow2.scales_are_pow2`);
    the callers build theirs from powers of two so as to honour it.
    """
    return as_scale(scale)


def max_with_one(scale: Array) -> Array:
    """``max(scale, 1)`` in the scale dtype; a power of two when ``scale`` is one."""
    scale = as_scale(scale)
    return as_scale(np.maximum(scale, 1) if isinstance(scale, np.ndarray) else jnp.maximum(scale, 1))


def largest_pow2(dtype: Any) -> float:
    """The largest power of two that ``dtype`` holds."""
    return float(2.0 ** (jnp.finfo(dtype).maxexp - 1))
