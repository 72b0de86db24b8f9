"""The scale arithmetic shared by the scale rules (and ``custom_scale``'s batching rule).

Exact power-of-two rescaling, the choice of common scales, and the building blocks that
several rule families use (values in float32, unit-scaled sums, exact roots, stacked scales).
Rule modules import from here only; nothing here knows about individual primitives.

Scale arithmetic is kept cheap at trace time: NumPy scales stay NumPy (folded in Python, no
equation), traced scalar scales are combined with single ``lax`` operations (``jnp.where``
and friends wrap a nested ``jit`` per call). Every scale is a power of two by contract unless
rounding is off (:func:`~jax_scalify.core.pow2.scales_are_pow2`), which lets rules take exact
shortcuts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Jaxpr, Primitive

from .array import ScaledArray, narrow_range
from .config import Pow2RoundMode, get_scalify_config
from .measure import (
    as_scale,
    is_wide_dtype,
    mul_data,
    saturated_cast,
    scale_bounds,
    scale_dtype,
)
from .pow2 import (
    binary,
    computed_once,
    is_numpy,
    numpy_api,
    pow2_exponent,
    pow2_round,
    pow2_round_down,
    pow2_round_up,
    scales_are_pow2,
)
from .promotion import any_scale_array, is_any_scale
from .sites import rescaled_into, rescales_in_backward_pass

Array = Any
ScaleMap = Callable[[Array], Array]


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
        out = binary(lax.mul, out, s)
    if const is not None and not (np.ndim(const) == 0 and const == 1):
        out = binary(lax.mul, out, const)
    return as_scale(out)


def scale_div(a: Array, b: Array) -> Array:
    """``a / b`` in the scale dtype (a power of two when both are)."""
    a, b = as_scale(a), as_scale(b)
    if is_numpy(b) and np.ndim(b) == 0 and b == 1:
        return a
    with np.errstate(divide="ignore", invalid="ignore"):  # a zero scale (asserted zero) gives inf or nan
        return as_scale(a / b)


def scaled_product(data: Array, a: Array, b: Array, *, divide: bool = False) -> ScaledArray:
    """``ScaledArray(data, a * b)`` (``a / b`` with ``divide``), the scale kept a normal number.

    Scale rule: the exact product (quotient) ``p`` of the scales when it lies within
    :func:`scale_bounds`; otherwise the nearest bound ``c``, and the excess ``p / c`` (a power
    of two for power-of-two scales) moves into the data, exactly, so ``data * scale`` is
    unchanged. An unguarded scale overflows to inf (``2**120 * 2**20``) or underflows to 0,
    and the value becomes inf or nan. Trace-time (NumPy) scales are always guarded, at no
    run-time cost. Traced scales are guarded only with
    ``ScalifyConfig(guard_traced_scales=True)``: five scalar operations and one multiply of
    the data by ``p / c`` (1 unless the scale left the range), a large addition to compile
    time (``docs/benchmarks.md``). A zero or non-finite ``p`` gives the unguarded values (``p / c`` is
    0, inf or nan).

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


def at_scale(x: ScaledArray, new_scale: Array) -> ScaledArray:
    """The same value as ``x`` with scale ``new_scale``: ``data * (scale / new_scale)``.

    An any-scale operand (0 or ±inf) keeps its data and just takes the new scale. The 16- or
    8-bit data of a scale known at trace time moved to a run-time scale (a constant aligned
    with traced data, see :func:`largest_scale`) saturate at the dtype's largest finite
    value where they do not fit: a mask at ``-1e30`` stays below every value it masks,
    where plain float16 would hold ``-inf``; and a nonzero constant does not round to 0 but
    to the dtype's smallest subnormal of its sign (see :func:`_moved_constant`).
    """
    new_scale = as_scale(new_scale)
    if is_any_scale(x):
        return ScaledArray(x.data, new_scale)
    if x.scale is new_scale:
        return x
    scale = as_scale(x.scale)
    if scale is new_scale or (is_numpy(scale) and is_numpy(new_scale) and np.array_equal(scale, new_scale)):
        return ScaledArray(x.data, new_scale)
    if is_numpy(scale) and not is_numpy(new_scale) and narrow_range(x.dtype):
        quotient = scale_quotient(scale, new_scale)
        if is_numpy(x.data):
            return ScaledArray(_moved_constant(np.asarray(x.data), quotient), new_scale)
        return ScaledArray(saturated_cast(widen(x.data) * quotient, x.dtype), new_scale)
    return ScaledArray(mul_data(x.data, scale_quotient(scale, new_scale)), new_scale)


def _moved_constant(data: np.ndarray, quotient: Array) -> Array:
    """16/8-bit constant data times a run-time ``quotient``: saturated, and never flushed to 0.

    A nonzero constant whose data at the new scale fall below the dtype's smallest subnormal
    becomes that subnormal (with its sign) rather than 0: ``sqrt(v) + 1e-8`` on float16 data
    at scale 0.5 kept its ``eps`` and Adam's ``m / (sqrt(v) + eps)`` stayed 0 where ``m`` and
    ``v`` are, instead of ``0 / 0``. The error is at most one subnormal step of the dtype at
    the new scale, the resolution of every result at that scale. A broadcast scalar is
    moved as a scalar, then broadcast.
    """
    shape, dtype = data.shape, data.dtype
    if data.size and not any(data.strides):
        data = data.reshape(-1)[:1].reshape(())
    narrow = saturated_cast(data.astype(np.float32) * quotient, dtype)
    nonzero = (data != 0) & np.isfinite(data)
    if np.any(nonzero):
        tiny = (np.sign(data) * np.float32(jnp.finfo(dtype).smallest_subnormal)).astype(dtype)
        narrow = lax.select(nonzero & (narrow == 0), jnp.broadcast_to(tiny, narrow.shape), narrow)
    return jnp.broadcast_to(narrow, shape)


def scale_quotient(scale: Array, common: Array) -> Array:
    """``scale / common`` for a scale moving to a ``common`` one that several operands share.

    XLA compiles a scalar division as a kernel of its own (it does not copy divisions into
    the kernels that use them). With power-of-two scales the quotient is computed as
    ``scale * (2 / common) * 0.5``, exactly: the division ``2 / common`` is then the same for
    every operand moving to ``common``, and XLA compiles it once. (``2 / common`` is a normal
    float32 for every normal ``common``; ``1 / 2**127`` would be subnormal, which XLA:CPU
    flushes to zero.) A scale equal to ``common`` gives exactly 1, also when both are inf (an
    unguarded product of scales that overflowed, see :func:`scaled_product`): the operand
    already at the common scale keeps its data, where ``inf / inf`` would make them nan.
    """
    if (is_numpy(scale) and is_numpy(common)) or not scales_are_pow2():
        return scale / common
    two = np.asarray(2, common.dtype)
    quotient = binary(lax.mul, binary(lax.mul, scale, binary(lax.div, two, common)), np.asarray(0.5, common.dtype))
    return select(binary(lax.eq, scale, common), np.ones(np.shape(quotient), common.dtype), quotient)


def zero_to_one(scale: Array) -> Array:
    """``scale`` with 0 replaced by 1: a common scale that can hold a non-zero value.

    A zero common scale means every operand was asserted zero; rescaling to it would compute
    ``0 / 0``.
    """
    return select(scale == 0, np.ones(np.shape(scale), scale.dtype), scale)


def value_order_data(x: ScaledArray) -> Array:
    """The data of ``x`` as its value orders, signs and zeroes them: ``data * sign(scale)``.

    For a rule that reads data for a result that is not scaled back by the scale (a
    comparison, an index, a sign, a sort key). A positive scale keeps the data exactly; a zero
    scale asserts that the value is zero whatever the (finite) data, and gives the zeros
    ``to_array`` gives. Two scalar equations and one multiply, fused with the reader.
    """
    x = with_scalar_scale(x)
    scale = x.scale
    if is_any_scale(x) or (is_numpy(scale) and np.all(scale > 0)):
        return x.data
    sign = np.sign(scale) if is_numpy(scale) else lax.sign(scale)
    if jnp.finfo(x.dtype).bits < 16:
        return mul_data(x.data, sign)
    return x.data * jnp.asarray(sign).astype(x.dtype)  # 0 and 1 are exact in every 16-bit dtype


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
    would leave ``x``'s float32 data subnormal. NaN and ±inf entries, the same at every scale,
    need none.
    """
    own = as_scale(x.scale)
    info = jnp.finfo(x.dtype)
    headroom = 2.0 ** (int(info.maxexp) // 2) if info.bits >= 32 else 2.0
    data = np.asarray(x.data)
    if data.size and not any(data.strides):  # a broadcast scalar: one value to look at
        data = data.reshape(-1)[:1]
    with np.errstate(over="ignore", invalid="ignore"):
        magnitudes = np.abs(data.astype(np.float64)) * np.asarray(own, np.float64)
    if np.ndim(own) != 0:
        return own
    # NaN and ±inf entries are the same at every scale: they need none.
    magnitude = np.max(magnitudes, where=np.isfinite(magnitudes), initial=0.0)
    need = pow2_round_up(np.asarray(headroom * magnitude / float(info.max), scale_dtype()))
    return as_scale(np.minimum(own, np.maximum(need, scale_bounds()[0])))


def constant_raises_scale(operands: Sequence[ScaledArray], above: float = 2.0**8) -> bool:
    """True if a trace-time constant among traced operands fits its data dtype only at a scale above ``above``.

    Aligned with them (:func:`largest_scale`), such a constant (float32's max in
    ``jnp.nan_to_num``: ``2**64``; ``-1e9`` with float16 data: ``2**15``) sets the common scale
    whatever the traced operands' values. Below ``2**8`` (a float16 mask at
    ``jnp.finfo(jnp.float16).min``, as Flax's attention writes it, fits at 2) the selected
    values only lose a few bits of their exponent range.
    """
    constants = [x for x in operands if _is_trace_time_constant(x)]
    traced = len(constants) < len([x for x in operands if not is_any_scale(x)])
    return traced and any(np.ndim(x.scale) == 0 and _fitting_scale(x) > above for x in constants)


def largest_scale(operands: Sequence[ScaledArray]) -> Array:
    """The largest scale among the operands that have one (any-scale operands skipped).

    An infinite scale counts only if every scale is (:func:`largest_finite`). Operands sharing
    one scale object count once (no ``max(s, s)`` equation). If the largest of several scales is 0
    (every operand asserted zero), or of one scale beside an any-scale ±inf, the result is 1,
    so rescaling to it gives 0 rather than ``0 / 0`` and the inf stays inf rather than
    ``inf * 0``. Next to other operands, a trace-time constant counts with the smallest
    power-of-two scale at which it fits its data dtype (see :func:`_fitting_scale`). With
    16- or 8-bit data, a scale known at trace time (a constant's, or that of a value computed
    from constants only, such as ``where(mask, 0, -1e9)`` under a traced mask) raises the
    common scale at most :func:`known_scale_reach` above the largest run-time scale: beyond
    that the run-time operands' data, unit-sized, would leave the dtype's normal range, and
    the known values saturate instead (:func:`at_scale`).
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
    known = [s for s in scales if is_numpy(s)]
    traced = [s for s in scales if not is_numpy(s)]
    narrow = [x.dtype for x in operands if narrow_range(x.dtype)]
    if known and traced and narrow:
        out = _largest(traced)
        reach = scale_mul(out, known_scale_reach(narrow[0]))
        out = scale_max(out, scale_min(_largest(known), reach))
    else:
        out = _largest(scales)
    if len(scales) > 1 or any(_may_be_infinite(x) for x in operands):
        out = zero_to_one(out)
    return out


def _may_be_infinite(x: ScaledArray) -> bool:
    """An any-scale operand that is (or, traced, may be) ±inf: a zero common scale would make it nan."""
    return is_any_scale(x) and not (is_numpy(x.data) and not np.any(np.isinf(x.data)))


def _largest(scales: Sequence[Array]) -> Array:
    out = scales[0]
    for s in scales[1:]:
        out = largest_finite(out, s)
    return out


def largest_finite(a: Array, b: Array) -> Array:
    """The larger of two scales if it is finite, else the smaller one (4 equations for traced scales).

    A traced scale is inf where an unguarded product of scales overflowed
    (:func:`scaled_product`): its operand's values are ±inf (or nan) at any finite scale, so
    a common scale aligned to inf would only flush the finite operands to ``0 * inf``. At the
    largest finite scale the finite operands keep their values and the infinite ones become
    ±inf data, as plain float32 gives.
    """
    hi, lo = scale_max(a, b), scale_min(a, b)
    if is_numpy(hi) and is_numpy(lo):
        return np.where(hi < np.inf, hi, lo).astype(hi.dtype)
    return select(binary(lax.lt, hi, np.inf), hi, lo)


def known_scale_reach(dtype: Any) -> np.ndarray:
    """How far above the run-time scales a scale known at trace time may raise a common scale of ``dtype`` data.

    ``2**-minexp``, the inverse of the smallest normal number (``2**14`` for float16 and
    E5M2, ``2**6`` for E4M3): unit-sized data moved that far down are still normal.
    """
    return as_scale(2.0 ** -int(jnp.finfo(dtype).minexp))


def align_to_largest(operands: Sequence[ScaledArray]) -> tuple[list[ScaledArray], Array]:
    """Rescale every operand to the largest scale; returns the rescaled operands and that scale."""
    scale = largest_scale(operands)
    return [at_scale(x, scale) for x in operands], scale


def to_float32_value(x: ScaledArray) -> Array:
    """The value ``data * scale`` in float32 (or the data dtype if it is wider)."""
    work = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    return x.data.astype(work) * jnp.asarray(x.scale).astype(work)


# --- building blocks of several rule families ---------------------------------------------
def widen(data: Array) -> Array:
    """Data in float32 when its dtype is narrower (16 or 8 bits), else unchanged."""
    return data.astype(np.float32) if jnp.finfo(data.dtype).bits < 32 else data


def scaled_from_value(result: Array, dtype: Any, scale: Array) -> ScaledArray:
    """A value computed in float32 as a ``ScaledArray`` of data dtype ``dtype`` and ``scale``.

    The data are ``result * (2 / scale) * 0.5``: XLA:CPU divides an array by a scalar through
    its reciprocal, which for a scale of ``2**127`` is subnormal and flushed to 0. Traced
    16- and 8-bit data are :func:`~jax_scalify.core.pow2.computed_once`: XLA would otherwise
    keep the float32 result (an ``exp``, a ``tanh``) in memory and narrow it in each kernel
    that reads it, the backward pass included; the barrier makes the producing kernel write
    the narrow data once (bit for bit the same values).
    """
    scale = as_scale(scale)
    if not (is_numpy(scale) and np.all(scale == 1)):
        with np.errstate(divide="ignore"):  # an asserted zero's data are inf or nan, as before
            twice_inverse = np.asarray(2, scale.dtype) / scale
        result = result * jnp.asarray(twice_inverse).astype(result.dtype) * np.asarray(0.5, result.dtype)
    data = result.astype(dtype)
    if np.dtype(dtype).itemsize < 4 and np.ndim(data):
        data = computed_once(data)
    return ScaledArray(data, scale)


def value_of(x: Any) -> Array:
    """Float32 value of a scaled operand (plain operands, e.g. integer exponents, unchanged)."""
    return to_float32_value(x) if isinstance(x, ScaledArray) else x


def unit_scale(scale: Array) -> Array:
    """Scale 1 whatever the input scale: for maps whose output magnitude does not follow the input's."""
    return as_scale(1)


def scale_capped_at_one(scale: Array) -> Array:
    """``min(s, 1)``; a zero or non-finite scale gives 1."""
    s = as_scale(scale)
    return as_scale(select((s > 0) & (s < 1), s, as_scale(1)))


def on_value(prim: Primitive, x: ScaledArray, params: dict, out_scale: ScaleMap) -> ScaledArray:
    """``prim`` on the value (float32 for narrow data), divided by the output scale, cast back."""
    return scaled_from_value(prim.bind(to_float32_value(x), **params), x.dtype, out_scale(x.scale))


def _pow2_small(t: Array, npapi) -> Array:
    """``2**t`` for ``t`` in {0, 1, 2}, exactly, in float32."""
    return npapi.where(t == 0, 1, npapi.where(t == 1, 2, 4)).astype(np.float32)


def _snap_pow2(s: Array) -> Array:
    """The power of two nearest to ``s``, for ``s`` within a few ulps of one (cbrt is not exact)."""
    return pow2_round_down(s * (1 + 2.0**-8))


def exact_root(x: ScaledArray, n: int, data_fn: Callable[[Array], Array], inverse: bool) -> ScaledArray:
    """``x ** (1/n)`` (``inverse``: ``x ** (-1/n)``) exact on the scale.

    The scale's exponent ``e`` is raised to the next multiple of ``n`` (``t = -e mod n``):
    data / 2**t, scale * 2**t, so the root of the scale is the exact power of two
    ``2**((e + t) / n)``. Without rounding (``Pow2RoundMode.NONE``) the root of the scale is
    taken as it is.
    """
    scale = as_scale(x.scale)
    npapi = numpy_api(scale)
    root = npapi.sqrt if n == 2 else npapi.cbrt
    if get_scalify_config().rounding_mode == Pow2RoundMode.NONE:
        data, out_scale = data_fn(value_order_data(x)), root(scale)
    elif npapi is np:
        t = npapi.remainder(-pow2_exponent(scale), n)
        factor = _pow2_small(t, npapi)
        data = _root_of_moved_data(x.data, np.sign(scale) / factor, data_fn)
        out_scale = _snap_pow2(_root_of_product(scale, factor.astype(scale.dtype), n))
    else:
        data, out_scale = _traced_root(x, scale, n, data_fn)
    if inverse:
        with np.errstate(divide="ignore"):  # the inverse root of an asserted zero is inf
            out_scale = 1 / out_scale
    return ScaledArray(data, as_scale(out_scale))


def _root_of_moved_data(data: Array, inverse: Array, data_fn: Callable[[Array], Array]) -> Array:
    """``data_fn(data * inverse)``, in float32 for narrow data.

    ``inverse`` (``2**-t``) would round float16/FP8 data away at the bottom of their range
    (the smallest subnormal halves to 0, whose square root has an infinite derivative), while
    the root itself lands well inside it: float32 holds the moved data exactly.
    """
    if is_wide_dtype(data.dtype):
        return data_fn(mul_data(data, inverse))
    moved = data.astype(jnp.float32) * jnp.asarray(inverse).astype(jnp.float32)
    return data_fn(moved).astype(data.dtype)


def _root_of_product(scale: Array, factor: Array, n: int) -> Array:
    """The ``n``-th root of ``scale * factor`` (``factor`` a power of two below ``2**n``) without overflowing.

    A scale near the top of the range times the factor leaves float32 (``2**127 * 2``): above
    1 the product is divided by ``2**n`` first and the root multiplied by 2, both exact.
    """
    npapi = numpy_api(scale)
    root = npapi.sqrt if n == 2 else npapi.cbrt
    with np.errstate(over="ignore", under="ignore"):  # NumPy evaluates both branches
        large = root(scale * (factor / factor.dtype.type(2**n))) * factor.dtype.type(2)
        return npapi.where(scale > 1, large, root(scale * factor))


def _traced_root(x: ScaledArray, scale: Array, n: int, data_fn: Callable[[Array], Array]) -> tuple[Array, Array]:
    """The rounding branch of :func:`exact_root` for a traced scale, in single ``lax`` operations.

    Same values as the NumPy branch: ``t = -e mod n`` from the exponent's bits, ``2**-t`` applied
    to the data as an exact constant, and a square root (exact: this branch runs only while
    rounding is on, where every scale is a power of two) is not snapped again.
    """
    e = pow2_exponent(scale)
    t = jax.lax.rem(-e, e.dtype.type(n))
    t = jax.lax.select(t < 0, t + e.dtype.type(n), t)
    factors, inverses = (1.0, 2.0, 4.0)[:n], (1.0, 0.5, 0.25)[:n]
    factor, inverse = (as_scale(factors[-1]), as_scale(inverses[-1]))
    for k in range(n - 2, -1, -1):
        factor = select(t == k, as_scale(factors[k]), factor)
        inverse = select(t == k, as_scale(inverses[k]), inverse)
    inverse = inverse * lax.sign(scale)  # an asserted zero (scale 0): data 0, whatever they were
    data = _root_of_moved_data(x.data, inverse, data_fn)
    out_scale = _root_of_product(scale, factor, n)
    if n != 2:  # cbrt is inexact; sqrt of a power of two with an even exponent is exact
        out_scale = _snap_pow2(out_scale)
    return data, out_scale


def num_elements(shape: Sequence[int], dims: Sequence[int]) -> int:
    """The number of elements along ``dims`` of ``shape`` (the terms of a reduction over them)."""
    return int(np.prod([shape[d] for d in dims], dtype=np.int64))


def unit_scaled_sum(
    scale: Array, num_terms: int, reduce: Callable[..., Array], *datas: Array, communicates: bool = False
) -> ScaledArray:
    """``reduce(*datas)`` summing ``num_terms`` terms: scale ``* r``, data ``/ r``.

    ``reduce`` must accept the datas in any floating dtype: the backward sums below call it
    on float32 copies of float16/FP8 data, so a reducer typed in the data dtype (an operand
    it closes over, a reduction jaxpr) must follow the dtype it is given. ``1/r`` goes on the inputs for narrow-range dtypes (no overflow of the sum), on the output
    otherwise (cheaper, exact). In the backward pass, under a rescale policy whose
    ``gradients`` component is on, a sum of float16/FP8 data is accumulated in float32 and
    rescaled from its result before it is narrowed (:func:`_rescaled_backward_sum`), unless
    it ``communicates`` (a collective: float32 would double the bytes sent).
    """
    r = sqrt_size_pow2(num_terms)
    inv_r = as_scale(1 / r)
    dtype = datas[0].dtype
    backward = not communicates and rescales_in_backward_pass()
    if narrow_range(dtype) and num_terms > 1 and backward:
        return _rescaled_backward_sum(scale, r, reduce, datas)
    if narrow_range(dtype):
        out = reduce(*[mul_data(d, inv_r) for d in datas])
    else:
        out = mul_data(reduce(*datas), inv_r)
    return scaled_product(out, scale, r)


def _rescaled_backward_sum(scale: Array, r: np.ndarray, reduce: Callable[..., Array], datas: Sequence[Array]):
    """A backward-pass sum of narrow data: accumulated in float32, its statistic moved into the scale, narrowed.

    Most sums of a backward pass are transposes of broadcasts: per-example (per-token,
    per-step) contributions to one gradient entry, which share its sign, so the sum grows
    up to ``K`` times a term rather than ``sqrt(K)``. Float16 data overflow at ``2**16``
    where the static ``sqrt(K)`` scale underestimates that, while a ``K`` scale would push
    the data of uncorrelated sums towards float16's subnormals. The result's own statistic
    settles it.
    """
    inv_r = as_scale(1 / r)
    wide = reduce(*[mul_data(d.astype(jnp.float32), inv_r) for d in datas])
    return rescaled_into(scaled_product(wide, scale, r), datas[0].dtype)


def single_binary_reducer(jaxpr: Jaxpr, consts: Sequence[Any]) -> Primitive | None:
    """The primitive ``p`` if the reducer is exactly ``lambda a, b: p(a, b)``, else None."""
    if consts or len(jaxpr.eqns) != 1 or len(jaxpr.invars) != 2:
        return None
    eqn = jaxpr.eqns[0]
    if set(eqn.invars) != set(jaxpr.invars) or list(eqn.outvars) != list(jaxpr.outvars):
        return None
    return eqn.primitive


def with_scalar_scale(x: ScaledArray) -> ScaledArray:
    """``x`` with a 0-d scale: a broadcast scale is folded into the data, keeping its largest entry."""
    if np.ndim(x.scale) == 0:
        return x
    if np.size(x.scale) == 1:
        return ScaledArray.unchecked(x.data, x.scale.reshape(()), any_scale=x.any_scale)
    new_scale = np.max(x.scale) if is_numpy(x.scale) else jnp.max(x.scale)
    return at_scale(x, new_scale)


def bind_keep_scale(prim: Primitive, x: ScaledArray, *others: Array, **params) -> ScaledArray:
    """``prim`` bound on the data of ``x`` (then ``others``, plain), the scale of ``x`` kept."""
    x = with_scalar_scale(x)
    return ScaledArray(prim.bind(x.data, *others, **params), x.scale)


def bind_aligned(prim: Primitive, operands: Sequence[ScaledArray], *others: Array, **params) -> ScaledArray:
    """``prim`` bound on operands aligned to their largest scale (then ``others``, plain)."""
    aligned, scale = align_to_largest([with_scalar_scale(x) for x in operands])
    return ScaledArray(prim.bind(*(x.data for x in aligned), *others, **params), scale)


def rebalance_stacked(data: Array, scales: Array) -> ScaledArray:
    """One ``ScaledArray`` from stacked data (axis 0) with one scale per slice.

    The common scale is the largest finite one; every slice is multiplied by ``its scale /
    common``, a power of two at most 1, so values are kept exactly unless they are more than
    the data dtype's range below the largest slice (then they underflow, as in any tensor
    with one scale). A slice with an infinite scale (an overflowed product of scales) gets
    ±inf data, as its values are in plain float32, and leaves the others finite. All slices
    asserted zero (scale 0) keep their data at scale 0.
    """
    scales = jnp.asarray(scales)
    if data.shape[0] == 0:
        return ScaledArray(data, jnp.ones((), scales.dtype))
    zero, one = jnp.zeros((), scales.dtype), jnp.ones((), scales.dtype)
    finite_top = jnp.max(select(scales < np.inf, scales, jnp.zeros_like(scales)))
    top = select(finite_top > 0, finite_top, select(jnp.max(scales) > 0, one, zero))
    safe_top = select(top > 0, top, one).astype(jnp.float32)
    quotient = scale_quotient(scales.astype(jnp.float32), safe_top)  # XLA:CPU's s / 2**127 flushes to 0
    ratio = select(top > 0, quotient, jnp.ones(scales.shape, jnp.float32))
    ratio = ratio.reshape((ratio.shape[0],) + (1,) * (data.ndim - ratio.ndim) + ratio.shape[1:])
    return ScaledArray(mul_data(data, ratio), top)


__all__ = [
    "ScaleMap",
    "align_to_largest",
    "saturated_cast",
    "any_scale_array",
    "as_scale",
    "bind_aligned",
    "bind_keep_scale",
    "exact_root",
    "is_any_scale",
    "is_numpy",
    "largest_scale",
    "mul_data",
    "narrow_range",
    "num_elements",
    "numpy_api",
    "on_value",
    "rebalance_stacked",
    "at_scale",
    "round_scale",
    "scale_bounds",
    "scale_capped_at_one",
    "scale_div",
    "scale_dtype",
    "scale_max",
    "scale_min",
    "scale_mul",
    "scaled_from_value",
    "scaled_power",
    "scaled_product",
    "select",
    "single_binary_reducer",
    "sqrt_size_pow2",
    "unit_scale",
    "unit_scaled_sum",
    "value_order_data",
    "widen",
    "with_scalar_scale",
    "zero_to_one",
]
