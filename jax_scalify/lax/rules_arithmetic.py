"""Scale rules of the elementwise arithmetic primitives: add, mul, max, select, comparisons, casts.

Families:

- sums (``add``, ``sub``, ``add_any``): output scale ``pow2(sqrt(sa**2 + sb**2))``, both
  data rebalanced to it; an any-scale operand (constant 0 or ±inf) takes the other's scale;
- products (``mul``, ``div``): scales multiplied or divided, data likewise;
- order-preserving selections (``max``, ``min``, ``clamp``, ``select_n``) and comparisons:
  every operand aligned to the largest scale; comparisons give plain booleans;
- scale-keeping maps (``convert_element_type`` between floats, ``reduce_precision``,
  ``stop_gradient``, ``copy``): act on the data only;
- the rest (``pow``, ``rem``, ``atan2``, ``nextafter``) act on values or aligned data, see
  each rule.

Every primitive is bound on the data with the equation's own params, so 0-d operands next
to N-d ones (``mul a 2.0:f32[]``) work as in the plain program.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.extend.core import primitives as P

from ..core.array import ScaledArray, is_floating_dtype
from ..core.config import Pow2RoundMode, get_scalify_config
from ..core.constants import exact_scalar
from ..core.measure import lowered_to_largest_entry
from ..core.pow2 import binary, computed_once, pow2_round_positive_or_one
from ..core.registry import Site, register_scaled_lax_op, register_scaled_op
from ..core.scaling import (
    as_scale,
    at_scale,
    constant_raises_scale,
    is_any_scale,
    is_numpy,
    largest_finite,
    largest_scale,
    mul_data,
    narrow_range,
    round_scale,
    saturated_cast,
    scale_max,
    scale_min,
    scaled_from_value,
    scaled_product,
    select,
    to_float32_value,
    value_of,
    value_order_data,
    widen,
    zero_to_one,
)
from ..core.sites import (
    active_policy,
    inherit_mark,
    is_self_product,
    rescale_self_product,
    rescaled_from_data,
    rescaled_into,
    rescales_cast,
    rescales_in_backward_pass,
)

Array = Any


# --- private helpers -------------------------------------------------------------------------
def _data(x: Any) -> Array:
    return x.data if isinstance(x, ScaledArray) else x


def _bind(prim: Primitive, *operands: Any, **params) -> Array:
    """``prim`` bound on the data of the operands (plain operands as they are)."""
    return prim.bind(*(_data(x) for x in operands), **params)


def _aligned_wide_data(operands: Sequence[ScaledArray]) -> list[Array]:
    """Data of the operands aligned to the largest scale, in float32 for narrow dtypes.

    Nothing is rounded back to a narrow dtype, so comparisons stay exact. An operand whose
    scale is the common one is read as its value orders it (:func:`value_order_data`: an
    asserted zero, scale 0, compares as 0 whatever its data).
    """
    scale = largest_scale(operands)
    out = []
    for x in operands:
        own = as_scale(x.scale)
        same = own is scale or (is_numpy(own) and is_numpy(scale) and np.array_equal(own, scale))
        if is_any_scale(x):
            out.append(widen(x.data))
        elif same:
            out.append(widen(value_order_data(x)))
        else:
            out.append(mul_data(widen(x.data), own / scale))
    return out


def _sum_scale(a: ScaledArray, b: ScaledArray) -> Array:
    """``pow2(sqrt(sa**2 + sb**2))``; an any-scale operand defers to the other one.

    Computed as ``hi * sqrt(1 + (lo / hi)**2)`` so that large scales do not overflow; a zero
    result (both scales 0, i.e. both operands asserted zero) becomes 1.

    For power-of-two scales (the contract, see :func:`~jax_scalify.core.pow2.scales_are_pow2`)
    and the default rounding down, this is exactly ``hi`` (``1 <= sqrt(1 + (lo/hi)**2) <= sqrt(2)``),
    with 1 for a zero or nan result: seven cheap equations instead of the general formula.
    An infinite scale (an overflowed product of scales) defers to a finite one
    (:func:`largest_finite`): finite operands keep their values beside an infinite one. Two
    infinite scales give 1, where both operands' data become ±inf, and ``inf - inf`` is nan
    as in plain float32 (their data, at unknown true scales, cannot be added).
    """
    if is_any_scale(a) and is_any_scale(b):
        return as_scale(1)
    if is_any_scale(a) or is_any_scale(b):
        return as_scale((b if is_any_scale(a) else a).scale)
    sa, sb = as_scale(a.scale), as_scale(b.scale)
    if is_numpy(sa) and is_numpy(sb):
        hi, lo = np.maximum(sa, sb), np.minimum(sa, sb)
        ratio = np.where(hi > 0, lo / np.where(hi > 0, hi, 1), 0)
        scale = round_scale(hi * np.sqrt(1 + ratio * ratio))
        return as_scale(np.where(scale > 0, scale, 1))
    if sa is sb:  # one scale object: hi = lo = s, and pow2(sqrt(2) * s) is s when rounding down
        if get_scalify_config().rounding_mode == Pow2RoundMode.DOWN:
            return sa
    one = as_scale(1)
    if get_scalify_config().rounding_mode == Pow2RoundMode.DOWN:
        common = largest_finite(sa, sb)
        usable = binary(lax.bitwise_and, binary(lax.gt, common, 0.0), binary(lax.lt, common, np.inf))
        return select(usable, common, one)
    hi, lo = scale_max(sa, sb), scale_min(sa, sb)
    # Where hi <= 0 or a scale is nan the result is 1 whatever the ratio (0 * inf and nan
    # propagate to the final guard), so the ratio needs no guard of its own.
    ratio = lo / hi
    return as_scale(pow2_round_positive_or_one(hi * lax.sqrt(1 + ratio * ratio)))


def _on_grid_sum(prim: Primitive, a: ScaledArray, b: ScaledArray, params: dict) -> ScaledArray | None:
    """The sum at the scale of the operand on the other's grid (``grid_of``), or None if neither is.

    That operand's scale equals the other's wherever the other's is not 0, so the other
    operand's data are read as they are (factor 1), as 0 where its scale is 0 (asserted zero)
    and as nan where it is nan (an invalid input scale stays visible): no common scale is
    computed and no data are moved by a run-time factor. ``optax.apply_updates`` adds
    ``jsa.optim.scale_state``'s compensated updates to their parameters so.
    """
    if b.grid_of is not None and b.grid_of is a.scale:
        anchor, follower = a, b
    elif a.grid_of is not None and a.grid_of is b.scale:
        anchor, follower = b, a
    else:
        return None
    if is_any_scale(anchor) or is_numpy(anchor.scale):
        return None
    same = binary(lax.eq, anchor.scale, follower.scale)
    zero = binary(lax.eq, anchor.scale, np.float32(0))
    nan = np.full(np.shape(anchor.scale), np.nan, np.dtype(anchor.scale.dtype))
    factor = select(same, np.ones_like(nan), select(zero, np.zeros_like(nan), nan))
    anchor_data = mul_data(anchor.data, factor)
    datas = (anchor_data, follower.data) if anchor is a else (follower.data, anchor_data)
    return ScaledArray(prim.bind(*datas, **params), follower.scale)


def _scaled_sum(prim: Primitive, a: ScaledArray, b: ScaledArray, params: dict) -> ScaledArray:
    """The sum at :func:`_sum_scale`; computed once where both operands are aligned at run time.

    Both operands at their own run-time scales cost a convert-multiply-convert each beside
    the sum. XLA copies such cheap elementwise work into every kernel that reads the sum,
    and a residual stream chains one sum per block (forward ``x + f(x)``, backward the
    cotangents added back): copied, every block's alignment work would be compiled and run
    again in the kernels of every later block, work that grows as the square of the depth.
    :func:`~jax_scalify.core.pow2.computed_once` keeps each such sum one kernel's result.
    """
    on_grid = _on_grid_sum(prim, a, b, params)
    if on_grid is not None:
        return on_grid
    scale = _sum_scale(a, b)
    if _is_backward_sum_to_rescale(a, b):
        out = _backward_sum_in_float32(prim, a, b, scale, params)
    else:
        out = ScaledArray(_bind(prim, at_scale(a, scale), at_scale(b, scale), **params), scale)
    if _aligned_at_run_time(a, b) and np.ndim(out.data):
        out = ScaledArray.unchecked(
            computed_once(out.data), out.scale, rescaled=out.rescaled, pinned=out.pinned, sparse=out.sparse
        )
    return out


def _aligned_at_run_time(a: ScaledArray, b: ScaledArray) -> bool:
    """Two operands with distinct run-time scales: each has data moved by a run-time factor."""
    return a.scale is not b.scale and not any(is_any_scale(x) or is_numpy(x.scale) for x in (a, b))


def _is_backward_sum_to_rescale(a: ScaledArray, b: ScaledArray) -> bool:
    """A backward-pass sum of two operands with their own run-time scales, not both chosen from their data.

    Two operands whose scales a policy site chose from their data both hold unit-sized
    data: the static sum's assumption holds, and the sum needs no statistic of its own.
    """
    both_measured = rescaled_from_data(a) and rescaled_from_data(b)
    return _aligned_at_run_time(a, b) and not both_measured and rescales_in_backward_pass()


def _backward_sum_in_float32(prim: Primitive, a: ScaledArray, b: ScaledArray, scale, params: dict) -> ScaledArray:
    """``a + b`` in the backward pass: summed in float32 (or wider), rescaled from its result, narrowed without overflow.

    The static scale is about the larger operand scale, which is right when both operands
    have unit-sized data. In a backward pass an operand's data is often far below that: a
    product with a factor that cancelled (the tanh GELU's derivative multiplies the cotangent
    by ``x``, ``3 * x ** 2`` and ``1 - tanh(...) ** 2``, 0 where tanh saturates, so that term
    carries the scale of ``x ** 3`` with data near 0); at that scale the other operand, which
    holds the value, is flushed in float16, and the result's scale compounds from block to
    block (in float32 too).

    The sum is taken at the smaller operand scale, which a zero statistic keeps: an all-zero
    cotangent (a zero-initialised output layer) does not carry the ``x ** 3`` scale of each
    GELU it goes through (``2**20`` per layer for inputs near ``2**10``), whose zero data
    would later flush the first real gradient added to an optimizer moment of that scale. A
    scale of 0 (an operand asserted zero at run time: the zero cotangent a transposed loop
    starts its carries with) is not a candidate, and the work scale is at most ``2**50``
    below the static one: the data of the other operand then stay within the range where the
    statistic is exact, and one rescale brings the sum to unit size.
    """
    sa, sb = as_scale(a.scale), as_scale(b.scale)
    positive = lambda s: binary(lax.gt, s, 0.0)  # noqa: E731
    smaller = scale_min(select(positive(sa), sa, sb), select(positive(sb), sb, sa))
    work_scale = scale_max(smaller, binary(lax.mul, scale, np.float32(2.0**-50)))
    wide = [ScaledArray(widen(x.data), x.scale) for x in (a, b)]
    total = ScaledArray(_bind(prim, *(at_scale(x, work_scale).data for x in wide), **params), work_scale)
    return rescaled_into(total, a.dtype)


def _scaled_aligned(prim: Primitive, operands: Sequence[Any], params: dict, bounds: Sequence[int] = ()) -> ScaledArray:
    """``prim`` on the data of the floating operands aligned to their largest scale.

    ``bounds`` (for clamps: ``+1`` a lower bound, ``-1`` an upper bound, ``0`` neither, per
    operand) round a trace-time constant moved to a larger scale in narrow data towards the
    side that keeps it a bound, :func:`_bound_rescaled`.
    """
    bounds = list(bounds) or [0] * len(operands)
    scale = _bounded_scale(operands, bounds)
    inputs = [
        _bound_rescaled(x, scale, bound) if isinstance(x, ScaledArray) else x for x, bound in zip(operands, bounds)
    ]
    return ScaledArray(_bind(prim, *inputs, **params), scale)


def _bounded_scale(operands: Sequence[Any], bounds: Sequence[int]) -> Array:
    """The common scale of ``operands``; a bound that no value at the others' scale can cross does not raise it.

    A constant lower bound below ``-max * s`` (``max`` the largest finite value of the
    16- or 8-bit data dtype, ``s`` the largest scale of the other operands), or an upper
    bound above ``max * s``, is below (above) every value those operands can hold: at scale
    ``s`` it saturates at ``-max`` (``max``) and the result is the same. ``jnp.clip(x,
    -1e30, 1e30)`` on float16 data at scale 2 keeps scale 2 (aligned to the constants' scale,
    the data would be flushed).
    """
    scaled = [x for x in operands if isinstance(x, ScaledArray)]
    binding = [x for x, bound in zip(operands, bounds) if isinstance(x, ScaledArray) and not _never_binds(x, bound)]
    full = largest_scale(binding or scaled)
    outer = {i: _outer_magnitude(x, bound) for i, (x, bound) in enumerate(zip(operands, bounds)) if bound}
    outer = {i: m for i, m in outer.items() if m is not None}
    rest = [x for i, x in enumerate(operands) if isinstance(x, ScaledArray) and i not in outer]
    if not outer or not rest or all(is_numpy(x.scale) for x in rest):
        return full
    rest_scale = largest_scale(rest)
    largest = float(jnp.finfo(rest[0].dtype).max)
    nearest = min(min(outer.values()), float(np.finfo(np.float32).max))
    beyond = jnp.asarray(rest_scale) * np.float32(largest) <= np.float32(nearest)
    beyond = beyond & (jnp.asarray(rest_scale) > 0)  # asserted zeros (scale 0) cannot hold the bounds
    return as_scale(jnp.where(beyond, rest_scale, full))


def _never_binds(x: Any, bound: int) -> bool:
    """An any-scale ``-inf`` lower bound or ``+inf`` upper bound (``max(x, -inf)`` in softmax): it takes no part in the common scale."""
    if not (bound and is_any_scale(x) and is_numpy(x.data)):
        return False
    return bool(np.all(x.data == (-np.inf if bound > 0 else np.inf)))


def _outer_magnitude(x: Any, bound: int) -> float | None:
    """For a 16/8-bit trace-time constant on the side a bound does not bind (negative for a
    lower bound, positive for an upper one): its smallest magnitude; else ``None``."""
    if not isinstance(x, ScaledArray) or not narrow_range(x.dtype) or is_any_scale(x):
        return None
    if not (is_numpy(x.data) and is_numpy(x.scale)) or np.ndim(x.scale) != 0 or np.size(x.data) == 0:
        return None
    values = np.asarray(x.data, np.float64) * np.float64(x.scale)
    if not (np.all(values < 0) if bound > 0 else np.all(values > 0)):
        return None
    return float(np.min(np.abs(values)))


def _bound_rescaled(x: ScaledArray, scale: Array, bound: int) -> ScaledArray:
    """``x`` rescaled to ``scale``; a narrow constant bound rounded up (``bound > 0``) or down (``< 0``).

    A floor such as ``max(d2, 1e-8)`` on float16 data at scale 32 would round the constant's
    data ``3e-10`` to 0, and ``sqrt`` of the floor would then have an infinite derivative:
    rounded up, to the smallest subnormal, the result stays at least ``1e-8`` (a coarser
    floor, never a lower one), as ``min`` keeps a rounded-down ceiling at most the constant.
    Only trace-time constants (NumPy scales) are rounded so: their scale is usually far from
    the tensor's, a tensor's data move by less than an ulp either way.
    """
    if not bound or is_any_scale(x) or not (is_numpy(x.scale) and narrow_range(x.dtype)):
        return at_scale(x, scale)
    scale = as_scale(scale)
    if is_numpy(scale) and np.array_equal(x.scale, scale):
        return ScaledArray(x.data, scale)
    exact = widen(x.data) * jnp.asarray(as_scale(x.scale) / as_scale(scale), jnp.float32)
    rounded = saturated_cast(exact, x.dtype)  # see largest_scale
    missed = rounded.astype(jnp.float32) < exact if bound > 0 else rounded.astype(jnp.float32) > exact
    largest = float(jnp.finfo(x.dtype).max)
    towards = jnp.full(rounded.shape, largest if bound > 0 else -largest, x.dtype)
    return ScaledArray(jnp.where(missed, lax.nextafter(rounded, towards), rounded), scale)


# --- sums ------------------------------------------------------------------------------------
@register_scaled_lax_op(scalar_preserving=exact_scalar(np.add))
def scaled_add(a: ScaledArray, b: ScaledArray, **params) -> ScaledArray:
    """Scale pow2(sqrt(sa^2 + sb^2)), both data rebalanced to it; an any-scale operand takes the other's scale."""
    return _scaled_sum(P.add_p, a, b, params)


@register_scaled_lax_op(scalar_preserving=exact_scalar(np.subtract))
def scaled_sub(a: ScaledArray, b: ScaledArray, **params) -> ScaledArray:
    """Scale pow2(sqrt(sa^2 + sb^2)), both data rebalanced to it; an any-scale operand takes the other's scale."""
    return _scaled_sum(P.sub_p, a, b, params)


@register_scaled_op(P.add_jaxvals_p)
def scaled_add_any(a: ScaledArray, b: ScaledArray, **params) -> ScaledArray:
    """Scale pow2(sqrt(sa^2 + sb^2)), both data rebalanced to it (the gradient accumulation of add).

    An any-scale operand (a symbolic zero made concrete) takes the other's scale.
    """
    return _scaled_sum(P.add_jaxvals_p, a, b, params)


# --- products --------------------------------------------------------------------------------
@register_scaled_lax_op(scalar_preserving=exact_scalar(np.multiply), site=Site.PRODUCT)
def scaled_mul(a: ScaledArray, b: ScaledArray, **params) -> ScaledArray:
    """Scale sa * sb, data da * db (a scale past the float32 range moves its excess into the data).

    A broadcast scalar constant was promoted to a mantissa in [1, 2) and a power-of-two
    scale, so its exponent folds into the output scale. Operands that share one scale
    (``x * x``, slices of one array) square their data's departure from unit size: the
    rescale policy's ``self_products`` rescales that product from its data. Of float16/FP8
    data such a product is computed in float32 and narrowed with its whole-tensor statistic,
    its largest entry bounded, since the narrow product itself may overflow: float16 data of
    a few hundred square to inf whatever their scale; and the running products of a parallel
    scan's decays (``exp(dt * A)``, mostly near 0 with a few near 1) put their largest
    entries ever further above their RMS, level after level, where a rescale from a sample
    misses them.
    """
    if narrow_range(a.dtype) and is_self_product(a, b):
        wide_a = ScaledArray(widen(a.data), a.scale)
        wide_b = wide_a if a is b else ScaledArray(widen(b.data), b.scale)
        product = scaled_product(_bind(P.mul_p, wide_a, wide_b, **params), a.scale, b.scale)
        return rescaled_into(product, a.dtype)
    return rescale_self_product(scaled_product(_bind(P.mul_p, a, b, **params), a.scale, b.scale), a, b)


@register_scaled_lax_op(scalar_preserving=exact_scalar(np.divide))
def scaled_div(a: ScaledArray, b: ScaledArray, **params) -> ScaledArray:
    """Scale sa / sb, data da / db (a scale past the float32 range moves its excess into the data)."""
    return scaled_product(_bind(P.div_p, a, b, **params), a.scale, b.scale, divide=True)


# --- value-based binary maps -----------------------------------------------------------------
@register_scaled_lax_op
def scaled_rem(a: ScaledArray, b: ScaledArray, **params) -> ScaledArray:
    """Scale sb (|rem(a, b)| < |b|), computed on the values (float32 for narrow data).

    An any-scale divisor (0 gives nan, ±inf gives a) leaves the output with a's scale.
    """
    scale = a.scale if is_any_scale(b) else b.scale
    return scaled_from_value(_bind(P.rem_p, value_of(a), value_of(b), **params), a.dtype, scale)


@register_scaled_lax_op
def scaled_atan2(a: ScaledArray, b: ScaledArray, **params) -> ScaledArray:
    """Scale 1, atan2 of the data aligned to the largest scale (atan2 is scale-invariant), in float32.

    Aligning instead of multiplying out the values keeps the angle right for operands
    whose values over- or underflow float32.
    """
    ya, xa = _aligned_wide_data([a, b])
    return scaled_from_value(_bind(P.atan2_p, ya, xa, **params), a.dtype, 1)


@register_scaled_lax_op
def scaled_nextafter(a: ScaledArray, b: ScaledArray, **params) -> ScaledArray:
    """Scale sa, data nextafter(da, db rescaled to sa): the next value representable as data * sa.

    Stepping on the data gives the neighbour in the data dtype, as the plain op does; on
    the float32 value it would round back to ``a`` for narrow dtypes.
    """
    scale = as_scale(a.scale)
    scale = zero_to_one(scale)  # a asserted zero: 0 / 0 would poison b
    a = at_scale(a, scale)
    return ScaledArray(_bind(P.nextafter_p, a, at_scale(b, scale), **params), scale)


# --- selections and comparisons --------------------------------------------------------------
@register_scaled_lax_op(scalar_preserving=exact_scalar(np.maximum))
def scaled_max(a: ScaledArray, b: ScaledArray, **params) -> ScaledArray:
    """Operands aligned to the largest scale (any-scale operands adopt it); max of the data.

    A float16/FP8 constant operand is rounded up where it moves (a floor stays a floor).
    """
    return _scaled_aligned(P.max_p, [a, b], params, bounds=(1, 1))


@register_scaled_lax_op(scalar_preserving=exact_scalar(np.minimum))
def scaled_min(a: ScaledArray, b: ScaledArray, **params) -> ScaledArray:
    """Operands aligned to the largest scale (any-scale operands adopt it); min of the data.

    A float16/FP8 constant operand is rounded down where it moves (a ceiling stays a ceiling).
    """
    return _scaled_aligned(P.min_p, [a, b], params, bounds=(-1, -1))


@register_scaled_lax_op
def scaled_clamp(lo: ScaledArray, x: ScaledArray, hi: ScaledArray, **params) -> ScaledArray:
    """Operands aligned to the largest scale (any-scale operands adopt it); clamp of the data.

    Float16/FP8 constant bounds are rounded inwards where they move (``lo`` up, ``hi`` down).
    """
    return _scaled_aligned(P.clamp_p, [lo, x, hi], params, bounds=(1, 0, -1))


@register_scaled_lax_op
def scaled_select_n(which: Array, *cases: ScaledArray, **params) -> ScaledArray:
    """Cases aligned to the largest scale (any-scale cases adopt it); the predicate stays plain.

    A constant case that fits its data dtype only at a scale above ``2**8`` raises the common scale
    to that (exact: ``-1e9`` in ``where(mask, x, -1e9)`` with float16 data, float32's max in
    ``jnp.nan_to_num``), which the selected values keep whether or not the constant is
    selected: ``2**64`` for ``nan_to_num`` of float32 data, a scale whose square overflows
    the scale dtype (NaN) and at which float16 casts of the data flush. Under any policy but
    the static one the scale is then lowered to the result's largest entry: where the
    constant is selected it stays (float32's max and 1 keep their ``2**64`` compromise),
    elsewhere it follows the selected values.
    """
    if isinstance(which, ScaledArray):  # a floating predicate is not valid LAX; keep the error there
        which = which.to_array(which.dtype)
    out = _scaled_aligned(P.select_n_p, [which, *cases], params)
    if constant_raises_scale(cases) and not active_policy().is_static:
        out = lowered_to_largest_entry(out)
    return out


def _compare(prim: Primitive, a: ScaledArray, b: ScaledArray, params: dict) -> Array:
    return prim.bind(*_aligned_wide_data([a, b]), **params)


def _comparison_rule(prim: Primitive, kind: str = "") -> Callable[..., Array]:
    """Register and return the rule ``scaled_<name>``: a plain bool from the aligned data."""

    def rule(a: ScaledArray, b: ScaledArray, **params) -> Array:
        return _compare(prim, a, b, params)

    rule.__name__ = rule.__qualname__ = f"scaled_{prim.name}"
    rule.__doc__ = f"Plain bool: {kind}{prim.name.removesuffix('_to')} of the data aligned to the largest scale (float32 for narrow data)."
    return register_scaled_op(prim, rule)


scaled_eq = _comparison_rule(P.eq_p)
scaled_ne = _comparison_rule(P.ne_p)
scaled_lt = _comparison_rule(P.lt_p)
scaled_le = _comparison_rule(P.le_p)
scaled_gt = _comparison_rule(P.gt_p)
scaled_ge = _comparison_rule(P.ge_p)
scaled_eq_to = _comparison_rule(P.eq_to_p, "total-order ")
scaled_lt_to = _comparison_rule(P.lt_to_p, "total-order ")
scaled_le_to = _comparison_rule(P.le_to_p, "total-order ")


# --- scale-keeping maps ----------------------------------------------------------------------
def _convert_scalar(scalar: np.ndarray, *, new_dtype: Any, **params) -> np.ndarray:
    """The converted constant; a float narrowed to a smaller float keeps its exact value.

    The scalar tracks the value a constant stands for where it meets scaled data, where
    promotion splits it into a power-of-two scale and a mantissa: ``1e-8`` cast to float16
    (0 there) or ``-1e9`` (-inf) keep their value. The bound equation still converts.
    """
    scalar = np.asarray(scalar)
    if (
        is_floating_dtype(scalar.dtype)
        and is_floating_dtype(new_dtype)
        and np.dtype(new_dtype).itemsize < scalar.dtype.itemsize
    ):
        return scalar
    with np.errstate(invalid="ignore", over="ignore"):  # nan/inf to int: as undefined as in XLA
        return scalar.astype(new_dtype)


def _reduce_precision_scalar(scalar: np.ndarray, *, exponent_bits: int, mantissa_bits: int) -> np.ndarray:
    with jax.ensure_compile_time_eval():
        out = jax.lax.reduce_precision(jnp.asarray(scalar), exponent_bits=exponent_bits, mantissa_bits=mantissa_bits)
    return np.asarray(out)


@register_scaled_lax_op(scalar_preserving=_convert_scalar, site=Site.CAST)
def scaled_convert_element_type(x: ScaledArray, *, new_dtype: Any, **params) -> Any:
    """Float to float: data cast, scale kept; to int or bool: plain array from the float32 value.

    Casting the data keeps values outside the new dtype's range (e.g. 2**30 to float16)
    right, which is the point of FP16/FP8 data with a float32 scale. The cast of a value the
    rescale policy has just rescaled counts as rescaled too. A cast of wider data into an
    8-bit float is rescaled from all its data first, under the policy's ``fp8_casts``.
    """
    if not isinstance(x, ScaledArray):  # int -> float reaches a rule only beside scaled inputs
        return P.convert_element_type_p.bind(x, new_dtype=new_dtype, **params)
    if is_floating_dtype(new_dtype):
        if rescales_cast(x, new_dtype):
            return rescaled_into(x, new_dtype)
        out = ScaledArray(_bind(P.convert_element_type_p, x, new_dtype=new_dtype, **params), as_scale(x.scale))
        return inherit_mark(out, x)  # the data's size is unchanged
    return P.convert_element_type_p.bind(to_float32_value(x), new_dtype=new_dtype, **params)


@register_scaled_lax_op(scalar_preserving=_reduce_precision_scalar)
def scaled_reduce_precision(x: ScaledArray, **params) -> ScaledArray:
    """Scale kept, precision reduced on the data (the simulated format applies to the data)."""
    return ScaledArray(_bind(P.reduce_precision_p, x, **params), as_scale(x.scale))


@register_scaled_lax_op
def scaled_stop_gradient(x: ScaledArray, **params) -> ScaledArray:
    """Scale kept; gradient stopped on both the data and the scale."""
    scale = as_scale(x.scale)
    if not is_numpy(scale):
        scale = jax.lax.stop_gradient(scale)
    return ScaledArray(_bind(P.stop_gradient_p, x, **params), scale)


@register_scaled_lax_op(scalar_preserving=True)
def scaled_copy(x: ScaledArray, **params) -> ScaledArray:
    """Scale kept, data copied."""
    return ScaledArray(_bind(P.copy_p, x, **params), as_scale(x.scale))


__all__ = [
    "scaled_add",
    "scaled_add_any",
    "scaled_atan2",
    "scaled_clamp",
    "scaled_convert_element_type",
    "scaled_copy",
    "scaled_div",
    "scaled_eq",
    "scaled_eq_to",
    "scaled_ge",
    "scaled_gt",
    "scaled_le",
    "scaled_le_to",
    "scaled_lt",
    "scaled_lt_to",
    "scaled_max",
    "scaled_min",
    "scaled_mul",
    "scaled_ne",
    "scaled_nextafter",
    "scaled_reduce_precision",
    "scaled_rem",
    "scaled_select_n",
    "scaled_stop_gradient",
    "scaled_sub",
]
