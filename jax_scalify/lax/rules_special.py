"""Scale rules of the special functions, random sampling, bitcasts and the generic ``reduce``.

Families:

- special functions (``bessel_i0e``, ``bessel_i1e``, ``igamma``, ``igammac``,
  ``igamma_grad_a``, ``polygamma``, ``zeta``, ``regularized_incomplete_beta``): non-linear
  maps computed on the values (float32 for narrow data), output scale 1; ``bessel_i1e``,
  odd with ``i1e(x) ~ x / 2`` near 0, keeps the input's scale capped at 1 as the other maps
  with ``f(x) ~ c * x`` in :mod:`.rules_unary` do. ``random_gamma_grad`` is no primitive in
  JAX 0.10 (it is expanded into ``while`` loops of elementary operations).
- random sampling (``random_gamma``, ``rng_uniform``): ``NEVER``: the interpreter binds them
  on the plain values and their outputs are plain (random numbers carry no input scale).
- ``bitcast_convert_type``: plain output, the bits of the value ``data * scale`` in the
  data dtype (bitcasting the data would give the bits of another number).
- ``reduce`` (the generic, possibly variadic reduction with a user computation): a single
  ``add`` is unit-scaled like ``reduce_sum``; a computation made only of order operations
  (max, min, select, comparisons) commutes with a common positive scale, so the floating
  operands are aligned to their largest scale and the outputs keep it; any other
  computation runs on the values in the data dtype, floating outputs with scale 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal
from jax.extend.core import primitives as P

from ..core.array import ScaledArray, is_floating_dtype, unscaled
from ..core.registry import ScaledPrimitiveType, register_scaled_lax_op, register_scaled_op
from ..core.scaling import (
    align_to_largest,
    as_scale,
    num_elements,
    on_value,
    scale_capped_at_one,
    scaled_from_value,
    single_binary_reducer,
    to_float32_value,
    unit_scale,
    unit_scaled_sum,
    value_of,
)
from .rules_arithmetic import scaled_add

Array = Any


# --- private helpers -------------------------------------------------------------------------
def _on_values(prim, args: Sequence[Any], params: dict) -> ScaledArray:
    """``prim`` on the float32 values of the operands (plain operands as they are), scale 1."""
    dtype = next(a.dtype for a in args if isinstance(a, ScaledArray))
    return scaled_from_value(prim.bind(*(value_of(a) for a in args), **params), dtype, as_scale(1))


# Primitives that only select or compare values, or compute on non-floating ones: a
# computation made of these commutes with one positive scale applied to every float.
_ORDER_PRIMITIVES = frozenset(
    (P.max_p, P.min_p, P.select_n_p, P.eq_p, P.ne_p, P.lt_p, P.le_p, P.gt_p, P.ge_p)
    + (P.eq_to_p, P.lt_to_p, P.le_to_p, P.and_p, P.or_p, P.not_p, P.xor_p)
)


def _is_float_var(v: Any) -> bool:
    return hasattr(v.aval, "dtype") and is_floating_dtype(v.aval.dtype)


def _commutes_with_scale(jaxpr: Jaxpr, consts: Sequence[Any]) -> bool:
    """True if ``jaxpr`` only reorders, selects or compares its floating inputs.

    Every equation touching a float is an order primitive without a floating literal (a
    constant such as ``max(a, 0.5)`` would not scale with the operands), or a jitted call
    of such equations; equations on integers and booleans only are free.
    """
    if consts:
        return False
    for eqn in jaxpr.eqns:
        touches_float = any(_is_float_var(v) for v in [*eqn.invars, *eqn.outvars])
        if not touches_float:
            continue
        if eqn.primitive is P.jit_p:  # jnp.where and friends are jitted
            inner = eqn.params["jaxpr"]
            if _commutes_with_scale(inner.jaxpr, inner.consts):
                continue
            return False
        if eqn.primitive not in _ORDER_PRIMITIVES:
            return False
        if any(isinstance(v, Literal) and _is_float_var(v) for v in eqn.invars):
            return False
    return True


# --- special functions -----------------------------------------------------------------------
@register_scaled_lax_op
def scaled_bessel_i0e(x: ScaledArray, **params) -> ScaledArray:
    """Scale 1, computed on the value (float32 for narrow data)."""
    return on_value(P.bessel_i0e_p, x, params, unit_scale)


@register_scaled_lax_op
def scaled_bessel_i1e(x: ScaledArray, **params) -> ScaledArray:
    """Scale min(s, 1), computed on the value (float32 for narrow data): i1e(x) ~ x/2 near 0 keeps a small scale."""
    return on_value(P.bessel_i1e_p, x, params, scale_capped_at_one)


@register_scaled_lax_op
def scaled_igamma(a: ScaledArray, x: ScaledArray, **params) -> ScaledArray:
    """Scale 1, computed on the values (float32 for narrow data)."""
    return _on_values(P.igamma_p, (a, x), params)


@register_scaled_lax_op
def scaled_igammac(a: ScaledArray, x: ScaledArray, **params) -> ScaledArray:
    """Scale 1, computed on the values (float32 for narrow data)."""
    return _on_values(P.igammac_p, (a, x), params)


@register_scaled_lax_op
def scaled_igamma_grad_a(a: ScaledArray, x: ScaledArray, **params) -> ScaledArray:
    """Scale 1, computed on the values (float32 for narrow data)."""
    return _on_values(P.igamma_grad_a_p, (a, x), params)


@register_scaled_lax_op
def scaled_polygamma(m: ScaledArray, x: ScaledArray, **params) -> ScaledArray:
    """Scale 1, computed on the values (float32 for narrow data)."""
    return _on_values(P.polygamma_p, (m, x), params)


@register_scaled_lax_op
def scaled_zeta(x: ScaledArray, q: ScaledArray, **params) -> ScaledArray:
    """Scale 1, computed on the values (float32 for narrow data)."""
    return _on_values(P.zeta_p, (x, q), params)


@register_scaled_lax_op
def scaled_regularized_incomplete_beta(a: ScaledArray, b: ScaledArray, x: ScaledArray, **params) -> ScaledArray:
    """Scale 1, computed on the values (float32 for narrow data)."""
    return _on_values(P.regularized_incomplete_beta_p, (a, b, x), params)


# --- random sampling -------------------------------------------------------------------------
@register_scaled_op(P.random_gamma_p, scaled_type=ScaledPrimitiveType.NEVER)
def scaled_random_gamma(key: Array, alpha: Any, **params) -> Array:
    """Plain in and out: samples drawn with the value of alpha (never called by scalify, which binds it on values)."""
    return P.random_gamma_p.bind(key, unscaled(alpha), **params)


@register_scaled_op(P.rng_uniform_p, scaled_type=ScaledPrimitiveType.NEVER)
def scaled_rng_uniform(a: Any, b: Any, **params) -> Array:
    """Plain in and out: samples drawn between the values of a and b (never called by scalify, which binds it on values)."""
    return P.rng_uniform_p.bind(unscaled(a), unscaled(b), **params)


# --- bitcast ---------------------------------------------------------------------------------
@register_scaled_lax_op
def scaled_bitcast_convert_type(x: ScaledArray, **params) -> Array:
    """Plain output: the bits of the value data * scale in the data dtype (not of the data)."""
    return P.bitcast_convert_type_p.bind(x.to_array(x.dtype), **params)


# --- generic reduce --------------------------------------------------------------------------
@register_scaled_lax_op
def scaled_reduce(*args: Any, jaxpr: ClosedJaxpr, dimensions: Sequence[int], **params) -> list:
    """add: reduce_sum's rule, then the init added by add's; max/min/select/compare only: largest scale; else values, scale 1.

    The operands are the arrays to reduce followed by their init values. A single ``add``
    over one operand sums ``K`` terms (``K`` = the reduced size): scale ``s * r``, data
    ``/ r``, reduced with a zero init; the init value (not add's identity, or JAX would have
    emitted ``reduce_sum``) is then added once with the rule of ``add``. A computation that only orders its floats commutes with a common
    positive scale: every floating operand (init values included) is aligned to the largest
    scale (a 0 or ±inf init adopts it) and the floating outputs keep it. Anything else is
    evaluated on the values in the data dtype, floating outputs with scale 1.
    """
    bind_params = dict(jaxpr=jaxpr, dimensions=dimensions, **params)

    def bind(*datas: Array) -> list:
        return list(P.reduce_p.bind(*datas, **bind_params))

    scaled = [a for a in args if isinstance(a, ScaledArray)]
    reducer = single_binary_reducer(jaxpr.jaxpr, jaxpr.consts)
    if reducer is P.add_p and len(args) == 2 and len(scaled) == 2:
        operand, init = args
        num_terms = num_elements(operand.shape, dimensions)
        # Summed with add's identity (a reduce_sum for the dtype it is given), the init value added once, after.
        total = unit_scaled_sum(operand.scale, num_terms, lambda d: lax.reduce_sum(d, dimensions), operand.data)
        return [scaled_add(total, init)]
    if scaled and _commutes_with_scale(jaxpr.jaxpr, jaxpr.consts):
        aligned, scale = align_to_largest(scaled)
        it = iter(aligned)
        outs = bind(*(next(it).data if isinstance(a, ScaledArray) else a for a in args))
        return [ScaledArray(o, scale) if is_floating_dtype(o.dtype) else o for o in outs]
    outs = bind(*(to_float32_value(a).astype(a.dtype) if isinstance(a, ScaledArray) else a for a in args))
    return [ScaledArray(o, as_scale(1)) if is_floating_dtype(o.dtype) else o for o in outs]


__all__ = [
    "scaled_bessel_i0e",
    "scaled_bessel_i1e",
    "scaled_bitcast_convert_type",
    "scaled_igamma",
    "scaled_igamma_grad_a",
    "scaled_igammac",
    "scaled_polygamma",
    "scaled_random_gamma",
    "scaled_reduce",
    "scaled_regularized_incomplete_beta",
    "scaled_rng_uniform",
    "scaled_zeta",
]
