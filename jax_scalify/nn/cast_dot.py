"""``dot_general`` with separate forward and backward formats (FP8 E4M3 operands, E5M2 gradients).

:func:`dot_general` is ``lax.dot_general`` with its operands cast to ``fwd_dtype`` and the
output cotangent cast to ``bwd_dtype``; :func:`cast_dot_general` binds the two formats and
returns a callable with ``lax.dot_general``'s signature, which Flax layers take as their
``dot_general=`` argument. :func:`jax_scalify.nn.linear` is built on the same matmul.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core.array import is_floating_dtype

Array = Any
DTypeLike = Any
DType = np.dtype | None
DimensionNumbers = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]


def as_float_dtype(caller: str, name: str, dtype: DTypeLike) -> DType:
    """``dtype`` as a NumPy floating dtype (``None`` stays ``None``); a clear error otherwise."""
    if dtype is None:
        return None
    try:
        dtype = np.dtype(dtype)
    except TypeError as error:
        message = f"{caller}: {name} must be a floating dtype (e.g. jnp.float8_e4m3fn), got {dtype!r}."
        raise TypeError(message) from error
    if not is_floating_dtype(dtype):
        raise TypeError(f"{caller}: {name} must be a floating dtype (e.g. jnp.float8_e4m3fn), got {dtype}.")
    return dtype


def _cast(x: Array, dtype: DType) -> Array:
    return x if dtype is None else lax.convert_element_type(x, dtype)


def _free_dims(ndim: int, contracting: Sequence[int], batch: Sequence[int]) -> tuple[int, ...]:
    """The axes of an operand that are neither contracted nor batch, in order: they reach the output."""
    return tuple(d for d in range(ndim) if d not in contracting and d not in batch)


def _rank_in_sorted(dims: Sequence[int]) -> list[int]:
    """For each of ``dims``, its position once ``dims`` are sorted (dot_general keeps leftover axes in order)."""
    order = sorted(dims)
    return [order.index(d) for d in dims]


def _inverse_permutation(where: Sequence[int]) -> tuple[int, ...] | None:
    """``perm`` with ``transpose(result, perm)`` in operand layout, given each operand axis's ``result`` axis.

    ``None`` when the result is already in the operand's layout.
    """
    perm = tuple(where)
    return None if perm == tuple(range(len(perm))) else perm


def _grad_lhs(g: Array, rhs: Array, lhs_ndim: int, dims: DimensionNumbers, precision, acc: np.dtype) -> Array:
    """Cotangent of ``lhs``: ``g`` (layout ``[batch, lhs free, rhs free]``) contracted with ``rhs``'s free axes.

    The result's layout is ``[batch, lhs free, rhs contracting (in rhs order)]``, transposed to ``lhs``'s.
    """
    (lhs_c, rhs_c), (lhs_b, rhs_b) = dims
    nb, lhs_free, rhs_free = len(lhs_b), _free_dims(lhs_ndim, lhs_c, lhs_b), _free_dims(rhs.ndim, rhs_c, rhs_b)
    g_rhs_free = tuple(range(nb + len(lhs_free), g.ndim))
    out = lax.dot_general(
        g, rhs, ((g_rhs_free, rhs_free), (tuple(range(nb)), rhs_b)), precision, preferred_element_type=acc
    )
    where = [0] * lhs_ndim
    for i, d in enumerate(lhs_b):
        where[d] = i
    for j, d in enumerate(lhs_free):
        where[d] = nb + j
    for d, rank in zip(lhs_c, _rank_in_sorted(rhs_c)):
        where[d] = nb + len(lhs_free) + rank
    perm = _inverse_permutation(where)
    return out if perm is None else lax.transpose(out, perm)


def _grad_rhs(lhs: Array, g: Array, rhs_ndim: int, dims: DimensionNumbers, precision, acc: np.dtype) -> Array:
    """Cotangent of ``rhs``: ``lhs``'s free axes contracted with ``g``'s, ``lhs`` first.

    The result's layout is ``[batch, lhs contracting (in lhs order), rhs free]``, transposed to
    ``rhs``'s. With ``lhs`` as the first operand, ``x[..., K] @ w[K, N]`` gives ``x^T @ g``
    in ``w``'s layout with no transpose.
    """
    (lhs_c, rhs_c), (lhs_b, rhs_b) = dims
    nb, lhs_free, rhs_free = len(lhs_b), _free_dims(lhs.ndim, lhs_c, lhs_b), _free_dims(rhs_ndim, rhs_c, rhs_b)
    g_lhs_free = tuple(range(nb, nb + len(lhs_free)))
    out = lax.dot_general(
        lhs, g, ((lhs_free, g_lhs_free), (lhs_b, tuple(range(nb)))), precision, preferred_element_type=acc
    )
    where = [0] * rhs_ndim
    for i, d in enumerate(rhs_b):
        where[d] = i
    for d, rank in zip(rhs_c, _rank_in_sorted(lhs_c)):
        where[d] = nb + rank
    for j, d in enumerate(rhs_free):
        where[d] = nb + len(lhs_c) + j
    perm = _inverse_permutation(where)
    return out if perm is None else lax.transpose(out, perm)


@functools.partial(jax.custom_vjp, nondiff_argnums=tuple(range(2, 11)))
def cast_matmul(lhs, rhs, dims, precision, fwd, bwd, acc, out_dtype, lhs_dtype, rhs_dtype, out_sharding):
    """``dot_general`` of the operands cast to ``fwd``, accumulated in ``acc``, returned in ``out_dtype``.

    The backward casts the output cotangent to ``bwd`` and runs both gradient matmuls on it and
    on the forward's cast operands (straight-through for the casts), accumulated in ``acc``
    and returned in ``lhs_dtype`` and ``rhs_dtype``.
    """
    return _cast_matmul_fwd(lhs, rhs, dims, precision, fwd, bwd, acc, out_dtype, lhs_dtype, rhs_dtype, out_sharding)[0]


def _cast_matmul_fwd(lhs, rhs, dims, precision, fwd, bwd, acc, out_dtype, lhs_dtype, rhs_dtype, out_sharding):
    lq, rq = _cast(lhs, fwd), _cast(rhs, fwd)
    sharding = {} if out_sharding is None else {"out_sharding": out_sharding}
    out = lax.dot_general(lq, rq, dims, precision, preferred_element_type=acc, **sharding)
    # The residuals are the cast operands: the backward matmuls use them as they are.
    return out.astype(out_dtype), (lq, rq)


def _cast_matmul_bwd(dims, precision, fwd, bwd, acc, out_dtype, lhs_dtype, rhs_dtype, out_sharding, residuals, g):
    lq, rq = residuals
    gq = _cast(g, bwd)
    grad_lhs = _grad_lhs(gq, rq, lq.ndim, dims, precision, acc)
    grad_rhs = _grad_rhs(lq, gq, rq.ndim, dims, precision, acc)
    return grad_lhs.astype(lhs_dtype), grad_rhs.astype(rhs_dtype)


cast_matmul.defvjp(_cast_matmul_fwd, _cast_matmul_bwd)


def _as_dimension_numbers(dimension_numbers: Any, lhs_ndim: int, rhs_ndim: int) -> DimensionNumbers:
    """Hashable tuples of non-negative ints (Flax may pass lists or negative axes)."""
    try:
        (lhs_c, rhs_c), (lhs_b, rhs_b) = dimension_numbers
        return (
            (tuple(int(d) % lhs_ndim for d in lhs_c), tuple(int(d) % rhs_ndim for d in rhs_c)),
            (tuple(int(d) % lhs_ndim for d in lhs_b), tuple(int(d) % rhs_ndim for d in rhs_b)),
        )
    except (TypeError, ValueError, ZeroDivisionError) as error:
        raise ValueError(
            "jsa.nn.dot_general: dimension_numbers must be ((lhs_contracting, rhs_contracting), "
            f"(lhs_batch, rhs_batch)) as for lax.dot_general, got {dimension_numbers!r}."
        ) from error


def _hashable_precision(precision: Any) -> Any:
    return tuple(precision) if isinstance(precision, list) else precision


def dot_general(
    lhs: Array,
    rhs: Array,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: DTypeLike = None,
    *,
    fwd_dtype: DTypeLike = None,
    bwd_dtype: DTypeLike = None,
    out_sharding: Any = None,
) -> Array:
    """``lax.dot_general`` with different number formats for the forward and the backward pass.

    Args:
        lhs, rhs, dimension_numbers, precision: as for ``lax.dot_general`` (any contracting and
            batch axes).
        preferred_element_type: the output dtype, as for ``lax.dot_general`` (default: the
            promoted dtype of ``lhs`` and ``rhs``). The three matmuls accumulate in it, or in
            float32 when it is not given (a float16 result of FP8 operands is then rounded once).
        fwd_dtype: if given, ``lhs`` and ``rhs`` are cast to it for the forward matmul (e.g.
            ``jnp.float8_e4m3fn``); the cast operands are also what the backward uses.
        bwd_dtype: if given, the output cotangent is cast to it for the two backward matmuls
            (e.g. ``jnp.float8_e5m2``).
        out_sharding: as for ``lax.dot_general`` (forward matmul only).

    Returns:
        What ``lax.dot_general`` returns for the cast operands, in its output dtype for the
        uncast ones.

    Gradients (a ``jax.custom_vjp``): with ``g`` the output cotangent cast to ``bwd_dtype`` and
    ``lq``, ``rq`` the forward's cast operands, the operand gradients are the two matmuls of
    ``g`` with ``rq`` and with ``lq`` that transpose the forward one (batch axes kept, free
    axes contracted), accumulated as above and returned in the dtypes of ``lhs`` and ``rhs``.
    Plain autodiff through a cast would round them to ``fwd_dtype`` instead, the dtype of the
    transposed matmul's operand. Gradients are straight-through for the casts.

    Scale rule: none of its own; under ``scalify`` the casts keep the scale and the matmuls use
    the ``dot_general`` rule (``s = sl * sr * r``, ``r = pow2(sqrt(K))``, the ``1/r`` applied to
    the wider accumulator since FP8 operands have no range to spare), so the FP8 casts act on
    unit-scaled data, the point of scale propagation. Outside ``scalify`` it is the plain cast
    matmul; without casts it is ``lax.dot_general`` exactly.
    """
    fwd = as_float_dtype("jsa.nn.dot_general", "fwd_dtype", fwd_dtype)
    bwd = as_float_dtype("jsa.nn.dot_general", "bwd_dtype", bwd_dtype)
    out_dtype = as_float_dtype("jsa.nn.dot_general", "preferred_element_type", preferred_element_type)
    lhs_dtype, rhs_dtype = np.dtype(jnp.result_type(lhs)), np.dtype(jnp.result_type(rhs))
    if not (is_floating_dtype(lhs_dtype) and is_floating_dtype(rhs_dtype)):
        raise TypeError(f"jsa.nn.dot_general expects floating lhs and rhs, got {lhs_dtype} and {rhs_dtype}.")
    if out_dtype is None:
        out_dtype = np.dtype(jnp.result_type(lhs, rhs))
        acc = np.dtype(jnp.promote_types(out_dtype, np.float32))
    else:
        acc = out_dtype
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    dims = _as_dimension_numbers(dimension_numbers, lhs.ndim, rhs.ndim)
    return cast_matmul(
        lhs, rhs, dims, _hashable_precision(precision), fwd, bwd, acc, out_dtype, lhs_dtype, rhs_dtype, out_sharding
    )


@dataclasses.dataclass(frozen=True)
class CastDotGeneral:
    """A ``lax.dot_general``-compatible callable running :func:`dot_general` with fixed formats.

    Frozen and hashable, so it can be a static argument (``jnp.einsum``'s ``_dot_general``,
    a Flax Linen module attribute).
    """

    fwd_dtype: DType
    bwd_dtype: DType

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *, out_sharding=None):
        return dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type,
            fwd_dtype=self.fwd_dtype,
            bwd_dtype=self.bwd_dtype,
            out_sharding=out_sharding,
        )


def cast_dot_general(
    fwd_dtype: DTypeLike = jnp.float8_e4m3fn, bwd_dtype: DTypeLike = jnp.float8_e5m2
) -> CastDotGeneral:
    """A ``dot_general`` for Flax layers' ``dot_general=`` argument: FP8 E4M3 forward, E5M2 backward by default.

    ``nn.Dense(n, dot_general=jsa.nn.cast_dot_general())``, ``nnx.Linear(..., dot_general=...)``,
    ``nn.DenseGeneral``, ``nnx.LinearGeneral``; for ``nnx.Einsum``:
    ``einsum_op=functools.partial(jnp.einsum, _dot_general=jsa.nn.cast_dot_general())``.
    The returned callable takes ``lax.dot_general``'s arguments and runs :func:`dot_general`
    with these formats (``None``: no cast); see it for the gradients and the scale rule.
    """
    return CastDotGeneral(
        as_float_dtype("jsa.nn.cast_dot_general", "fwd_dtype", fwd_dtype),
        as_float_dtype("jsa.nn.cast_dot_general", "bwd_dtype", bwd_dtype),
    )
