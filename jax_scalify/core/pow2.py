"""Exact power-of-two arithmetic: decompose, round, mantissa.

Every function here is exact for normal and subnormal inputs: exponents are read and powers
of two are built from the bit patterns, never through ``log2``/``exp2`` (inexact) or
products with subnormals (flushed to zero by XLA on CPU). Special values follow the IEEE
conventions: ``0 -> scale 0``, ``±inf -> scale inf``, ``nan -> nan``.

The functions accept NumPy values (computed with NumPy, at trace time) or JAX arrays and
tracers (computed with ``jax.numpy``).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .config import Pow2RoundMode, get_scalify_config

Array = Any


def is_numpy(x: Any) -> bool:
    """A trace-time constant: a NumPy array or scalar, or a Python number (folded in Python, no equation)."""
    return isinstance(x, (np.ndarray, np.generic, float, int))


_OPERATORS = {
    lax.add: operator.add,
    lax.sub: operator.sub,
    lax.mul: operator.mul,
    lax.div: operator.truediv,
    lax.lt: operator.lt,
    lax.le: operator.le,
    lax.gt: operator.gt,
    lax.ge: operator.ge,
    lax.eq: operator.eq,
    lax.ne: operator.ne,
    lax.bitwise_and: operator.and_,
    lax.bitwise_or: operator.or_,
    lax.max: lambda a, b: numpy_api(a, b).maximum(a, b),
    lax.min: lambda a, b: numpy_api(a, b).minimum(a, b),
}


def binary(op: Callable[[Array, Array], Array], a: Any, b: Any) -> Array:
    """``op(a, b)`` for a ``lax`` binary operation: one equation where an operand is traced.

    The operator (``a * b``, ``a < b`` ...) on a traced array goes through ``jax.numpy``,
    whose nested ``jit`` costs several times the equation to trace; scale arithmetic is
    made of such operations. ``lax`` takes the operands directly when the traced one fixes
    the dtype: the other of the same dtype and of the same shape or rank 0, or a Python
    number (taken in that dtype, as ``jax.numpy`` takes it). Otherwise, and for two
    trace-time constants (NumPy), the operator with its usual promotion.
    """
    operands = _lax_operands(a, b)
    if operands is None:
        return _OPERATORS[op](a, b)
    return op(*operands)


def _lax_operands(a: Any, b: Any) -> tuple[Any, Any] | None:
    """``(a, b)`` ready for a ``lax`` binary operation (Python numbers in the traced dtype), or None."""
    traced = [x for x in (a, b) if isinstance(x, (jax.Array, jax.core.Tracer))]
    if not traced:
        return None
    dtype, shape = traced[0].dtype, np.shape(traced[0])
    out = []
    for x in (a, b):
        if isinstance(x, bool):
            return None
        if isinstance(x, (int, float)):
            if isinstance(x, float) and not jnp.issubdtype(dtype, jnp.floating):
                return None
            converted = np.asarray(x).astype(dtype)
            if converted.item() != x and x == x:  # rounded or out of range (NaN is kept: it is unequal to itself)
                return None
            x = converted
        elif getattr(x, "dtype", None) != dtype or np.shape(x) not in (shape, ()):
            return None
        out.append(x)
    return out[0], out[1]


def numpy_api(*xs: Any) -> Any:
    """``numpy`` when every input is a trace-time constant (so the result folds), else ``jax.numpy``."""
    return np if all(is_numpy(x) for x in xs) else jnp


def scales_are_pow2() -> bool:
    """Whether every scale is a power of two (or 0, inf, nan) by contract: True unless rounding is off.

    ``ScaledArray`` rejects a concrete scale that is not 0 or a positive power of two, and
    the rules round every scale they compute, so the rules may use exact shortcuts (the
    scale of a sum of two power-of-two scales rounded down is the larger one). Under
    ``Pow2RoundMode.NONE`` scales are whatever the rules compute, and the rules take their
    general formulas. A traced scale given by the user is trusted to honour the contract.
    """
    return get_scalify_config().rounding_mode != Pow2RoundMode.NONE


def _compute_dtype(dtype) -> np.dtype:
    """Float type in which ``dtype`` values are decomposed exactly (float32 or float64)."""
    return np.dtype(np.float64) if np.dtype(dtype).itemsize == 8 else np.dtype(np.float32)


def exp2_int(exponent: Array, dtype, npapi) -> Array:
    """``2**exponent`` in ``dtype``, built from bits: exact for subnormal results too.

    Exponents above the dtype's range give inf, below its smallest subnormal give 0.
    """
    dtype = np.dtype(dtype)
    work = _compute_dtype(dtype)
    info = np.finfo(work)
    int_t = np.int64 if work.itemsize == 8 else np.int32
    nmant = info.nmant
    min_exp = info.minexp  # exponent of the smallest normal
    e = npapi.asarray(exponent).astype(int_t)
    normal_bits = (npapi.clip(e, min_exp, info.maxexp - 1) - min_exp + 1).astype(int_t) << nmant
    sub_shift = npapi.clip(e - (min_exp - nmant), 0, nmant - 1).astype(int_t)
    subnormal_bits = npapi.left_shift(npapi.ones_like(e), sub_shift)
    bits = npapi.where(e >= min_exp, normal_bits, subnormal_bits)
    if npapi is np:
        value = np.asarray(bits).view(work)
    else:
        value = jax.lax.bitcast_convert_type(bits, work)
    value = npapi.where(e >= info.maxexp, npapi.asarray(np.inf, work), value)
    value = npapi.where(e < min_exp - nmant, npapi.asarray(0, work), value)
    return value.astype(dtype)


def _frexp(x: Array, npapi):
    """``frexp`` in float32/64 (exact for every narrower float type).

    NumPy's ``frexp`` is exact. On the JAX path the exponent and the fraction are read from
    the bits (``jnp.frexp`` returns ``(0.5, -149)`` for every float32 subnormal on CPU).
    """
    work = _compute_dtype(x.dtype)
    x = npapi.asarray(x).astype(work)
    if npapi is np:
        return np.frexp(x)
    return _frexp_from_bits(x)


def _frexp_from_bits(x: Array):
    info = np.finfo(x.dtype)
    nbits, nmant = info.bits, info.nmant
    int_t, uint_t = (jnp.int64, jnp.uint64) if nbits == 64 else (jnp.int32, jnp.uint32)
    bias = info.maxexp - 1
    bits = jax.lax.bitcast_convert_type(x, uint_t)
    sign = bits & uint_t(1 << (nbits - 1))
    magnitude = bits & uint_t((1 << (nbits - 1)) - 1)
    field = (magnitude >> nmant).astype(int_t)
    # Subnormals: normalise by shifting the leading one up to the implicit-bit position.
    shift = jnp.where(field == 0, jax.lax.clz(magnitude).astype(int_t) - (nbits - 1 - nmant), 0)
    shift = jnp.clip(shift, 0, nmant)
    normalised = jnp.where(field == 0, magnitude << shift.astype(uint_t), magnitude)
    exponent = jnp.where(field == 0, 1 - shift, field) - bias + 1  # frexp convention: [1/2, 1)
    frac_bits = (normalised & uint_t((1 << nmant) - 1)) | uint_t((bias - 1) << nmant) | sign
    frac = jax.lax.bitcast_convert_type(frac_bits, x.dtype)
    special = (magnitude == 0) | (field == 2 * bias + 1)  # zero, inf, nan: frexp returns x, 0
    return jnp.where(special, x, frac), jnp.where(special, 0, exponent).astype(jnp.int32)


def _check_mode(mode: Pow2RoundMode) -> Pow2RoundMode:
    if mode is None:
        return get_scalify_config().rounding_mode
    if not isinstance(mode, Pow2RoundMode):
        raise ValueError(f"Expected a jsa.Pow2RoundMode, got {mode!r}.")
    if mode == Pow2RoundMode.STOCHASTIC:
        raise NotImplementedError("Pow2RoundMode.STOCHASTIC is not implemented yet; use DOWN or UP.")
    return mode


def pow2_decompose(x: Array, scale_dtype: Any = None, mode: Pow2RoundMode = Pow2RoundMode.DOWN) -> tuple[Array, Array]:
    """Split ``x`` into ``(scale, mantissa)`` with ``x == scale * mantissa`` exactly.

    Args:
        x: floating array (or scalar).
        scale_dtype: dtype of the returned scale (default: ``x``'s dtype).
        mode: ``DOWN``: ``scale = 2**floor(log2|x|)``, ``|mantissa|`` in ``[1, 2)``;
            ``UP``: ``scale = 2**ceil(log2|x|)``, ``|mantissa|`` in ``(1/2, 1]``;
            ``NONE``: ``scale = |x|``, ``mantissa = sign(x)``.

    Returns:
        ``(scale, mantissa)``: the scale is non-negative (the sign stays in the mantissa), in
        ``scale_dtype``; the mantissa has ``x``'s dtype. ``0`` gives ``(0, 0)``, ``±inf`` gives
        ``(inf, ±1)`` and ``nan`` gives ``(nan, nan)``.
    """
    npapi = numpy_api(x)
    x = npapi.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"pow2_decompose expects a floating array, got dtype {x.dtype}.")
    mode = _check_mode(mode)
    scale_dtype = np.dtype(scale_dtype or x.dtype)
    work = _compute_dtype(x.dtype)
    if mode == Pow2RoundMode.NONE:
        scale = npapi.abs(x).astype(scale_dtype)
        return scale, npapi.sign(x)
    frac, exp = _frexp(x, npapi)  # x = frac * 2**exp, |frac| in [1/2, 1)
    if mode == Pow2RoundMode.DOWN:
        mantissa, exponent = frac * 2, exp - 1
    else:
        exact = npapi.abs(frac) == 0.5
        mantissa = npapi.where(exact, frac * 2, frac)
        exponent = npapi.where(exact, exp - 1, exp)
    scale = exp2_int(exponent, work, npapi)
    finite = npapi.isfinite(x)
    scale = npapi.where(frac == 0, npapi.asarray(0, work), scale)  # not x == 0: CPU flushes subnormals
    scale = npapi.where(finite, scale, npapi.abs(x.astype(work)))
    mantissa = npapi.where(npapi.isinf(x), npapi.sign(x.astype(work)), mantissa)
    mantissa = npapi.where(npapi.isnan(x), npapi.asarray(np.nan, work), mantissa)
    return scale.astype(scale_dtype), mantissa.astype(x.dtype)


def pow2_round_down(x: Array) -> Array:
    """``sign(x) * 2**floor(log2|x|)``, exact; 0, ±inf and nan are returned unchanged."""
    if _use_bits(x):
        return _bits_round(x, up=False)
    scale, mantissa = pow2_decompose(x, mode=Pow2RoundMode.DOWN)
    return _apply_sign(scale, mantissa)


def pow2_round_up(x: Array) -> Array:
    """``sign(x) * 2**ceil(log2|x|)``, exact; 0, ±inf and nan are returned unchanged."""
    if _use_bits(x):
        return _bits_round(x, up=True)
    scale, mantissa = pow2_decompose(x, mode=Pow2RoundMode.UP)
    return _apply_sign(scale, mantissa)


def pow2_round(x: Array, mode: Pow2RoundMode | None = None) -> Array:
    """Round ``x`` to a power of two with ``mode`` (default: the configured rounding mode).

    ``Pow2RoundMode.NONE`` returns ``x`` unchanged.
    """
    mode = _check_mode(mode)
    if mode == Pow2RoundMode.NONE:
        return x
    if mode == Pow2RoundMode.UP:
        return pow2_round_up(x)
    return pow2_round_down(x)


def get_mantissa(x: Array) -> Array:
    """Mantissa of ``x`` in ``[1, 2)`` (sign kept): ``x == get_mantissa(x) * pow2_round_down(|x|)``."""
    return pow2_decompose(x, mode=Pow2RoundMode.DOWN)[1]


def pow2_exponent(x: Array) -> Array:
    """``floor(log2|x|)`` as int32 (or int64 for float64) for finite non-zero ``x``, exactly.

    0, ±inf and nan give -1 (``frexp``'s exponent 0, minus one).
    """
    if _use_bits(x):
        return _bits_exponent(x)
    npapi = numpy_api(x)
    _, exp = _frexp(npapi.asarray(x), npapi)
    return exp - 1


def _apply_sign(scale, mantissa):
    npapi = numpy_api(scale)
    # A select and a negation, not a product: products flush subnormals on CPU.
    signed = npapi.where(mantissa < 0, -scale, scale)
    return signed.astype(mantissa.dtype)


# --- lean bit-level paths for JAX values ------------------------------------------------------
# The functions above, written with ``jax.numpy``, emit some sixty equations (a dozen of them
# nested ``jit`` calls of ``jnp.where``/``jnp.clip``) per traced scalar. Scalify rounds a
# traced scale in many rules, so the lean versions below, a dozen ``lax`` operations on the
# bit pattern, are used for JAX arrays and tracers; they give the same values (NumPy inputs
# keep the NumPy path, folded at trace time). Only integer operations touch the bits, so a
# backend that flushes subnormal floats to zero cannot change the result.


def _use_bits(x) -> bool:
    return isinstance(x, (jax.Array, jax.core.Tracer)) and jnp.issubdtype(x.dtype, jnp.floating)


def _bits_layout(dtype) -> tuple[np.dtype, np.dtype, int, int]:
    """``(work float dtype, unsigned dtype of its bits, mantissa bits, exponent bias)``."""
    work = _compute_dtype(dtype)
    uint = np.dtype(np.uint64) if work.itemsize == 8 else np.dtype(np.uint32)
    info = np.finfo(work)
    return work, uint, int(info.nmant), int(info.maxexp) - 1


def _bits_fields(x: Array):
    """Bits of ``x`` in its work dtype, split into sign, magnitude and the magnitude's power of two.

    ``pow_mag`` is the bit pattern of ``2**floor(log2|x|)``: the exponent field alone for
    normal numbers, the highest set bit for subnormals (garbage for 0, handled by callers).
    """
    work, uint, nmant, _ = _bits_layout(x.dtype)
    nbits = 8 * uint.itemsize
    u = uint.type
    bits = lax.bitcast_convert_type(lax.convert_element_type(x, work), uint)
    sign_bit = u(1 << (nbits - 1))
    sign = lax.bitwise_and(bits, sign_bit)
    mag = lax.bitwise_and(bits, u((1 << (nbits - 1)) - 1))
    exp_field = u(((1 << (nbits - 1)) - 1) ^ ((1 << nmant) - 1))
    normal = lax.bitwise_and(mag, exp_field)
    subnormal = lax.shift_right_logical(jnp.asarray(sign_bit), lax.clz(mag))
    pow_mag = lax.select(lax.lt(mag, u(1 << nmant)), subnormal, normal)
    return work, bits, sign, mag, pow_mag, exp_field


def _bits_round(x: Array, up: bool) -> Array:
    """``sign(x) * 2**floor(log2|x|)`` (``up``: ``ceil``) from the bit pattern, in ``x``'s dtype."""
    work, bits, sign, mag, pow_mag, exp_field = _bits_fields(x)
    u = bits.dtype.type
    if up:  # the next power of two: exponent + 1 (normal), highest bit doubled (subnormal)
        next_mag = lax.add(pow_mag, lax.min(pow_mag, u(1 << _bits_layout(x.dtype)[2])))
        pow_mag = lax.select(lax.eq(mag, pow_mag), pow_mag, next_mag)
    out = lax.bitwise_or(sign, pow_mag)
    out = lax.select(lax.eq(mag, u(0)), mag, out)  # ±0 -> +0
    out = lax.select(lax.gt(mag, exp_field), bits, out)  # nan stays nan
    return lax.convert_element_type(lax.bitcast_convert_type(out, work), x.dtype)


def _bits_exponent(x: Array) -> Array:
    """``floor(log2|x|)`` from the bit pattern; -1 for 0, ±inf and nan (as ``frexp`` gives)."""
    work, uint, nmant, bias = _bits_layout(x.dtype)
    _, _, _, mag, _, exp_field = _bits_fields(x)
    u = uint.type
    int_t = np.dtype(np.int64) if uint.itemsize == 8 else np.dtype(np.int32)
    nbits = 8 * uint.itemsize
    normal = lax.sub(lax.convert_element_type(lax.shift_right_logical(mag, u(nmant)), int_t), int_t.type(bias))
    top_bit = lax.sub(int_t.type(nbits - 1), lax.convert_element_type(lax.clz(mag), int_t))
    subnormal = lax.sub(top_bit, int_t.type(bias + nmant - 1))
    exponent = lax.select(lax.lt(mag, u(1 << nmant)), subnormal, normal)
    special = lax.bitwise_or(lax.eq(mag, u(0)), lax.ge(mag, exp_field))
    return lax.select(special, lax.full_like(exponent, -1), exponent)


def pow2_round_positive_or_one(x: Array, mode: Pow2RoundMode | None = None) -> Array:
    """``pow2_round(x, mode)`` where ``x > 0``, and 1 elsewhere (0, negative, nan), for a JAX ``x``.

    Equal to ``where(pow2_round(x) > 0, pow2_round(x), 1)`` in a few bit operations: a
    positive ``x`` rounds to a positive power of two (``inf`` stays ``inf``), and ``x > 0``
    holds exactly when the rounded value is positive (also where a backend treats
    subnormals as zero in comparisons).
    """
    mode = _check_mode(mode)
    x = jnp.asarray(x)
    one = lax.full_like(x, 1)
    if mode == Pow2RoundMode.NONE:
        return lax.select(lax.gt(x, lax.full_like(x, 0)), x, one)
    work, uint, nmant, _ = _bits_layout(x.dtype)
    nbits = 8 * uint.itemsize
    u = uint.type
    xw = lax.convert_element_type(x, work)
    bits = lax.bitcast_convert_type(xw, uint)
    exp_field = u(((1 << (nbits - 1)) - 1) ^ ((1 << nmant) - 1))
    # Only positive values are kept, so the sign bit is clear where it matters.
    normal = lax.bitwise_and(bits, exp_field)
    subnormal = lax.shift_right_logical(jnp.asarray(u(1 << (nbits - 1))), lax.clz(bits))
    pow_bits = lax.select(lax.lt(bits, u(1 << nmant)), subnormal, normal)
    if mode == Pow2RoundMode.UP:
        next_bits = lax.add(pow_bits, lax.min(pow_bits, u(1 << nmant)))
        pow_bits = lax.select(lax.eq(bits, pow_bits), pow_bits, next_bits)
    rounded = lax.convert_element_type(lax.bitcast_convert_type(pow_bits, work), x.dtype)
    return lax.select(lax.gt(xw, lax.full_like(xw, 0)), rounded, one)


def pow2_twice_reciprocal(scale: Array) -> Array:
    """``2 / scale`` for a power-of-two ``scale``, exactly, in four integer operations on its bits.

    ``2 / 2**e = 2**(1 - e)`` is a normal number for every normal ``2**e`` (``1 / 2**127``
    would be subnormal, which XLA:CPU flushes to zero). Its bits are the exponent field
    subtracted from the all-ones exponent field, the sign carried by the subtraction's
    wrap-around: ``±0`` and subnormals give ``±inf``, ``±inf`` gives ``±0``, NaN gives 0.
    XLA copies integer operations into the kernels that use them, where a scalar division
    is compiled as a kernel of its own.
    """
    if not _use_bits(scale):
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.asarray(2, np.asarray(scale).dtype) / scale
    work, uint, nmant, _ = _bits_layout(scale.dtype)
    nbits = 8 * uint.itemsize
    u = uint.type
    sign_and_exponent = u(((1 << nbits) - 1) ^ ((1 << nmant) - 1))
    all_ones_exponent = u(((1 << (nbits - 1)) - 1) ^ ((1 << nmant) - 1))
    bits = lax.bitcast_convert_type(lax.convert_element_type(scale, work), uint)
    out = lax.sub(all_ones_exponent, lax.bitwise_and(bits, sign_and_exponent))
    return lax.convert_element_type(lax.bitcast_convert_type(out, work), scale.dtype)


def computed_once(x: Array) -> Array:
    """``x``, bit for bit, as a value that XLA computes once rather than in every kernel reading it.

    XLA copies a cheap elementwise producer into each kernel that consumes it; a chain of
    scale arithmetic, or of aligned sums, read by many kernels is then compiled (and run)
    many times. A division it does not copy, so ``x``'s bits are divided by an integer
    that is always 1 (``(bits >> (n - 1)) | 1``: XLA cannot prove it, hence cannot fold it):
    exact, on the bits, so no floating-point simplification applies. The chain before it
    becomes the producer of one kernel: for values read by several kernels only.
    """
    if is_numpy(x):
        return x
    return _bits_divided_by_one(x)


@jax.custom_jvp
def _bits_divided_by_one(x: Array) -> Array:
    dtype = np.dtype(x.dtype)
    uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[dtype.itemsize]
    bits = lax.bitcast_convert_type(x, uint)
    one = lax.shift_right_logical(bits, uint(8 * dtype.itemsize - 1)) | uint(1)
    return lax.bitcast_convert_type(lax.div(bits, one), dtype)


@_bits_divided_by_one.defjvp
def _bits_divided_by_one_jvp(primals, tangents):
    """The identity's derivative: JAX would see integer bits, whose derivative is 0."""
    (x,), (t,) = primals, tangents
    return _bits_divided_by_one(x), t


def map_scalars(fn: Callable[..., tuple[Array, ...]], *columns: Sequence[Array]) -> list[tuple[Array, ...]]:
    """``fn`` applied to each row of scalars ``(columns[0][i], columns[1][i], ...)``: one tuple of results per row.

    ``fn`` must be elementwise (the same arithmetic on scalars as on vectors), as the scale
    arithmetic of a batch of tensors is. XLA:CPU and XLA:GPU want it in different forms, so
    ``lax.platform_dependent`` picks at lowering. For XLA:CPU, ``fn`` runs on each row's
    scalars, which XLA copies into the kernels that read them: kernels of same-shaped tensors
    stay identical, and XLA:CPU compiles identical kernels once. Elsewhere ``fn`` runs once on
    the stacked columns, :func:`computed_once`, each row reading its entries: XLA:GPU fuses
    sibling kernels that read one vector into one kernel. A single row takes the first form.
    """
    n = len(columns[0])
    if n == 1:
        return [tuple(fn(*(column[0] for column in columns)))]
    flat = [jnp.asarray(x) for column in columns for x in column]
    apart, together = functools.partial(_mapped_apart, fn, n), functools.partial(_mapped_together, fn, n)
    return jax.lax.platform_dependent(*flat, cpu=apart, default=together)


def _mapped_apart(fn: Callable, n: int, *flat: Array) -> list[tuple[Array, ...]]:
    """``fn`` on each row's scalars; ``flat`` holds the columns one after the other."""
    return [tuple(fn(*flat[i::n])) for i in range(n)]


def _mapped_together(fn: Callable, n: int, *flat: Array) -> list[tuple[Array, ...]]:
    """``fn`` once on the stacked columns, each result computed once and sliced per row."""
    outs = fn(*(jnp.stack(flat[j : j + n]) for j in range(0, len(flat), n)))
    outs = [computed_once(out) for out in outs]
    return [tuple(out[i] for out in outs) for i in range(n)]
