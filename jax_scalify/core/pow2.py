"""Exact power-of-two arithmetic: decompose, round, mantissa.

Every function here is exact for normal and subnormal inputs: exponents are read and powers
of two are built from the bit patterns, never through ``log2``/``exp2`` (inexact) or
products with subnormals (flushed to zero by XLA on CPU). Special values follow the IEEE
conventions: ``0 -> scale 0``, ``±inf -> scale inf``, ``nan -> nan``.

The functions accept NumPy values (computed with NumPy, at trace time) or JAX arrays and
tracers (computed with ``jax.numpy``).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .config import Pow2RoundMode, get_scalify_config

Array = Any


def _np_api(x):
    return np if isinstance(x, (np.ndarray, np.generic, float, int)) else jnp


def _compute_dtype(dtype) -> np.dtype:
    """Float type in which ``dtype`` values are decomposed exactly (float32 or float64)."""
    return np.dtype(np.float64) if np.dtype(dtype).itemsize == 8 else np.dtype(np.float32)


def _exp2_int(exponent: Array, dtype, npapi) -> Array:
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


def pow2_decompose(
    x: Array, scale_dtype: Any = None, mode: Pow2RoundMode = Pow2RoundMode.DOWN
) -> tuple[Array, Array]:
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
    npapi = _np_api(x)
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
    scale = _exp2_int(exponent, work, npapi)
    finite = npapi.isfinite(x)
    scale = npapi.where(frac == 0, npapi.asarray(0, work), scale)  # not x == 0: CPU flushes subnormals
    scale = npapi.where(finite, scale, npapi.abs(x.astype(work)))
    mantissa = npapi.where(npapi.isinf(x), npapi.sign(x.astype(work)), mantissa)
    mantissa = npapi.where(npapi.isnan(x), npapi.asarray(np.nan, work), mantissa)
    return scale.astype(scale_dtype), mantissa.astype(x.dtype)


def pow2_round_down(x: Array) -> Array:
    """``sign(x) * 2**floor(log2|x|)``, exact; 0, ±inf and nan are returned unchanged."""
    scale, mantissa = pow2_decompose(x, mode=Pow2RoundMode.DOWN)
    return _apply_sign(scale, mantissa)


def pow2_round_up(x: Array) -> Array:
    """``sign(x) * 2**ceil(log2|x|)``, exact; 0, ±inf and nan are returned unchanged."""
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
    """``floor(log2|x|)`` as int32 (or int64 for float64) for finite non-zero ``x``, exactly."""
    npapi = _np_api(x)
    _, exp = _frexp(npapi.asarray(x), npapi)
    return exp - 1


def _apply_sign(scale, mantissa):
    npapi = _np_api(scale)
    # A select and a negation, not a product: products flush subnormals on CPU.
    signed = npapi.where(mantissa < 0, -scale, scale)
    return signed.astype(mantissa.dtype)
