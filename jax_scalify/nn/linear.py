"""A linear layer with separate forward and backward formats (FP8 E4M3 forward, E5M2 gradients).

Its matmul is :func:`jax_scalify.nn.dot_general`'s, on ``x[..., K] @ w[K, N]``.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from ..core.array import is_floating_dtype
from .cast_dot import as_float_dtype, cast_matmul

Array = Any
DTypeLike = Any


def _forward_dims(x_ndim: int) -> Any:
    """``x[..., K] @ w[K, N]``."""
    return ((x_ndim - 1,), (0,)), ((), ())


def linear(
    x: Array,
    w: Array,
    b: Array | None = None,
    *,
    fwd_dtype: DTypeLike = None,
    bwd_dtype: DTypeLike = None,
    preferred_element_type: DTypeLike = None,
) -> Array:
    """``x @ w + b`` with different number formats for the forward and the backward pass.

    Args:
        x: input of shape ``(..., K)``.
        w: weight of shape ``(K, N)``.
        b: optional bias, broadcastable to ``(..., N)``.
        fwd_dtype: if given, ``x`` and ``w`` are cast to it for the forward matmul (e.g.
            ``jnp.float8_e4m3fn``); the cast operands are also what the backward uses.
        bwd_dtype: if given, the output cotangent is cast to it for the two backward
            matmuls (e.g. ``jnp.float8_e5m2``).
        preferred_element_type: accumulation dtype of the three matmuls (default float32;
            ``jnp.bfloat16`` also works).

    Returns:
        ``(..., N)`` in ``x``'s dtype: the matmul result is cast back to it, then ``b`` is
        added (and the sum cast to ``x``'s dtype).

    Gradients (a ``jax.custom_vjp``): with ``g`` the output cotangent cast to ``bwd_dtype``
    and ``xq``, ``wq`` the forward's cast operands, ``grad_x = g @ wq.T`` and
    ``grad_w = xq.T @ g`` (leading axes contracted), both accumulated in
    ``preferred_element_type`` and returned in the dtypes of ``x`` and ``w``. Plain autodiff
    through a cast would instead round ``grad_w`` to ``fwd_dtype`` (the transpose of
    ``dot_general`` returns the operand's dtype). Gradients are straight-through for the
    casts. ``b``'s gradient is the sum of the uncast cotangent.

    It is :func:`jax_scalify.nn.dot_general` on ``x[..., K] @ w[K, N]``, with the output in
    ``x``'s dtype and float32 accumulation by default.

    Scale rule: none of its own; under ``scalify`` the casts keep the scale and the matmuls
    use the ``dot_general`` rule (``s = sx * sw * r``, ``r = pow2(sqrt(K))``, the ``1/r``
    applied to the float32 accumulator since FP8 operands have no range to spare), so FP8
    operands are unit-scaled before the cast, the point of scale propagation. Without
    casts it is ``x @ w + b`` exactly.
    """
    fwd = as_float_dtype("jsa.nn.linear", "fwd_dtype", fwd_dtype)
    bwd = as_float_dtype("jsa.nn.linear", "bwd_dtype", bwd_dtype)
    acc = as_float_dtype("jsa.nn.linear", "preferred_element_type", preferred_element_type) or np.dtype(np.float32)
    x_dtype, w_dtype = np.dtype(jnp.result_type(x)), np.dtype(jnp.result_type(w))
    if not (is_floating_dtype(x_dtype) and is_floating_dtype(w_dtype)):
        raise TypeError(f"jsa.nn.linear expects floating x and w, got {x_dtype} and {w_dtype}.")
    if jnp.ndim(w) != 2 or jnp.ndim(x) < 1 or jnp.shape(x)[-1] != jnp.shape(w)[0]:
        raise ValueError(
            f"jsa.nn.linear expects x of shape (..., K) and w of shape (K, N), got {list(jnp.shape(x))} "
            f"and {list(jnp.shape(w))}."
        )
    x, w = jnp.asarray(x), jnp.asarray(w)
    y = cast_matmul(x, w, _forward_dims(x.ndim), None, fwd, bwd, acc, x_dtype, x_dtype, w_dtype, None)
    if b is not None:
        y = (y + b).astype(x_dtype)
    return y
