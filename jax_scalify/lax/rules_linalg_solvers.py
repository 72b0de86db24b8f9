"""Scale rules of the matrix factorisations and solvers (``jnp.linalg``, ``jax.scipy.linalg``).

Each factorisation is homogeneous in its input: for a power-of-two ``s`` the floating-point
algorithm on ``d * s`` does the same operations as on ``d``, every intermediate multiplied
by a power of ``s`` (pivot and rotation choices compare ratios, which ``s`` leaves
unchanged). So the primitive is bound on the data with the equation's params (widened to
float32 for 16- and 8-bit data, which LAPACK has no kernels for: plain float16 raises there;
the outputs return to the data dtype), and each output gets the power of the input scale it
is homogeneous of (exact):

- degree 1 (scale ``s_a``): R of QR, singular values, eigenvalues, U of LU, the Schur form,
  the Hessenberg and tridiagonal forms; degree 1/2: the Cholesky factor (an odd exponent
  moves a factor 2 into the data first, as for ``sqrt``); degree -1 in the matrix and 1 in
  the right-hand side: the solutions ``x = a^-1 b`` (scale ``s_b / s_a``);
- degree 0 (scale 1): Q of QR, singular vectors, eigenvectors, Schur vectors, the unit-lower
  L of LU, Householder reflectors and their ``taus``; integer pivots and permutations are
  plain.

Packed outputs (LU, Hessenberg, tridiagonal reduction) hold a degree-1 triangle and a
degree-0 triangle in one array: the degree-0 part is stored divided by the scale, so one
``ScaledArray(data, s)`` holds both exactly (in 16-bit formats, while ``s`` is within their
range). A unit-diagonal triangular solve or a Householder product reads such a degree-0
part next to an implicit unit diagonal, which is not a scale change: it works on the values
(float32 for narrow data).

``custom_linear_solve`` (``jnp.linalg.solve``, ``inv``, ``jax.scipy.sparse.linalg.cg``) is
evaluated through its ``solve`` sub-jaxpr with the scalify interpreter, exactly as JAX's
own implementation evaluates it; derivatives are explicit in the jaxpr when ``grad`` is
taken inside ``scalify`` (with ``grad`` outside, the matrix derivative of ``jnp.linalg.solve``
is lost: see the rule). ``eig`` has complex outputs, which cannot be scaled: they are
plain (eigenvalues of the data times ``s_a``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import primitives as P

from ..core.array import ScaledArray
from ..core.interpreter import eval_closed_jaxpr
from ..core.registry import register_scaled_lax_op, register_scaled_op
from ..core.scaling import (
    align_to_largest,
    as_scale,
    exact_root,
    mul_data,
    to_float32_value,
    value_order_data,
    widen,
    with_scalar_scale,
)

Array = Any


# --- private helpers -------------------------------------------------------------------------
def _bind(prim, *operands: Array, **params) -> list:
    """``prim`` bound on plain operands; always a list of outputs."""
    outs = prim.bind(*operands, **params)
    return list(outs) if prim.multiple_results else [outs]


def _unit(data: Array) -> ScaledArray:
    """A degree-0 output: scale 1."""
    return ScaledArray(data, as_scale(1))


def _ratio(num: Array, den: Array) -> Array:
    """``num / den`` of two scales (exact for powers of two; a zero scale gives inf or nan)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return as_scale(as_scale(num) / as_scale(den))


def _below_band(shape: Sequence[int], offset: int, lower: bool = True) -> Array:
    """Mask of the entries strictly below the ``offset``-th subdiagonal (above, if not ``lower``)."""
    rows = jax.lax.broadcasted_iota(np.int32, tuple(shape[-2:]), 0)
    cols = jax.lax.broadcasted_iota(np.int32, tuple(shape[-2:]), 1)
    return rows > cols + offset if lower else cols > rows + offset


def _packed(data: Array, scale: Array, offset: int, lower: bool = True) -> ScaledArray:
    """A packed factorisation of data ``d`` (of a matrix ``d * scale``) as one scaled array.

    The part below the ``offset``-th subdiagonal (above, if not ``lower``) is degree 0 (its
    value is the same for ``d`` and ``d * scale``) and is stored divided by ``scale``; the
    rest is degree 1 and keeps ``scale``.
    """
    scale = as_scale(scale)
    with np.errstate(divide="ignore"):  # an asserted-zero matrix: 1 / 0 is inf
        unscaled = mul_data(data, as_scale(1 / scale))
    return ScaledArray(jnp.where(_below_band(data.shape, offset, lower), unscaled, data), scale)


def _on_values(prim, operands: Sequence[ScaledArray], params: dict, dtype: Any) -> list:
    """``prim`` on the values of the operands (float32 for narrow data), outputs cast to ``dtype``."""
    return [o.astype(dtype) for o in _bind(prim, *(to_float32_value(x) for x in operands), **params)]


# --- solvers ---------------------------------------------------------------------------------
@register_scaled_lax_op
def scaled_triangular_solve(a: ScaledArray, b: ScaledArray, *, unit_diagonal: bool, **params) -> ScaledArray:
    """Scale s_b / s_a, solve on the data (unit_diagonal: a's value, b's data, scale s_b).

    ``op(a * s_a) x = b * s_b`` (or ``x op(a * s_a) = b * s_b``) gives ``x = x_d * s_b / s_a``
    with ``x_d`` the solution on the data, whatever ``left_side``, ``lower``, ``transpose_a``
    and ``conjugate_a``. With ``unit_diagonal`` the diagonal is an implicit 1 that does not
    scale with ``a``: the solve uses the value of ``a`` (float32 for narrow data) and the data
    of ``b``, the output keeps ``s_b``.
    """
    a, b = with_scalar_scale(a), with_scalar_scale(b)
    if unit_diagonal:
        x = P.triangular_solve_p.bind(to_float32_value(a), widen(b.data), unit_diagonal=True, **params)
        return ScaledArray(x.astype(b.dtype), as_scale(b.scale))
    x = P.triangular_solve_p.bind(a.data, b.data, unit_diagonal=False, **params)
    return ScaledArray(x, _ratio(b.scale, a.scale))


@register_scaled_lax_op
def scaled_tridiagonal_solve(dl: ScaledArray, d: ScaledArray, du: ScaledArray, b: ScaledArray, **params) -> ScaledArray:
    """Scale s_b / s_t, the three diagonals aligned to their largest scale s_t, solve on the data."""
    (dl, d, du), s_t = align_to_largest([with_scalar_scale(dl), with_scalar_scale(d), with_scalar_scale(du)])
    b = with_scalar_scale(b)
    x = P.tridiagonal_solve_p.bind(dl.data, d.data, du.data, b.data, **params)
    return ScaledArray(x, _ratio(b.scale, s_t))


@register_scaled_op(P.linear_solve_p, unpromoted_inputs=True)
def scaled_custom_linear_solve(*args: Any, const_lengths: Any, jaxprs: Any, **params) -> list:
    """The solve sub-jaxpr scalified on its constants and the right-hand side (as JAX evaluates it).

    The implicit derivative of ``custom_linear_solve`` is not re-emitted: take ``grad`` inside
    ``scalify`` (the supported pattern, where the derivative is already explicit in the
    jaxpr). Differentiating a scalified function from outside differentiates the solve
    jaxpr itself, and ``jnp.linalg.solve`` computes its LU under ``stop_gradient``, so the
    derivative with respect to the matrix would be lost.
    """
    offset = const_lengths.matvec + const_lengths.vecmat
    solve_consts = args[offset : offset + const_lengths.solve]
    rhs = args[sum(const_lengths) :]
    return eval_closed_jaxpr(jaxprs.solve, [*solve_consts, *rhs])


def _on_data(prim, a: ScaledArray, params: dict) -> list:
    """``prim`` on the data of ``a``, in float32 for narrow data (LAPACK has no float16 kernels); real floating outputs back in ``a``'s dtype."""
    outs = _bind(prim, widen(value_order_data(a)), **params)  # scale 0: the factorisation of zeros
    return [o.astype(a.dtype) if jnp.issubdtype(o.dtype, jnp.floating) else o for o in outs]


# --- factorisations --------------------------------------------------------------------------
@register_scaled_lax_op
def scaled_cholesky(a: ScaledArray, **params) -> ScaledArray:
    """Scale sqrt(s_a) exactly (an odd exponent moves a factor 2 into the data), cholesky of the data."""
    return exact_root(with_scalar_scale(a), 2, lambda d: P.cholesky_p.bind(d, **params), inverse=False)


@register_scaled_lax_op
def scaled_lu(a: ScaledArray, **params) -> list:
    """Packed LU with scale s_a: U (degree 1) as computed, unit-lower L stored / s_a; pivots, permutation plain."""
    a = with_scalar_scale(a)
    lu, pivots, permutation = _bind(P.lu_p, widen(a.data), **params)
    return [_packed(lu, a.scale, offset=0).astype(a.dtype), pivots, permutation]


@register_scaled_lax_op
def scaled_qr(a: ScaledArray, **params) -> list:
    """Q scale 1, R scale s_a, QR of the data; column pivots (pivoting=True) plain."""
    a = with_scalar_scale(a)
    q, r, *pivots = _on_data(P.qr_p, a, params)
    return [_unit(q), ScaledArray(r, as_scale(a.scale)), *pivots]


@register_scaled_lax_op
def scaled_svd(a: ScaledArray, **params) -> list:
    """Singular values scale s_a, U and V^H scale 1, SVD of the data."""
    a = with_scalar_scale(a)
    s, *uv = _on_data(P.svd_p, a, params)
    return [ScaledArray(s, as_scale(a.scale)), *(_unit(v) for v in uv)]


@register_scaled_lax_op
def scaled_eigh(a: ScaledArray, **params) -> list:
    """Eigenvectors scale 1, eigenvalues scale s_a, eigh of the data."""
    a = with_scalar_scale(a)
    vectors, values = _on_data(P.eigh_p, a, params)
    return [_unit(vectors), ScaledArray(values, as_scale(a.scale))]


@register_scaled_lax_op
def scaled_eig(a: ScaledArray, **params) -> list:
    """Plain complex outputs (no complex scales): eig of the data, eigenvalues times s_a, eigenvectors as they are."""
    a = with_scalar_scale(a)
    values, *vectors = _on_data(P.eig_p, a, params)
    return [values * jnp.asarray(a.scale).astype(values.dtype), *vectors]


@register_scaled_lax_op
def scaled_schur(a: ScaledArray, *, select_callable: Callable | None, **params) -> list:
    """Schur form scale s_a, Schur vectors scale 1; with a select_callable, on the values (scale 1).

    A ``select_callable`` picks eigenvalues by their value, so it must see the value of ``a``.
    """
    a = with_scalar_scale(a)
    if select_callable is not None:
        outs = _on_values(P.schur_p, [a], dict(params, select_callable=select_callable), a.dtype)
        return [_unit(o) for o in outs]
    t, *vectors = _on_data(P.schur_p, a, dict(params, select_callable=None))
    return [ScaledArray(t, as_scale(a.scale)), *(_unit(v) for v in vectors)]


@register_scaled_lax_op
def scaled_hessenberg(a: ScaledArray, **params) -> list:
    """Packed Hessenberg form scale s_a, reflectors below the subdiagonal stored / s_a; taus scale 1."""
    a = with_scalar_scale(a)
    packed, taus = _on_data(P.hessenberg_p, a, params)
    return [_packed(packed, a.scale, offset=1), _unit(taus)]


@register_scaled_lax_op
def scaled_tridiagonal(a: ScaledArray, *, lower: bool, **params) -> list:
    """Packed form, diagonal and off-diagonal scale s_a, reflectors stored / s_a; taus scale 1."""
    a = with_scalar_scale(a)
    packed, d, e, taus = _on_data(P.tridiagonal_p, a, dict(params, lower=lower))
    scale = as_scale(a.scale)
    return [_packed(packed, scale, offset=1, lower=lower), ScaledArray(d, scale), ScaledArray(e, scale), _unit(taus)]


@register_scaled_lax_op
def scaled_householder_product(a: ScaledArray, taus: ScaledArray, **params) -> ScaledArray:
    """Scale 1, computed on the values (float32 for narrow data): the reflectors have an implicit unit entry."""
    return _unit(
        _on_values(P.householder_product_p, [with_scalar_scale(a), with_scalar_scale(taus)], params, a.dtype)[0]
    )


__all__ = [
    "scaled_cholesky",
    "scaled_custom_linear_solve",
    "scaled_eig",
    "scaled_eigh",
    "scaled_hessenberg",
    "scaled_householder_product",
    "scaled_lu",
    "scaled_qr",
    "scaled_schur",
    "scaled_svd",
    "scaled_triangular_solve",
    "scaled_tridiagonal",
    "scaled_tridiagonal_solve",
]
