"""A linear layer with separate forward and backward formats (FP8 E4M3 forward, E5M2 gradients)."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core.array import is_floating_dtype

Array = Any
DTypeLike = Any
DType = np.dtype | None


def _as_dtype(name: str, dtype: DTypeLike) -> DType:
    if dtype is None:
        return None
    dtype = np.dtype(dtype)
    if not is_floating_dtype(dtype):
        raise TypeError(f"jsa.nn.linear: {name} must be a floating dtype (e.g. jnp.float8_e4m3fn), got {dtype}.")
    return dtype


def _cast(x: Array, dtype: DType) -> Array:
    return x if dtype is None else lax.convert_element_type(x, dtype)


def _forward_dims(x_ndim: int) -> Any:
    """``x[..., K] @ w[K, N]``."""
    return ((x_ndim - 1,), (0,)), ((), ())


def _grad_x_dims(g_ndim: int) -> Any:
    """``g[..., N] @ w[K, N]^T -> [..., K]``."""
    return ((g_ndim - 1,), (1,)), ((), ())


def _grad_w_dims(x_ndim: int) -> Any:
    """``x[..., K]^T @ g[..., N] -> [K, N]``: contract every leading (batch) axis."""
    lead = tuple(range(x_ndim - 1))
    return (lead, lead), ((), ())


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _matmul(x: Array, w: Array, fwd: DType, bwd: DType, acc: np.dtype, x_dtype: np.dtype, w_dtype: np.dtype) -> Array:
    """``x @ w`` with ``x`` and ``w`` cast to ``fwd``, accumulated in ``acc``, output in ``x_dtype``."""
    return _matmul_fwd(x, w, fwd, bwd, acc, x_dtype, w_dtype)[0]


def _matmul_fwd(x, w, fwd, bwd, acc, x_dtype, w_dtype):
    xq, wq = _cast(x, fwd), _cast(w, fwd)
    y = lax.dot_general(xq, wq, _forward_dims(xq.ndim), preferred_element_type=acc)
    # The residuals are the cast operands: the backward matmuls use them as they are.
    return y.astype(x_dtype), (xq, wq)


def _matmul_bwd(fwd, bwd, acc, x_dtype, w_dtype, residuals, g):
    xq, wq = residuals
    gq = _cast(g, bwd)
    grad_x = lax.dot_general(gq, wq, _grad_x_dims(gq.ndim), preferred_element_type=acc)
    grad_w = lax.dot_general(xq, gq, _grad_w_dims(xq.ndim), preferred_element_type=acc)
    return grad_x.astype(x_dtype), grad_w.astype(w_dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


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

    Scale rule: none of its own; under ``scalify`` the casts keep the scale and the matmuls
    use the ``dot_general`` rule (``s = sx * sw * r``, ``r = pow2(sqrt(K))``, the ``1/r``
    applied to the float32 accumulator since FP8 operands have no range to spare), so FP8
    operands are unit-scaled before the cast, the point of scale propagation. Without
    casts it is ``x @ w + b`` exactly.
    """
    fwd = _as_dtype("fwd_dtype", fwd_dtype)
    bwd = _as_dtype("bwd_dtype", bwd_dtype)
    acc = _as_dtype("preferred_element_type", preferred_element_type) or np.dtype(np.float32)
    x_dtype, w_dtype = np.dtype(jnp.result_type(x)), np.dtype(jnp.result_type(w))
    if not (is_floating_dtype(x_dtype) and is_floating_dtype(w_dtype)):
        raise TypeError(f"jsa.nn.linear expects floating x and w, got {x_dtype} and {w_dtype}.")
    if jnp.ndim(w) != 2 or jnp.ndim(x) < 1 or jnp.shape(x)[-1] != jnp.shape(w)[0]:
        raise ValueError(
            f"jsa.nn.linear expects x of shape (..., K) and w of shape (K, N), got {list(jnp.shape(x))} "
            f"and {list(jnp.shape(w))}."
        )
    y = _matmul(jnp.asarray(x), jnp.asarray(w), fwd, bwd, acc, x_dtype, w_dtype)
    if b is not None:
        y = (y + b).astype(x_dtype)
    return y
