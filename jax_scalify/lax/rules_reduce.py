"""Scale rules of reductions, cumulative ops and windowed reductions.

Sums are unit-scaled: a sum of ``K`` independent unit-variance terms has standard deviation
``sqrt(K)``, so the rules move ``r = pow2(sqrt(K))`` from the data into the scale
(``s = sa * r``, ``data = sum(data) / r``). Where the ``1/r`` is applied depends on the range
of the data dtype:

- narrow range (float16, FP8: exponent range smaller than float32's): ``1/r`` is applied to
  the input data *before* summing, so the sum itself cannot overflow the data dtype;
- wide range (float32, float64, and bfloat16, which has float32's exponent range): ``1/r`` is
  applied to the output (never larger than the input), which is cheaper and never loses the
  low bits of small inputs to subnormals.

``K`` is the number of terms summed into one output: the reduced size, the axis length for
``cumsum`` (its last, largest partial sum), the window size for ``reduce_window_sum``, and for
``select_and_scatter_add`` (the gradient of max pooling) the most windows that overlap one
position, since each position receives one term per window that selected it.

Max, min and their cumulative and windowed forms commute with a positive scale, so the scale is
kept and the reduction runs on the data; ``argmax``/``argmin`` read the data. Products and
``cumlogsumexp`` are not homogeneous of degree one in the input: ``reduce_prod`` gets the exact
scale ``sa**K``; ``cumprod`` (a different power of ``sa`` at every position, which no scalar
scale can express) and ``cumlogsumexp`` are computed on the values, output scale 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Jaxpr, Primitive
from jax.extend.core import primitives as P

from ..core.array import ScaledArray, is_floating_dtype
from ..core.registry import register_scaled_lax_op
from ..core.scaling import (
    align_to_largest,
    as_scale,
    num_elements,
    scaled_power,
    single_binary_reducer,
    to_float32_value,
    unit_scaled_sum,
    value_order_data,
)

Array = Any

# --- shared helpers --------------------------------------------------------------------------


def _keep_scale(prim: Primitive, x: ScaledArray, **params) -> ScaledArray:
    """``prim`` on the data, scale unchanged (valid for ops that commute with a positive scale)."""
    return ScaledArray(prim.bind(x.data, **params), as_scale(x.scale))


def _on_float32_values(prim: Primitive, x: ScaledArray, **params) -> ScaledArray:
    """``prim`` on the value computed in float32 (float64 stays float64), output scale 1."""
    out = prim.bind(to_float32_value(x), **params).astype(x.dtype)
    return ScaledArray(out, as_scale(1.0))


def _window_size(window_dimensions: Sequence[int]) -> int:
    return int(np.prod(window_dimensions, dtype=np.int64))


# --- full reductions -------------------------------------------------------------------------


@register_scaled_lax_op
def scaled_reduce_sum(x: ScaledArray, *, axes: Sequence[int], **params) -> ScaledArray:
    """s = sa * r, data = sum(data) / r, r = pow2(sqrt(K)), K = number of elements summed.

    Unit scaling: a sum of K unit-variance terms has standard deviation sqrt(K). The 1/r is
    applied to the input for float16/FP8 (the sum cannot overflow), to the output otherwise.
    """
    return unit_scaled_sum(
        x.scale, num_elements(x.shape, axes), lambda d: P.reduce_sum_p.bind(d, axes=axes, **params), x.data
    )


@register_scaled_lax_op(scalar_preserving=True)
def scaled_reduce_max(x: ScaledArray, **params) -> ScaledArray:
    """Scale unchanged, max of the data (max commutes with a positive scale)."""
    return _keep_scale(P.reduce_max_p, x, **params)


@register_scaled_lax_op(scalar_preserving=True)
def scaled_reduce_min(x: ScaledArray, **params) -> ScaledArray:
    """Scale unchanged, min of the data (min commutes with a positive scale)."""
    return _keep_scale(P.reduce_min_p, x, **params)


@register_scaled_lax_op
def scaled_argmax(x: ScaledArray, **params) -> Array:
    """Plain integer output, computed on the data (a positive scale keeps the order; scale 0: all equal)."""
    return P.argmax_p.bind(value_order_data(x), **params)


@register_scaled_lax_op
def scaled_argmin(x: ScaledArray, **params) -> Array:
    """Plain integer output, computed on the data (a positive scale keeps the order; scale 0: all equal)."""
    return P.argmin_p.bind(value_order_data(x), **params)


@register_scaled_lax_op
def scaled_reduce_prod(x: ScaledArray, *, axes: Sequence[int], **params) -> ScaledArray:
    """s = sa ** K exactly (K = number of factors, static), data = prod(data) in float32.

    The product of K values with scale sa has scale sa**K: for a power-of-two sa this is an
    exact power of two (integer power, no rounding), and it stays representable whenever the
    value's own exponent does, unlike a product of values in the data dtype. The data product
    is accumulated in float32 (float64 stays float64) and cast back once.
    """
    work = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    data = P.reduce_prod_p.bind(x.data.astype(work), axes=axes, **params).astype(x.dtype)
    return scaled_power(data, x.scale, num_elements(x.shape, axes))


# --- cumulative ops --------------------------------------------------------------------------


@register_scaled_lax_op
def scaled_cumsum(x: ScaledArray, *, axis: int, **params) -> ScaledArray:
    """s = sa * r, data = cumsum(data) / r, r = pow2(sqrt(K)), K = length of the axis.

    The last (largest) partial sum has K terms: it is the one unit scaling is chosen for, and
    the early partial sums are smaller, never larger. 1/r placement as in reduce_sum.
    """
    return unit_scaled_sum(x.scale, x.shape[axis], lambda d: P.cumsum_p.bind(d, axis=axis, **params), x.data)


@register_scaled_lax_op(scalar_preserving=True)
def scaled_cummax(x: ScaledArray, **params) -> ScaledArray:
    """Scale unchanged, cumulative max of the data (max commutes with a positive scale)."""
    return _keep_scale(P.cummax_p, x, **params)


@register_scaled_lax_op(scalar_preserving=True)
def scaled_cummin(x: ScaledArray, **params) -> ScaledArray:
    """Scale unchanged, cumulative min of the data (min commutes with a positive scale)."""
    return _keep_scale(P.cummin_p, x, **params)


@register_scaled_lax_op
def scaled_cumprod(x: ScaledArray, **params) -> ScaledArray:
    """Computed on the value in float32, output scale 1.

    Position i of a cumulative product has scale sa**(i+1): no scalar scale is exact for all
    positions, so the product is taken on the values (as for other non-linear maps).
    """
    return _on_float32_values(P.cumprod_p, x, **params)


@register_scaled_lax_op
def scaled_cumlogsumexp(x: ScaledArray, **params) -> ScaledArray:
    """Computed on the value in float32, output scale 1.

    The output is a logarithm: it is of moderate size whatever the input scale, and a scale on
    the input cannot be moved through exp (a log-domain shift would need a data-dependent max).
    """
    return _on_float32_values(P.cumlogsumexp_p, x, **params)


# --- windowed reductions ---------------------------------------------------------------------


@register_scaled_lax_op
def scaled_reduce_window_sum(x: ScaledArray, *, window_dimensions: Sequence[int], **params) -> ScaledArray:
    """s = sa * r, data = window_sum(data) / r, r = pow2(sqrt(K)), K = window size.

    Unit scaling of a sum of K terms (padded positions count: they are zeros), 1/r placement as
    in reduce_sum. Sum/average pooling and the gradient of average pooling use it.
    """
    return unit_scaled_sum(
        x.scale,
        _window_size(window_dimensions),
        lambda d: P.reduce_window_sum_p.bind(d, window_dimensions=window_dimensions, **params),
        x.data,
    )


@register_scaled_lax_op
def scaled_reduce_window_max(x: ScaledArray, **params) -> ScaledArray:
    """Scale unchanged, windowed max of the data (padding is -inf, which every scale keeps)."""
    return _keep_scale(P.reduce_window_max_p, x, **params)


@register_scaled_lax_op
def scaled_reduce_window_min(x: ScaledArray, **params) -> ScaledArray:
    """Scale unchanged, windowed min of the data (padding is +inf, which every scale keeps)."""
    return _keep_scale(P.reduce_window_min_p, x, **params)


@register_scaled_lax_op
def scaled_reduce_window(
    *args: Any, jaxpr: Jaxpr, consts: Sequence[Any], window_dimensions: Sequence[int], **params
) -> list:
    """max/min reducer: scale of the largest of operand and init; add: as reduce_window_sum; else on values, scale 1.

    JAX emits the generic primitive when the init value is not the reducer's identity (e.g. a
    max pool with init 0). A single max or min commutes with a common positive scale, so the
    operand and the init value are aligned to the largest scale (a 0 or ±inf init takes the
    operand's). A single add is unit-scaled like reduce_window_sum (init value included in the
    aligned, rescaled terms). Any other reducer is evaluated on the values in the data dtype,
    floating outputs with scale 1.
    """
    bind_params = dict(jaxpr=jaxpr, consts=consts, window_dimensions=window_dimensions, **params)

    def bind(*datas):
        return P.reduce_window_p.bind(*datas, **bind_params)

    reducer = single_binary_reducer(jaxpr, consts)
    scaled = len(args) == 2 and all(isinstance(a, ScaledArray) for a in args)
    if scaled and reducer in (P.max_p, P.min_p):
        (operand, init), scale = align_to_largest(args)
        return [ScaledArray(bind(operand.data, init.data)[0], scale)]
    if scaled and reducer is P.add_p:
        (operand, init), scale = align_to_largest(args)

        def window_add(o, i):  # traced again for the dtype it is given (see unit_scaled_sum)
            return lax.reduce_window(o, i, lax.add, window_dimensions, **params)

        out = unit_scaled_sum(scale, _window_size(window_dimensions), window_add, operand.data, init.data)
        return [out]
    outs = bind(*[to_float32_value(a).astype(a.dtype) if isinstance(a, ScaledArray) else a for a in args])
    return [ScaledArray(o, as_scale(1.0)) if is_floating_dtype(o.dtype) else o for o in outs]


def _max_overlap(window_dimensions: Sequence[int], window_strides: Sequence[int]) -> int:
    """Most windows that contain one position: prod(ceil(window / stride))."""
    return int(np.prod([-(-w // s) for w, s in zip(window_dimensions, window_strides)], dtype=np.int64))


@register_scaled_lax_op
def scaled_select_and_scatter_add(
    source: ScaledArray,
    operand: ScaledArray,
    *,
    window_dimensions: Sequence[int],
    window_strides: Sequence[int],
    **params,
) -> ScaledArray:
    """s = s_source * r, r = pow2(sqrt(K)), K = most windows overlapping one position; selection on operand data.

    The gradient of max pooling: each position receives the sum of the cotangents of the
    windows that selected it, at most K = prod(ceil(window / stride)) terms (K = 1, scale
    unchanged, for non-overlapping pools). The selection compares operand data, which has the
    order of the values since the scale is a positive scalar. 1/r placement as in reduce_sum.
    """
    operand_data = operand.data

    def scatter(src):
        widened = operand_data.astype(src.dtype)  # the dtype of the sum (see unit_scaled_sum): the same order
        return P.select_and_scatter_add_p.bind(
            src, widened, window_dimensions=window_dimensions, window_strides=window_strides, **params
        )

    return unit_scaled_sum(source.scale, _max_overlap(window_dimensions, window_strides), scatter, source.data)


@register_scaled_lax_op
def scaled_select_and_gather_add(tangents: ScaledArray, operand: ScaledArray, **params) -> ScaledArray:
    """Scale of the tangents unchanged; selection on operand data.

    The forward derivative of max pooling picks, in each window, the tangent at the position
    of the operand's max: a gather, which keeps the scale. The operand's data has the order of
    its values since the scale is a positive scalar.
    """
    return ScaledArray(P.select_and_gather_add_p.bind(tangents.data, operand.data, **params), as_scale(tangents.scale))


__all__ = [
    "scaled_argmax",
    "scaled_argmin",
    "scaled_cumlogsumexp",
    "scaled_cummax",
    "scaled_cummin",
    "scaled_cumprod",
    "scaled_cumsum",
    "scaled_reduce_max",
    "scaled_reduce_min",
    "scaled_reduce_prod",
    "scaled_reduce_sum",
    "scaled_reduce_window",
    "scaled_reduce_window_max",
    "scaled_reduce_window_min",
    "scaled_reduce_window_sum",
    "scaled_select_and_gather_add",
    "scaled_select_and_scatter_add",
]
