"""Scale rules of the contractions: ``dot_general`` and ``conv_general_dilated``.

A contraction sums ``K`` products (``K`` the contracted size, the fan-in for a convolution).
With unit-variance independent operands each output has standard deviation ``sqrt(K)``, so
the rules output ``s = sa * sb * r`` and ``data = result / r`` with ``r = pow2(sqrt(K))``.

The ``1/r`` is an exact power-of-two multiply (:func:`_unscaled_contraction`):

- a float16 result of 16-bit (or wider) operands is accumulated in float32
  (``preferred_element_type``), multiplied by ``1/r`` and rounded once to float16: the
  unscaled sum cannot overflow it, the multiply rides on the rounding (XLA:CPU computes a
  float16 contraction in float32 and converts; on GPU it is the GEMM's epilogue), and the
  operands, often weights that the backward pass reads again, stay untouched (bfloat16, with
  float32's range, is placed as below: XLA:CPU cannot run some bfloat16 contractions with a
  float32 result);
- otherwise it goes where it costs least, on the smallest of the operands of 16 bits or more
  and the output (a float32 output is multiplied in a pass of its own on XLA:CPU, which does
  not fuse it into the contraction, where an operand's multiply joins its producer's
  kernel); never on an 8-bit (FP8) operand, so that XLA can use FP8 GEMMs (cuBLASLt on
  Hopper), and never on a narrow output that an operand could take instead.

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


def _unscaled_contraction(lhs: Array, rhs: Array, inv_r: Array, contract: Callable[..., Array]) -> Array:
    """``contract(lhs, rhs) / r`` with the ``1/r`` placed as the module docstring says.

    ``contract(a, b, wide)`` binds the primitive with the equation's params, and with
    ``preferred_element_type=float32`` when ``wide``.
    """
    if np.all(inv_r == 1):
        return contract(lhs, rhs, False)
    out = jax.eval_shape(lambda a, b: contract(a, b, False), lhs, rhs)
    if np.dtype(out.dtype) == np.float16 and _can_take_rescale(lhs) and _can_take_rescale(rhs):
        return mul_data(contract(lhs, rhs, True), inv_r).astype(out.dtype)
    candidates = [(_prod(x.shape), i) for i, x in enumerate((lhs, rhs)) if _can_take_rescale(x)]
    if not (candidates and narrow_range(out.dtype)):
        candidates.append((_prod(out.shape), -1))  # on a tie the output: no operand moves towards subnormals
    _, where = min(candidates)
    if where == 0:
        return contract(mul_data(lhs, inv_r), rhs, False)
    if where == 1:
        return contract(lhs, mul_data(rhs, inv_r), False)
    return mul_data(contract(lhs, rhs, False), inv_r)


def _unit_scaled_contraction(lhs: Any, rhs: Any, fan_in: int, contract: Callable[..., Array]) -> ScaledArray:
    """``contract`` on the data, ``s = sa * sb * r`` and ``data / r`` (see :func:`_unscaled_contraction`)."""
    r = sqrt_size_pow2(fan_in)
    (lhs_data, lhs_scale), (rhs_data, rhs_scale) = _data_and_scale(lhs), _data_and_scale(rhs)
    out = _unscaled_contraction(lhs_data, rhs_data, as_scale(1 / r), contract)
    product = scaled_product(out, lhs_scale, rhs_scale)
    return rescale_contraction(scaled_product(product.data, product.scale, r))


def _binder(prim, params: dict) -> Callable[..., Array]:
    """``contract(a, b, wide)``: ``prim`` bound with ``params``, accumulating in float32 if ``wide``."""

    def contract(a, b, wide):
        bound = {**params, "preferred_element_type": jnp.dtype(jnp.float32)} if wide else params
        return prim.bind(a, b, **bound)

    return contract


@register_scaled_lax_op
def scaled_dot_general(lhs: Any, rhs: Any, *, dimension_numbers, **params) -> ScaledArray:
    """s = sa * sb * r, data = dot(data) / r, r = pow2(sqrt(K)), K = product of the contracting dims.

    Unit scaling of a sum of K products. All params are kept (``preferred_element_type``: FP8
    operands with a BF16/F32 result stay FP8 GEMMs); 1/r goes on the float32 accumulator
    of a float16 result, else where it costs least (see the module docstring). Operands that share one scale (``x @ x.T``) are first
    rescaled under the rescale policy's ``self_products``: their product squares the data's
    departure from unit size. In the forward pass the result is rescaled from its data
    under the policy's ``contractions``.
    """
    lhs, rhs = rescale_self_product_operands(lhs, rhs)
    (lhs_contracting, _), _ = dimension_numbers
    fan_in = _prod(lhs.shape[d] for d in lhs_contracting)
    contract = _binder(P.dot_general_p, {"dimension_numbers": dimension_numbers, **params})
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
    contract = _binder(P.conv_general_dilated_p, {"dimension_numbers": dimension_numbers, **params})
    return _unit_scaled_contraction(lhs, rhs, _conv_fan_in(rhs.shape, dimension_numbers), contract)


__all__ = ["scaled_conv_general_dilated", "scaled_dot_general"]
