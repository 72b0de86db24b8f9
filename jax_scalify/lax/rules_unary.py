"""Scale rules of the unary elementwise primitives.

Families:

- sign changes (``neg``, ``abs``): data mapped, scale kept;
- powers (``integer_pow``, ``square``, ``sqrt``, ``rsqrt``, ``cbrt``, ``pow`` by a constant):
  exact on the scale, ``f(d * s) = f(d) * f(s)``; for roots and fractional powers the part of
  the scale's exponent that does not divide moves into the data first, so the output scale is
  again an exact power of two;
- ``log``: ``log(d) + log(s)`` with the exponents summed exactly, output scale 1;
- other non-linear maps: computed on the value ``d * s`` (in float32 for narrow data). The
  output scale is 1, except for the maps with ``f(x) ~ c * x`` near 0 (``sin``, ``tanh``,
  ``erf``, ...), whose output has the input's scale capped at 1, and for the roundings
  (``floor``, ``ceil``, ``round``), whose output has the input's scale floored at 1: this
  is the unit-scaling choice (the output magnitude of a unit-scaled input) and it keeps FP16
  and FP8 data from under- or overflowing;
- ``sign`` and ``is_finite``: plain outputs (they carry no magnitude).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.extend.core import primitives as P

from ..core.array import ScaledArray
from ..core.constants import exact_scalar, known_scalar
from ..core.measure import narrowed_within_range
from ..core.pow2 import exp2_int, pow2_exponent
from ..core.registry import register_scaled_lax_op, register_scaled_op
from ..core.scaling import (
    ScaleMap,
    as_scale,
    exact_root,
    is_any_scale,
    is_numpy,
    narrow_range,
    on_value,
    scale_capped_at_one,
    scaled_from_value,
    scaled_power,
    select,
    unit_scale,
    value_of,
    value_order_data,
    widen,
)
from ..core.sites import active_policy, rescale_operand

Array = Any


# --- private helpers -------------------------------------------------------------------------
def _scale_floored_at_one(scale: Array) -> Array:
    """``max(s, 1)``; a non-finite scale gives 1."""
    s = as_scale(scale)
    finite = np.isfinite(s) if is_numpy(s) else jax.lax.is_finite(s)
    return as_scale(select(finite & (s > 1), s, as_scale(1)))


def _on_value_rule(prim: Primitive, out_scale: ScaleMap, doc: str) -> Callable[..., ScaledArray]:
    """Register and return the rule ``scaled_<name>`` computing ``prim`` on the value."""

    def rule(x: ScaledArray, **params) -> ScaledArray:
        return on_value(prim, x, params, out_scale)

    rule.__name__ = rule.__qualname__ = f"scaled_{prim.name}"
    rule.__doc__ = doc
    return register_scaled_op(prim, rule)


# --- sign changes ----------------------------------------------------------------------------
@register_scaled_lax_op(scalar_preserving=lambda scalar, **params: -scalar)
def scaled_neg(x: ScaledArray, **params) -> ScaledArray:
    """Scale kept, data negated."""
    return ScaledArray(P.neg_p.bind(x.data, **params), as_scale(x.scale))


@register_scaled_lax_op
def scaled_abs(x: ScaledArray, **params) -> ScaledArray:
    """Scale kept, abs of the data."""
    return ScaledArray(P.abs_p.bind(x.data, **params), as_scale(x.scale))


@register_scaled_lax_op
def scaled_sign(x: ScaledArray, **params) -> Array:
    """Plain output (same dtype): sign of the data, since the scale is positive (0 for an asserted zero).

    The result is -1, 0 or 1 with no magnitude to carry; a later op with scaled operands
    promotes it to scale 1.
    """
    return P.sign_p.bind(value_order_data(x), **params)


@register_scaled_lax_op
def scaled_is_finite(x: ScaledArray, **params) -> Array:
    """Plain bool: is_finite of the data (and of the scale, when it is not a known finite constant)."""
    out = P.is_finite_p.bind(x.data, **params)
    if is_numpy(x.scale) and np.all(np.isfinite(x.scale)):
        return out
    return out & jnp.isfinite(x.scale)


# --- roundings -------------------------------------------------------------------------------
_ROUNDING_DOC = "Scale max(s, 1), computed on the value (float32 for narrow data): integers keep large magnitudes."
scaled_floor = _on_value_rule(P.floor_p, _scale_floored_at_one, _ROUNDING_DOC)
scaled_ceil = _on_value_rule(P.ceil_p, _scale_floored_at_one, _ROUNDING_DOC)
scaled_round = _on_value_rule(P.round_p, _scale_floored_at_one, _ROUNDING_DOC)


# --- powers and roots ------------------------------------------------------------------------
@register_scaled_lax_op
def scaled_integer_pow(x: ScaledArray, *, y: int, **params) -> ScaledArray:
    """Scale s**y (exact for a power of two; past the float32 range the excess goes into the data), data da**y.

    A base with ``|y| >= 3`` is first rescaled under the rescale policy's ``self_products``
    (and the equations after the power read it rescaled): a power multiplies the data's
    departure from unit size by ``y``. A cube of float16 data overflows from a departure of
    2**5.3; in float32 a departure of 2**26 cubes to data that a derivative (the tanh GELU's)
    underflows and a scale that it overflows (NaN). Squares stay static in scale.

    A square or a negative power of narrow (float16, FP8) data is computed in float32 and
    narrowed with its scale raised where its largest entry would overflow (a scale that
    stays ``s**y`` unless it would). For negative powers the smallest entries of the base
    decide, which no statistic of the base bounds (``0.0036 ** -2`` overflows float16 data
    even where the base's entries fit one scale). A square overflows float16 data from a
    departure of 2**8 (the tanh GELU's derivative squares its input in every tangent and
    backward pass).
    """
    if abs(y) >= 3 and active_policy().self_products:
        x = rescale_operand(x)
    return _power(x, lambda d: P.integer_pow_p.bind(d, y=y, **params), y, in_float32=y < 0 or y == 2)


@register_scaled_lax_op
def scaled_square(x: ScaledArray, **params) -> ScaledArray:
    """Scale s**2 (exact for a power of two), data da**2; narrow data squared in float32 (see integer_pow)."""
    return _power(x, lambda d: P.square_p.bind(d, **params), 2, in_float32=True)


def _power(x: ScaledArray, power_of: Callable[[Any], Any], y: int, in_float32: bool) -> ScaledArray:
    """Scale s**y, data ``power_of(d)``; with ``in_float32``, narrow data are raised in float32 and narrowed within range.

    Narrowed, the power's data are moved up where their largest entry is below ``2**-8``: the
    square of float16 data of ``4e-3`` would be a subnormal ``1.7e-5``, and a division by it
    (as in the backward pass of ``norm.logpdf``) would overflow.
    """
    if in_float32 and narrow_range(x.dtype):
        return narrowed_within_range(scaled_power(power_of(widen(x.data)), x.scale, y), x.dtype, lift=True)
    return scaled_power(power_of(x.data), x.scale, y)


@register_scaled_lax_op
def scaled_pow(a: ScaledArray, b: Any, **params) -> ScaledArray:
    """Scale 2**floor(k*y) for a constant exponent y (s = 2**k, the rest in the data); else scale 1, on the values.

    An integral ``y`` (``x ** 3.0``, ``jnp.linalg.norm(x, ord=3)``) follows ``integer_pow``.
    Another ``y`` splits ``s ** y = 2 ** (k * y)`` (``s = 2 ** k``) into the scale
    ``2 ** floor(k * y)`` and a factor in ``[1, 2)`` multiplied into ``d ** y`` (computed in
    float32 for narrow data): at scale 1, float16 data would flush ``|x| ** 3.0`` of entries
    near ``1e-3`` to 0. A traced exponent (or an asserted-zero base): scale 1, computed on the
    values (float32 for narrow data); ``b`` may be a plain integer array.
    """
    y = _constant_exponent(b)
    if y is None or not isinstance(a, ScaledArray) or is_any_scale(a):
        return scaled_from_value(P.pow_p.bind(value_of(a), value_of(b), **params), a.dtype, 1)
    if y.is_integer() and abs(y) <= 2**15:
        return scaled_integer_pow(a, y=int(y))
    factor, scale = _fractional_power_of_scale(as_scale(a.scale), y)
    data = jax.lax.pow(widen(value_order_data(a)), np.float32(y)) * factor  # scale 0: 0 ** y
    return ScaledArray(data.astype(a.dtype), scale)


def _constant_exponent(b: Any) -> float | None:
    """The exponent as a Python float when it is one scalar known at trace time, else None."""
    if isinstance(b, ScaledArray):
        if not (is_numpy(b.scale) and np.ndim(b.scale) == 0) or is_any_scale(b):
            return None
        scalar = known_scalar(b.data)
        return None if scalar is None else float(np.float64(scalar) * np.float64(b.scale))
    scalar = known_scalar(b)
    return None if scalar is None else float(scalar)


def _fractional_power_of_scale(scale: Array, y: float) -> tuple[Array, Array]:
    """``(factor, out_scale)`` with ``factor * out_scale = scale ** y``, ``out_scale`` a normal power of two.

    With ``scale = 2 ** k``: ``out_scale = 2 ** q``, ``q = floor(k * y)`` clamped to float32's
    normal exponents, and ``factor = 2 ** (k * y - q)`` (in ``[1, 2)`` unless clamped). For a
    traced ``k`` the product is taken as ``k * y_hi + k * y_lo``, ``y_hi`` the exponent's 12
    leading bits, so that ``k * y_hi`` is exact in float32 and the fraction keeps its accuracy
    for large ``|k|``.
    """
    info = np.finfo(np.float32)
    if is_numpy(scale):
        ky = np.float64(pow2_exponent(scale)) * y
        q = np.clip(np.floor(ky), info.minexp, info.maxexp - 1)
        return np.float32(2.0 ** (ky - q)), as_scale(np.float32(2.0**q))
    mantissa, exponent = np.frexp(y)
    y_hi = np.float32(np.ldexp(np.round(np.ldexp(mantissa, 12)), exponent - 12))
    y_lo = np.float32(y - np.float64(y_hi))
    k = pow2_exponent(scale).astype(jnp.float32)
    product = k * y_hi
    q = jnp.clip(jnp.floor(product), info.minexp, info.maxexp - 1)
    factor = jnp.exp2((product - q) + k * y_lo)
    return factor, as_scale(exp2_int(q.astype(jnp.int32), jnp.float32, jnp))


@register_scaled_lax_op(scalar_preserving=exact_scalar(np.sqrt))
def scaled_sqrt(x: ScaledArray, **params) -> ScaledArray:
    """Scale sqrt(s) exactly (an odd exponent moves a factor 2 into the data), data sqrt(d)."""
    return exact_root(x, 2, lambda d: P.sqrt_p.bind(d, **params), inverse=False)


@register_scaled_lax_op
def scaled_rsqrt(x: ScaledArray, **params) -> ScaledArray:
    """Scale 1/sqrt(s) exactly (an odd exponent moves a factor 2 into the data), data rsqrt(d)."""
    return exact_root(x, 2, lambda d: P.rsqrt_p.bind(d, **params), inverse=True)


@register_scaled_lax_op
def scaled_cbrt(x: ScaledArray, **params) -> ScaledArray:
    """Scale cbrt(s) exactly (the exponent's remainder mod 3 moves into the data), data cbrt(d)."""
    return exact_root(x, 3, lambda d: P.cbrt_p.bind(d, **params), inverse=False)


# --- log -------------------------------------------------------------------------------------
@register_scaled_lax_op
def scaled_log(x: ScaledArray, **params) -> ScaledArray:
    """Scale 1, data log(d) + log(s) (float32 for narrow data), the binary exponents summed exactly.

    With ``d * s = m * 2**E``, ``m`` in ``[sqrt(1/2), sqrt(2))`` (both factors split with
    frexp, exponents added as integers), the result is ``log(m) + E * log(2)``: a large data
    and a small scale cancel exactly, and values near 1 keep their relative accuracy.
    """
    data = widen(x.data)
    md, ed = jnp.frexp(data)
    if is_numpy(x.scale) and np.ndim(x.scale) == 0:
        ms, es = np.frexp(np.asarray(x.scale, data.dtype))
        es = np.asarray(es, np.int32)
    else:
        ms, es = jnp.frexp(jnp.asarray(x.scale).astype(data.dtype))
    if is_numpy(ms) and ms == 0.5:  # a constant power-of-two scale: frexp(md / 2) is (md, -1) exactly
        m, e = md, np.int32(-1)
    else:
        m, e = jnp.frexp(md * ms)
    small = jnp.abs(m) < np.sqrt(0.5)
    m = jnp.where(small, m * 2, m)
    exponent = (ed + es + e - small.astype(e.dtype)).astype(data.dtype)
    out = P.log_p.bind(m, **params) + exponent * np.asarray(np.log(2.0), data.dtype)
    return ScaledArray(out.astype(x.dtype), as_scale(1))


# --- other non-linear maps -------------------------------------------------------------------
_UNIT_DOC = "Scale 1, computed on the value (float32 for narrow data)."
_CAPPED_DOC = "Scale min(s, 1), computed on the value (float32 for narrow data): f(x) ~ c*x near 0 keeps a small scale."

scaled_exp = _on_value_rule(P.exp_p, unit_scale, _UNIT_DOC)
scaled_exp2 = _on_value_rule(P.exp2_p, unit_scale, _UNIT_DOC)
scaled_cos = _on_value_rule(P.cos_p, unit_scale, _UNIT_DOC)
scaled_cosh = _on_value_rule(P.cosh_p, unit_scale, _UNIT_DOC)
scaled_acos = _on_value_rule(P.acos_p, unit_scale, _UNIT_DOC)
scaled_acosh = _on_value_rule(P.acosh_p, unit_scale, _UNIT_DOC)
scaled_logistic = _on_value_rule(P.logistic_p, unit_scale, _UNIT_DOC)
scaled_erfc = _on_value_rule(P.erfc_p, unit_scale, _UNIT_DOC)
scaled_lgamma = _on_value_rule(P.lgamma_p, unit_scale, _UNIT_DOC)
scaled_digamma = _on_value_rule(P.digamma_p, unit_scale, _UNIT_DOC)

scaled_log1p = _on_value_rule(P.log1p_p, scale_capped_at_one, _CAPPED_DOC)
scaled_expm1 = _on_value_rule(P.expm1_p, scale_capped_at_one, _CAPPED_DOC)
scaled_tanh = _on_value_rule(P.tanh_p, scale_capped_at_one, _CAPPED_DOC)
scaled_erf = _on_value_rule(P.erf_p, scale_capped_at_one, _CAPPED_DOC)
scaled_erf_inv = _on_value_rule(P.erf_inv_p, scale_capped_at_one, _CAPPED_DOC)
scaled_sin = _on_value_rule(P.sin_p, scale_capped_at_one, _CAPPED_DOC)
scaled_tan = _on_value_rule(P.tan_p, scale_capped_at_one, _CAPPED_DOC)
scaled_asin = _on_value_rule(P.asin_p, scale_capped_at_one, _CAPPED_DOC)
scaled_atan = _on_value_rule(P.atan_p, scale_capped_at_one, _CAPPED_DOC)
scaled_sinh = _on_value_rule(P.sinh_p, scale_capped_at_one, _CAPPED_DOC)
scaled_asinh = _on_value_rule(P.asinh_p, scale_capped_at_one, _CAPPED_DOC)
scaled_atanh = _on_value_rule(P.atanh_p, scale_capped_at_one, _CAPPED_DOC)


__all__ = [
    "scaled_abs",
    "scaled_acos",
    "scaled_acosh",
    "scaled_asin",
    "scaled_asinh",
    "scaled_atan",
    "scaled_atanh",
    "scaled_cbrt",
    "scaled_ceil",
    "scaled_cos",
    "scaled_cosh",
    "scaled_digamma",
    "scaled_erf",
    "scaled_erf_inv",
    "scaled_erfc",
    "scaled_exp",
    "scaled_exp2",
    "scaled_expm1",
    "scaled_floor",
    "scaled_integer_pow",
    "scaled_pow",
    "scaled_is_finite",
    "scaled_lgamma",
    "scaled_log",
    "scaled_log1p",
    "scaled_logistic",
    "scaled_neg",
    "scaled_round",
    "scaled_rsqrt",
    "scaled_sign",
    "scaled_sin",
    "scaled_sinh",
    "scaled_sqrt",
    "scaled_square",
    "scaled_tan",
    "scaled_tanh",
]
