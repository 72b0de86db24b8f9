"""Small helpers shared by the scale rules: exact power-of-two rescaling and scale choice.

Scale arithmetic is kept cheap at trace time: NumPy scales stay NumPy (folded in Python, no
equation), traced scalar scales are combined with single ``lax`` operations (``jnp.where``
and friends wrap a nested ``jit`` per call). Every scale is a power of two by contract unless
rounding is off (:func:`~jax_scalify.core.pow2.scales_are_pow2`), which lets rules take exact
shortcuts.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core.array import ScaledArray
from ..core.config import get_scalify_config
from ..core.pow2 import pow2_round, pow2_round_up
from ..core.promotion import any_scale_array, is_any_scale

Array = Any


def scale_dtype() -> np.dtype:
    """The configured scale dtype."""
    return get_scalify_config().scale_dtype


def as_scale(s: Array) -> Array:
    """``s`` in the configured scale dtype (NumPy stays NumPy, so constants fold at trace time).

    A JAX scale already of that dtype is returned as it is (same object, so rules can tell
    that two operands share one scale).
    """
    if isinstance(s, (np.ndarray, np.generic, float, int)):
        return np.asarray(s, scale_dtype())
    if getattr(s, "dtype", None) == scale_dtype() and not getattr(s, "weak_type", False):
        return s
    return jnp.asarray(s).astype(scale_dtype())


def is_numpy(x: Any) -> bool:
    """A trace-time constant NumPy value (or Python number)."""
    return isinstance(x, (np.ndarray, np.generic, float, int))


def select(pred: Array, on_true: Array, on_false: Array) -> Array:
    """``where(pred, on_true, on_false)``: NumPy for NumPy inputs, else one ``select_n`` equation.

    ``jnp.where`` wraps a nested ``jit`` per call; on scalar scales this is pure overhead.
    """
    if is_numpy(pred) and is_numpy(on_true) and is_numpy(on_false):
        return np.where(pred, on_true, on_false)
    dtype = jnp.result_type(on_true, on_false)
    on_true, on_false = jnp.asarray(on_true, dtype), jnp.asarray(on_false, dtype)
    pred = jnp.asarray(pred)
    if not (np.shape(pred) == np.shape(on_true) == np.shape(on_false)):
        pred, on_true, on_false = jnp.broadcast_arrays(pred, on_true, on_false)
    return lax.select(pred, on_true, on_false)


def scale_max(a: Array, b: Array) -> Array:
    """``max(a, b)`` of two scales (NaN-propagating): NumPy for NumPy inputs, else one ``max`` equation."""
    if is_numpy(a) and is_numpy(b):
        return np.maximum(a, b)
    if np.shape(a) == np.shape(b) and getattr(a, "dtype", None) == getattr(b, "dtype", None):
        return lax.max(a, b)
    return jnp.maximum(a, b)


def scale_min(a: Array, b: Array) -> Array:
    """``min(a, b)`` of two scales (NaN-propagating): NumPy for NumPy inputs, else one ``min`` equation."""
    if is_numpy(a) and is_numpy(b):
        return np.minimum(a, b)
    if np.shape(a) == np.shape(b) and getattr(a, "dtype", None) == getattr(b, "dtype", None):
        return lax.min(a, b)
    return jnp.minimum(a, b)


def scale_mul(*scales: Array) -> Array:
    """Product of scales in the scale dtype (a power of two when every factor is one).

    NumPy factors are multiplied first (in Python), so ``sa * sb * r`` with a NumPy ``r``
    emits at most two equations.
    """
    scales = [as_scale(s) for s in scales]
    consts = [s for s in scales if is_numpy(s)]
    traced = [s for s in scales if not is_numpy(s)]
    const = np.asarray(np.prod(np.stack(np.broadcast_arrays(*consts)), axis=0), scale_dtype()) if consts else None
    if not traced:
        return as_scale(const)
    out = traced[0]
    for s in traced[1:]:
        out = out * s
    if const is not None and not (np.ndim(const) == 0 and const == 1):
        out = out * const
    return as_scale(out)


def scale_div(a: Array, b: Array) -> Array:
    """``a / b`` in the scale dtype (a power of two when both are)."""
    a, b = as_scale(a), as_scale(b)
    if is_numpy(b) and np.ndim(b) == 0 and b == 1:
        return a
    return as_scale(a / b)


def scale_bounds() -> tuple[np.ndarray, np.ndarray]:
    """``(smallest, largest)`` power of two that is a normal number of the scale dtype.

    Output scales of products and quotients are kept in this range (``2**-126 .. 2**127`` in
    float32): a subnormal scale is flushed to zero by XLA on CPU and ``2**128`` is inf.
    """
    info = np.finfo(scale_dtype())
    return np.asarray(info.tiny, scale_dtype()), np.asarray(2.0 ** (info.maxexp - 1), scale_dtype())


def scaled_product(data: Array, a: Array, b: Array, *, divide: bool = False) -> ScaledArray:
    """``ScaledArray(data, a * b)`` (``a / b`` with ``divide``), the scale kept a normal number.

    Scale rule: the exact product (quotient) ``p`` of the scales when it lies within
    :func:`scale_bounds`; otherwise the nearest bound ``c``, and the excess ``p / c`` (a power
    of two for power-of-two scales) moves into the data, exactly, so ``data * scale`` is
    unchanged. Without it the scale silently became inf (``2**120 * 2**20``) or 0, and the
    value inf or nan. Trace-time (NumPy) scales are always guarded, at no run-time cost.
    Traced scales are guarded only with ``ScalifyConfig(guard_traced_scales=True)``: five
    scalar operations and one multiply of the data by ``p / c`` (1 unless the scale left the
    range), which made the benchmark steps compile 40-85% slower. A zero or non-finite ``p``
    gives the same values as before (``p / c`` is 0, inf or nan).

    ``(a / c) * b`` is exact for normal powers of two: past the top bound ``a >= 2`` (else
    ``a * b <= 2**127``), so ``a / c >= 2**-126``; below the bottom one ``a < 1``, so
    ``a / c < 2**126``; the quotient likewise.
    """
    lo, hi = scale_bounds()
    a, b = as_scale(a), as_scale(b)
    if is_numpy(a) and is_numpy(b):
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            exact = np.asarray(a, np.float64) / b if divide else np.asarray(a, np.float64) * b
        return _bounded_numpy(data, exact, lambda: scale_div(a, b) if divide else scale_mul(a, b))
    p = scale_div(a, b) if divide else scale_mul(a, b)
    if np.ndim(p) != 0 or not get_scalify_config().guard_traced_scales:
        return ScaledArray(data, p)
    bounded = as_scale(lax.clamp(lo, p, hi))
    excess = (a / bounded) / b if divide else (a / bounded) * b
    excess = lax.select(p == bounded, lax.full_like(excess, 1), excess)
    return ScaledArray(mul_data(data, excess), bounded)


def _bounded_numpy(data: Array, exact: np.ndarray, unbounded) -> ScaledArray:
    """A trace-time scale ``exact`` (float64) clamped to :func:`scale_bounds`, the excess in the data.

    ``unbounded()`` gives the scale when no clamping is needed (or possible: zero, non-finite
    or non-scalar scales keep today's value).
    """
    lo, hi = scale_bounds()
    if np.ndim(exact) != 0 or not np.isfinite(exact) or exact == 0 or lo <= exact <= hi:
        return ScaledArray(data, unbounded())
    bounded = np.clip(exact, lo, hi)
    with np.errstate(over="ignore", under="ignore"):
        excess = np.asarray(exact / bounded, np.float32)  # beyond float32: the value is 0 or inf anyway
    return ScaledArray(mul_data(data, excess), as_scale(bounded))


def scaled_power(data: Array, scale: Array, y: int) -> ScaledArray:
    """``ScaledArray(data, scale ** y)`` for a static integer ``y``, the scale kept a normal number.

    Scale rule: ``s ** y`` exactly (a power of two for a power-of-two ``s``). A trace-time
    scale is clamped to :func:`scale_bounds` with the excess moved into the data. A traced one
    is ``integer_pow`` of the scale, unless ``ScalifyConfig(guard_traced_scales=True)``: then
    a chain of :func:`scaled_product` for ``|y| <= 4`` (``x ** 2``, ``x ** 3`` in GELU,
    ``x ** -2``); higher powers of a traced scale stay unguarded.
    """
    scale = as_scale(scale)
    if is_numpy(scale):
        with np.errstate(over="ignore", divide="ignore", under="ignore"):
            exact = np.power(np.asarray(scale, np.float64), y)
        return _bounded_numpy(data, exact, lambda: as_scale(exact))
    if y == 0 or abs(y) > 4 or not get_scalify_config().guard_traced_scales:
        return ScaledArray(data, as_scale(lax.integer_pow(scale, y)))
    base = scale if y > 0 else as_scale(1 / scale)
    out = ScaledArray(data, base)
    for _ in range(abs(y) - 1):
        out = scaled_product(out.data, out.scale, base)
    return out


def round_scale(s: Array) -> Array:
    """Round a computed scale to a power of two with the configured rounding mode."""
    return as_scale(pow2_round(as_scale(s)))


def sqrt_size_pow2(size: int) -> np.ndarray:
    """``r = pow2(sqrt(size))``, the unit-scaling factor of a sum of ``size`` terms (NumPy)."""
    return round_scale(np.sqrt(np.float64(max(size, 1))))


def _wide(dtype) -> bool:
    return jnp.finfo(dtype).bits >= 32


def _native_16bit_factor(data: Array, factor: Array) -> np.ndarray | None:
    """``factor`` in the 16-bit data dtype when multiplying in that dtype gives the float32 result.

    For a trace-time factor that the dtype holds exactly (a power of two within its range),
    the product rounded once from float32 and the product in the data dtype are the same
    correctly rounded value. Multiplying in the data dtype lets XLA fold the factor into a
    neighbouring kernel (on GPU, the epilogue of a matmul), where a convert-multiply-convert
    is a kernel of its own.
    """
    if jnp.finfo(data.dtype).bits != 16 or not isinstance(factor, (np.ndarray, np.generic)) or np.ndim(factor):
        return None
    in_dtype = np.asarray(factor, data.dtype)
    exact = np.isfinite(factor) and factor != 0 and np.asarray(in_dtype, np.float32) == factor
    return in_dtype if exact else None


def mul_data(data: Array, factor: Array) -> Array:
    """``data * factor`` in the data dtype; ``factor`` a (power-of-two) scalar.

    Narrow dtypes (16 and 8 bits) multiply in float32 and round once, so a factor outside
    their range (e.g. ``2**-30`` for float16) is still applied exactly before rounding; a
    trace-time factor that a 16-bit dtype holds exactly multiplies in that dtype (the same
    value, see :func:`_native_16bit_factor`).
    """
    if isinstance(factor, (np.ndarray, np.generic)) and np.all(factor == 1):
        return data
    if _wide(data.dtype):
        return data * jnp.asarray(factor).astype(data.dtype)
    native = _native_16bit_factor(data, factor)
    if native is not None:
        return data * native
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
    scale = as_scale(x.scale)
    if scale is new_scale or (is_numpy(scale) and is_numpy(new_scale) and np.array_equal(scale, new_scale)):
        return ScaledArray(x.data, new_scale)
    return ScaledArray(mul_data(x.data, scale / new_scale), new_scale)


def zero_to_one(scale: Array) -> Array:
    """``scale`` with 0 replaced by 1: a common scale that can hold a non-zero value.

    A zero common scale means every operand was asserted zero; rescaling to it would compute
    ``0 / 0``.
    """
    return select(scale == 0, np.ones(np.shape(scale), scale.dtype), scale)


def _is_trace_time_constant(x: ScaledArray) -> bool:
    return not is_any_scale(x) and is_numpy(x.data) and is_numpy(x.scale)


def _fitting_scale(x: ScaledArray) -> np.ndarray:
    """For a trace-time constant: the smallest power of two at which its data fits its dtype
    with headroom (a factor 2 for 16- and 8-bit data, half the exponent range, ``2**64``, for
    float32), at least the smallest normal scale, at most the constant's own scale.

    A constant aligned with traced operands (a mask value ``-1e9`` in ``where(mask, x, -1e9)``,
    float32 max in ``nan_to_num``) then raises the common scale only as far as its data dtype
    needs: with float16 data ``-1e9`` fits at ``2**15``, where its own scale ``2**30`` would
    flush ``x``'s data to zero; float32 max fits at ``2**64`` rather than ``2**127``, which
    would leave ``x``'s float32 data subnormal.
    """
    own = as_scale(x.scale)
    info = jnp.finfo(x.dtype)
    headroom = 2.0 ** (int(info.maxexp) // 2) if info.bits >= 32 else 2.0
    data = np.asarray(x.data)
    if data.size and not any(data.strides):  # a broadcast scalar: one value to look at
        data = data.reshape(-1)[:1]
    with np.errstate(over="ignore", invalid="ignore"):
        magnitude = np.max(np.abs(data.astype(np.float64)) * np.asarray(own, np.float64), initial=0.0)
    if not np.isfinite(magnitude) or np.ndim(own) != 0:
        return own
    need = pow2_round_up(np.asarray(headroom * magnitude / float(info.max), scale_dtype()))
    return as_scale(np.minimum(own, np.maximum(need, scale_bounds()[0])))


def largest_scale(operands: Sequence[ScaledArray]) -> Array:
    """The largest scale among the operands that have one (any-scale operands skipped).

    Operands sharing one scale object count once (no ``max(s, s)`` equation). If the largest of several scales is 0
    (every operand asserted zero) the result is 1, so rescaling to it gives 0 rather than
    ``0 / 0``. Next to other operands, a trace-time constant counts with the smallest
    power-of-two scale at which it fits its data dtype (see :func:`_fitting_scale`).
    """
    fit_constants = not all(_is_trace_time_constant(x) for x in operands if not is_any_scale(x))
    scales = []
    for x in sorted(operands, key=lambda x: not _is_trace_time_constant(x)):  # NumPy scales fold first
        if not is_any_scale(x):
            s = _fitting_scale(x) if fit_constants and _is_trace_time_constant(x) else as_scale(x.scale)
            if not any(s is t for t in scales):
                scales.append(s)
    if not scales:
        return np.ones((), scale_dtype())
    out = scales[0]
    for s in scales[1:]:
        out = scale_max(out, s)
    if len(scales) > 1:
        out = zero_to_one(out)
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
    "align_to_largest",
    "any_scale_array",
    "as_scale",
    "is_any_scale",
    "zero_to_one",
    "is_numpy",
    "largest_scale",
    "mul_data",
    "rescale",
    "round_scale",
    "scale_bounds",
    "scaled_power",
    "scaled_product",
    "scale_div",
    "scale_dtype",
    "scale_max",
    "scale_min",
    "scale_mul",
    "select",
    "sqrt_size_pow2",
    "to_float32_value",
]
