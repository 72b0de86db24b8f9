"""Scale rules of the contractions: ``dot_general`` and ``conv_general_dilated``.

A contraction sums ``K`` products (``K`` the contracted size, the fan-in for a convolution).
With unit-variance independent operands each output has standard deviation ``sqrt(K)``, so
the rules output ``s = sa * sb * r`` and ``data = result / r`` with ``r = pow2(sqrt(K))``.

The ``1/r`` is an exact power-of-two multiply, applied where it costs least
(:func:`_unscale_target`):

- on an operand only if its dtype has range to spare (16 bits or wider): FP8 operands reach
  the contraction as they are, so XLA can use FP8 GEMMs (cuBLASLt on Hopper);
- on the output otherwise, or when it is the smallest of the three;
- never on the output when its dtype has a narrow range (float16, FP8) and an operand can
  take it, so that the unscaled sum cannot overflow the output dtype.

Under the rescale policy's ``contractions`` (the default), the result of a forward
contraction is then rescaled from its data: the ``sqrt(K)`` estimate is right for
independent operands, and trained weights and positive activations are not
(:func:`jax_scalify.core.sites.rescale_contraction`).

Every param of the equation (``preferred_element_type``, precision, dimension numbers,
groups, dilations, padding, sharding) is kept: the primitive is bound on the data with the
equation's own params, so the output dtype is the plain primitive's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import primitives as P

from ..core.array import ScaledArray, is_floating_dtype
from ..core.registry import register_scaled_lax_op
from ..core.scaling import (
    as_scale,
    mul_data,
    narrow_range,
    scaled_product,
    sqrt_size_pow2,
)
from ..core.sites import rescale_contraction, rescale_self_product_operands

Array = Any

_LHS, _RHS, _OUT = 0, 1, 2


def _prod(sizes: Sequence[int]) -> int:
    return int(np.prod(list(sizes), dtype=np.int64))


def _data_and_scale(x: Any) -> tuple[Array, Array]:
    """``(data, scale)``; a plain (integer) operand, e.g. int8 weights, has scale 1."""
    if isinstance(x, ScaledArray):
        return x.data, as_scale(x.scale)
    return x, as_scale(1.0)


def _can_take_rescale(data: Array) -> bool:
    """A floating operand of 16 bits or more has range to spare for an exact ``1/r``."""
    return is_floating_dtype(data.dtype) and jnp.finfo(data.dtype).bits >= 16


def _unscale_target(lhs: Array, rhs: Array, out: jax.ShapeDtypeStruct) -> int:
    """Where to apply ``1/r`` (``_LHS``, ``_RHS`` or ``_OUT``) given the operands' data.

    The cheapest (fewest elements) among the eligible places (see the module docstring); on
    a tie the output, which never pushes operand values into subnormals.
    """
    candidates = [(_prod(x.shape), where) for where, x in ((_LHS, lhs), (_RHS, rhs)) if _can_take_rescale(x)]
    if not (candidates and narrow_range(out.dtype)):
        candidates.append((_prod(out.shape), -1))
    _, where = min(candidates)
    return _OUT if where == -1 else where


def _unit_scaled_contraction(lhs: Any, rhs: Any, fan_in: int, contract: Callable[[Array, Array], Array]) -> ScaledArray:
    """``contract`` on the data, ``s = sa * sb * r`` and ``data / r`` applied where cheapest."""
    r = sqrt_size_pow2(fan_in)
    inv_r = as_scale(1 / r)
    (lhs_data, lhs_scale), (rhs_data, rhs_scale) = _data_and_scale(lhs), _data_and_scale(rhs)
    out_struct = jax.eval_shape(contract, *(jax.ShapeDtypeStruct(d.shape, d.dtype) for d in (lhs_data, rhs_data)))
    target = _unscale_target(lhs_data, rhs_data, out_struct)
    if target == _LHS:
        lhs_data = mul_data(lhs_data, inv_r)
    elif target == _RHS:
        rhs_data = mul_data(rhs_data, inv_r)
    out = contract(lhs_data, rhs_data)
    if target == _OUT:
        out = mul_data(out, inv_r)
    product = scaled_product(out, lhs_scale, rhs_scale)
    return rescale_contraction(scaled_product(product.data, product.scale, r))


@register_scaled_lax_op
def scaled_dot_general(lhs: Any, rhs: Any, *, dimension_numbers, **params) -> ScaledArray:
    """s = sa * sb * r, data = dot(data) / r, r = pow2(sqrt(K)), K = product of the contracting dims.

    Unit scaling of a sum of K products. All params are kept (``preferred_element_type``: FP8
    operands with a BF16/F32 result stay FP8 GEMMs); 1/r goes on the smaller 16-bit-or-wider
    operand or on the output, whichever is cheapest (see the module docstring). Operands that
    share one scale (``x @ x.T``) are first rescaled under the rescale policy's
    ``self_products``: their product squares the data's departure from unit size. In the
    forward pass the result is rescaled from its data under the policy's ``contractions``.
    """
    lhs, rhs = rescale_self_product_operands(lhs, rhs)
    (lhs_contracting, _), _ = dimension_numbers
    fan_in = _prod(lhs.shape[d] for d in lhs_contracting)

    def contract(a, b):
        return P.dot_general_p.bind(a, b, dimension_numbers=dimension_numbers, **params)

    return _unit_scaled_contraction(lhs, rhs, fan_in, contract)


def _conv_fan_in(rhs_shape: Sequence[int], dimension_numbers) -> int:
    """Kernel input features (per group) times the kernel's spatial size."""
    rhs_spec = tuple(range(len(rhs_shape))) if dimension_numbers is None else dimension_numbers.rhs_spec
    return _prod(rhs_shape[d] for d in rhs_spec[1:])


@register_scaled_lax_op
def scaled_conv_general_dilated(lhs: Any, rhs: Any, *, dimension_numbers, **params) -> ScaledArray:
    """s = sa * sb * r, data = conv(data) / r, r = pow2(sqrt(K)), K = fan-in (kernel in-features x spatial size).

    Unit scaling of a sum of K products: the kernel's input-feature dim already counts the
    features of one group (feature_group_count), and with batch_group_count it counts the
    summed batch (weight gradients). Dilations, padding, groups and preferred_element_type are
    kept; 1/r is placed as for dot_general, and the forward result is rescaled under the
    policy's ``contractions`` as well.
    """

    def contract(a, b):
        return P.conv_general_dilated_p.bind(a, b, dimension_numbers=dimension_numbers, **params)

    return _unit_scaled_contraction(lhs, rhs, _conv_fan_in(rhs.shape, dimension_numbers), contract)


__all__ = ["scaled_conv_general_dilated", "scaled_dot_general"]
