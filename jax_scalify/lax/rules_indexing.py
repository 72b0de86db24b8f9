"""Scale rules of the indexing primitives: dynamic slices, gather, scatter, sort and top_k.

Indices are integer operands: they arrive plain and are passed through unchanged. The scale
logic:

- reading elements (``dynamic_slice``, ``gather``, ``sort``, the values of ``top_k`` and
  ``approx_top_k``) keeps the scale: the primitive is applied to the data;
- writing elements of one floating array into another (``dynamic_update_slice``,
  ``scatter``, ``scatter_min``/``scatter_max``, ``scatter_add``/``scatter_sub``) aligns both to the largest
  scale, an any-scale operand (constant 0 or ±inf) adopting it;
- ``scatter_mul`` keeps the operand's scale and applies the updates by value (see its rule).

Sorting by a scaled key compares its data: with a positive scalar scale the order of the data
is the order of the values.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.extend.core import primitives as P

from ..core.array import ScaledArray, narrow_range
from ..core.promotion import is_any_scale
from ..core.registry import primitive_of, register_scaled_lax_op, register_scaled_op
from ..core.scaling import (
    align_to_largest,
    as_scale,
    at_scale,
    bind_aligned,
    bind_keep_scale,
    mul_data,
    value_order_data,
    widen,
    with_scalar_scale,
    zero_to_one,
)
from ..core.sites import mark_sparse, rescaled_into, rescales_in_backward_pass

Array = Any

# `x.at[i].subtract(y)`'s primitive; not exported by `jax.extend`.
scatter_sub_p: Primitive = primitive_of(
    lambda x, i, u: lax.scatter_sub(x, i, u, lax.ScatterDimensionNumbers((), (0,), (0,))),
    np.zeros((2,), np.float32),
    np.zeros((1, 1), np.int32),
    np.zeros((1,), np.float32),
)


def _fill_needs_scaling(mode: Any, fill_value: Any) -> bool:
    """A gather fill value that is not the same at every scale (not None, 0, ±inf or nan)."""
    if fill_value is None or lax.GatherScatterMode.from_any(mode) != lax.GatherScatterMode.FILL_OR_DROP:
        return False
    value = float(fill_value)
    return value == value and value != 0 and abs(value) != float("inf")


def _bind_scatter_aligned(
    prim: Primitive, operand: ScaledArray, indices: Array, updates: ScaledArray, **params
) -> ScaledArray:
    """A scatter-like primitive bound on operand and updates aligned to their largest scale."""
    into_zeros = is_any_scale(operand)
    (operand, updates), scale = align_to_largest([with_scalar_scale(operand), with_scalar_scale(updates)])
    out = ScaledArray(prim.bind(operand.data, indices, updates.data, **params), scale)
    return mark_sparse(out) if into_zeros else out


# `dynamic_slice` clamps its indices, so it maps a broadcast scalar to the same scalar. `gather`
# is not declared: in FILL_OR_DROP mode its output also holds the fill value.
@register_scaled_lax_op(scalar_preserving=True)
def scaled_dynamic_slice(operand: ScaledArray, *start_indices: Array, **params) -> ScaledArray:
    """Scale unchanged (dynamic slice applied to the data)."""
    return bind_keep_scale(P.dynamic_slice_p, operand, *start_indices, **params)


@register_scaled_lax_op
def scaled_dynamic_update_slice(operand: ScaledArray, update: ScaledArray, *start_indices: Array) -> ScaledArray:
    """Operand and update aligned to the largest scale (any-scale operands adopt it), then updated."""
    return bind_aligned(P.dynamic_update_slice_p, [operand, update], *start_indices)


@register_scaled_lax_op
def scaled_gather(operand: ScaledArray, indices: Array, *, mode: Any, fill_value: Any = None, **params) -> ScaledArray:
    """Scale unchanged (gather applied to the data; a fill value other than 0/±inf/nan is divided by the scale)."""
    if not _fill_needs_scaling(mode, fill_value):
        return bind_keep_scale(P.gather_p, operand, indices, mode=mode, fill_value=fill_value, **params)
    # Out-of-bounds slots hold `fill_value` as a value: find them by gathering ones filled with 0.
    operand = with_scalar_scale(operand)
    scale = as_scale(operand.scale)
    scale = zero_to_one(scale)  # an asserted zero cannot hold the fill
    data = P.gather_p.bind(at_scale(operand, scale).data, indices, mode=mode, fill_value=0, **params)
    inside = P.gather_p.bind(jnp.ones_like(operand.data), indices, mode=mode, fill_value=0, **params)
    fill = mul_data(jnp.asarray(fill_value, operand.dtype), 1 / scale)
    return ScaledArray(jnp.where(inside != 0, data, fill), scale)


@register_scaled_lax_op
def scaled_scatter(operand: ScaledArray, indices: Array, updates: ScaledArray, **params) -> ScaledArray:
    """Operand and updates aligned to the largest scale (any-scale operands adopt it), then scattered."""
    return _bind_scatter_aligned(P.scatter_p, operand, indices, updates, **params)


@register_scaled_lax_op
def scaled_scatter_add(operand: ScaledArray, indices: Array, updates: ScaledArray, **params) -> ScaledArray:
    """Operand and updates aligned to the largest scale (any-scale operands adopt it); no sqrt(K) factor.

    The number K of updates summed into one element is data-dependent (it is 1 for the
    gradient of a gather with distinct indices, the common case, and can reach the number of
    updates), so no unit-scaling factor is applied: the result is the sum at the common scale,
    as for an add with a zero operand. In the backward pass float16/FP8 data are summed in
    float32 and rescaled from the result (see ``_scatter_sum``).
    """
    return _scatter_sum(P.scatter_add_p, operand, indices, updates, params)


@register_scaled_op(scatter_sub_p)
def scaled_scatter_sub(operand: ScaledArray, indices: Array, updates: ScaledArray, **params) -> ScaledArray:
    """As ``scatter_add``: operand and updates aligned to the largest scale, no sqrt(K) factor."""
    return _scatter_sum(scatter_sub_p, operand, indices, updates, params)


def _scatter_sum(
    prim: Primitive, operand: ScaledArray, indices: Array, updates: ScaledArray, params: dict
) -> ScaledArray:
    """A scatter-add or -sub; in the backward pass (``gradients`` policy), of float16/FP8 data accumulated in float32.

    The gradient of a lookup (``table[ids]``, ``jnp.take``, ``nnx.Embed``) is a scatter-add of
    every lookup's contribution into its row. Summed in float16, a row's running sum stops
    taking contributions once it is about 2**11 times one of them (plain float16 JAX too),
    so a row with thousands of lookups loses much of its gradient. As the backward pass's other
    sums of narrow data, it is accumulated in float32, its statistic (whole tensor, largest
    entry bounded) moved into the scale, and narrowed.
    """
    if not (narrow_range(updates.dtype) and rescales_in_backward_pass()):
        return _bind_scatter_aligned(prim, operand, indices, updates, **params)
    dtype = operand.dtype
    (operand, updates), scale = align_to_largest([with_scalar_scale(operand), with_scalar_scale(updates)])
    scatter = lax.scatter_add if prim is P.scatter_add_p else lax.scatter_sub  # builds its float32 update jaxpr
    kept = {k: params[k] for k in ("dimension_numbers", "indices_are_sorted", "unique_indices", "mode")}
    wide = scatter(widen(operand.data), indices, widen(updates.data), **kept)
    return rescaled_into(ScaledArray(wide, scale), dtype)


@register_scaled_lax_op
def scaled_scatter_mul(operand: ScaledArray, indices: Array, updates: ScaledArray, **params) -> ScaledArray:
    """Operand's scale kept; updates applied by value (scale 1), exact for any number of updates per element.

    ``s_operand * s_updates`` would only be right for elements hit exactly once: untouched
    elements keep the operand's scale and an element hit k times gets ``s_updates**k``.
    Multiplicative updates (masks, factors) are usually near 1, so their values fit the data.
    """
    operand = with_scalar_scale(operand)
    factors = at_scale(with_scalar_scale(updates), 1)
    return ScaledArray(P.scatter_mul_p.bind(operand.data, indices, factors.data, **params), operand.scale)


@register_scaled_lax_op
def scaled_scatter_min(operand: ScaledArray, indices: Array, updates: ScaledArray, **params) -> ScaledArray:
    """Operand and updates aligned to the largest scale (any-scale operands adopt it), then min-scattered."""
    return _bind_scatter_aligned(P.scatter_min_p, operand, indices, updates, **params)


@register_scaled_lax_op
def scaled_scatter_max(operand: ScaledArray, indices: Array, updates: ScaledArray, **params) -> ScaledArray:
    """Operand and updates aligned to the largest scale (any-scale operands adopt it), then max-scattered."""
    return _bind_scatter_aligned(P.scatter_max_p, operand, indices, updates, **params)


@register_scaled_lax_op
def scaled_sort(*operands: Any, **params) -> list[Any]:
    """Scales unchanged (sorted on the data: with a positive scalar scale its order is the values').

    Keys of scale 0 (asserted zero) are all equal, as their values are.
    """
    operands = [with_scalar_scale(x) if isinstance(x, ScaledArray) else x for x in operands]
    keys = params["num_keys"]
    datas = [
        (value_order_data(x) if i < keys else x.data) if isinstance(x, ScaledArray) else x
        for i, x in enumerate(operands)
    ]
    outs = P.sort_p.bind(*datas, **params)
    return [ScaledArray(out, x.scale) if isinstance(x, ScaledArray) else out for out, x in zip(outs, operands)]


def _bind_values_indices(prim: Primitive, operand: ScaledArray, *others: Array, **params) -> list[Any]:
    """A (values, indices) selection bound on the data: values keep the scale, indices plain."""
    operand = with_scalar_scale(operand)
    values, indices = prim.bind(value_order_data(operand), *others, **params)
    return [ScaledArray(values, operand.scale), indices]


@register_scaled_lax_op
def scaled_top_k(operand: ScaledArray, *others: Array, **params) -> list[Any]:
    """Values keep the scale (top_k applied to the data); indices plain."""
    return _bind_values_indices(P.top_k_p, operand, *others, **params)


@register_scaled_lax_op
def scaled_approx_top_k(operand: ScaledArray, **params) -> list[Any]:
    """Values keep the scale (approx_top_k applied to the data); indices plain."""
    return _bind_values_indices(P.approx_top_k_p, operand, **params)


__all__ = [
    "scaled_approx_top_k",
    "scaled_dynamic_slice",
    "scaled_dynamic_update_slice",
    "scaled_gather",
    "scaled_scatter",
    "scaled_scatter_add",
    "scaled_scatter_max",
    "scaled_scatter_min",
    "scaled_scatter_mul",
    "scaled_scatter_sub",
    "scaled_sort",
    "scaled_top_k",
    "scatter_sub_p",
]
