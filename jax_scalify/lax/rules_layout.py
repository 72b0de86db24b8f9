"""Scale rules of the layout primitives: reshape, transpose, broadcast, slice, concatenate, pad ...

These primitives move, copy or drop elements without arithmetic, so:

- single-operand layout ops are applied to the data and keep the scale;
- ops that merge several floating operands into one array (``concatenate``, ``stack``, ``pad``) align
  the operands to the largest scale, an any-scale operand (constant 0 or ±inf) adopting it.

Every rule binds the primitive itself on the data with the equation's params, so the output
shape and dtype are exactly those of the plain primitive. The rules assume scalar scales
(the main path); an operand with a non-scalar (broadcast) scale is first brought to a scalar
one, its largest entry, so that moving the data around never separates it from its scale.

The scale-preserving ops are also declared scalar-preserving, so that a broadcast scalar
constant seen through them (``jnp.full(shape, 2.0).T``) is still split into mantissa and
power-of-two scale when it meets a scaled value.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.extend.core import primitives as P

from ..core.array import ScaledArray
from ..core.registry import primitive_of, register_scaled_lax_op, register_scaled_op
from ..core.scaling import (
    as_scale,
    at_scale,
    bind_aligned,
    bind_keep_scale,
    is_any_scale,
    is_numpy,
    largest_scale,
    numpy_api,
    with_scalar_scale,
    zero_to_one,
)

Array = Any

# `split`, `stack` and `unstack` are primitives (`jnp.stack`'s transpose is `unstack`) that
# `jax.extend` does not export.
tile_p: Primitive = primitive_of(lambda x: jnp.tile(x, 2), np.zeros((2,), np.float32))
split_p: Primitive = primitive_of(lambda x: jnp.split(x, 2), np.zeros((2,), np.float32))
stack_p: Primitive = primitive_of(lambda x: jnp.stack([x, x]), np.zeros((2,), np.float32))
unstack_p: Primitive = primitive_of(lambda x: jnp.unstack(x), np.zeros((2,), np.float32))


def _scale_with_scalar_fill(operand: ScaledArray, fill: ScaledArray) -> Array:
    """Common scale of an array and a 0-d fill value: the largest, unless the fill is 0 or ±inf.

    The fill is one scalar, so whether its value is the same at every scale is checked on its
    data (at run time when traced): a zero or infinite fill adopts the operand's scale
    instead of pulling the operand's data down to its own (scale 1 for an unknown 0). A zero
    common scale (everything asserted zero) becomes 1. A non-zero finite constant fill counts
    as in a select (:func:`~jax_scalify.core.scaling.largest_scale`): at its fitting
    scale, within reach of the operand's.
    """
    if is_any_scale(fill) or is_any_scale(operand):
        return largest_scale([operand, fill])
    if is_numpy(fill.data) and is_numpy(fill.scale) and np.all(np.isfinite(fill.data) & (fill.data != 0)):
        return largest_scale([operand, fill])
    npapi = numpy_api(fill.data, operand.scale, fill.scale)
    free = ~npapi.isfinite(fill.data) | (fill.data == 0)
    s_operand, s_fill = as_scale(operand.scale), as_scale(fill.scale)
    scale = npapi.where(free, s_operand, npapi.maximum(s_operand, s_fill))
    return zero_to_one(as_scale(scale))  # all asserted zero: 0 / 0 would poison the data


@register_scaled_lax_op(scalar_preserving=True)
def scaled_broadcast_in_dim(operand: ScaledArray, *dyn_shape: Array, **params) -> ScaledArray:
    """Scale unchanged (broadcast applied to the data)."""
    return bind_keep_scale(P.broadcast_in_dim_p, operand, *dyn_shape, **params)


@register_scaled_lax_op(scalar_preserving=True)
def scaled_reshape(operand: ScaledArray, *dyn_shape: Array, **params) -> ScaledArray:
    """Scale unchanged (reshape applied to the data)."""
    return bind_keep_scale(P.reshape_p, operand, *dyn_shape, **params)


@register_scaled_lax_op(scalar_preserving=True)
def scaled_squeeze(operand: ScaledArray, **params) -> ScaledArray:
    """Scale unchanged (squeeze applied to the data)."""
    return bind_keep_scale(P.squeeze_p, operand, **params)


@register_scaled_lax_op(scalar_preserving=True)
def scaled_transpose(operand: ScaledArray, **params) -> ScaledArray:
    """Scale unchanged (transpose applied to the data)."""
    return bind_keep_scale(P.transpose_p, operand, **params)


@register_scaled_lax_op(scalar_preserving=True)
def scaled_slice(operand: ScaledArray, **params) -> ScaledArray:
    """Scale unchanged (slice applied to the data)."""
    return bind_keep_scale(P.slice_p, operand, **params)


@register_scaled_lax_op(scalar_preserving=True)
def scaled_rev(operand: ScaledArray, **params) -> ScaledArray:
    """Scale unchanged (reversal applied to the data)."""
    return bind_keep_scale(P.rev_p, operand, **params)


@register_scaled_op(tile_p)
def scaled_tile(operand: ScaledArray, **params) -> ScaledArray:
    """Scale unchanged (tiling applied to the data)."""
    return bind_keep_scale(tile_p, operand, **params)


@register_scaled_op(split_p)
def scaled_split(operand: ScaledArray, **params) -> list[ScaledArray]:
    """Every piece keeps the operand's scale (split applied to the data)."""
    operand = with_scalar_scale(operand)
    return [ScaledArray(piece, operand.scale) for piece in split_p.bind(operand.data, **params)]


@register_scaled_lax_op
def scaled_concatenate(*operands: ScaledArray, **params) -> ScaledArray:
    """Operands aligned to the largest scale (any-scale operands adopt it), then concatenated."""
    return bind_aligned(P.concatenate_p, operands, **params)


@register_scaled_op(stack_p)
def scaled_stack(*operands: ScaledArray, **params) -> ScaledArray:
    """Operands aligned to the largest scale (any-scale operands adopt it), then stacked."""
    return bind_aligned(stack_p, operands, **params)


@register_scaled_op(unstack_p)
def scaled_unstack(operand: ScaledArray, **params) -> list[ScaledArray]:
    """Every piece keeps the operand's scale (unstack applied to the data)."""
    operand = with_scalar_scale(operand)
    return [ScaledArray(piece, operand.scale) for piece in unstack_p.bind(operand.data, **params)]


@register_scaled_lax_op
def scaled_pad(operand: ScaledArray, padding_value: ScaledArray, **params) -> ScaledArray:
    """Operand and padding value aligned to the largest scale; a 0 or ±inf padding value adopts the operand's."""
    operand, padding_value = with_scalar_scale(operand), with_scalar_scale(padding_value)
    scale = _scale_with_scalar_fill(operand, padding_value)
    data = P.pad_p.bind(at_scale(operand, scale).data, at_scale(padding_value, scale).data, **params)
    return ScaledArray(data, scale)


__all__ = [
    "scaled_broadcast_in_dim",
    "scaled_concatenate",
    "scaled_pad",
    "scaled_reshape",
    "scaled_rev",
    "scaled_slice",
    "scaled_split",
    "scaled_squeeze",
    "scaled_stack",
    "scaled_tile",
    "scaled_transpose",
    "scaled_unstack",
    "split_p",
    "stack_p",
    "tile_p",
    "unstack_p",
]
