"""Matrix factorisations and solvers: jnp.linalg and jax.scipy.linalg under scalify.

Tolerances: every rule binds the same LAPACK routine on data that differs from the value by
a power of two, so the factorisations agree to a few ulps; what differs is the float32
round-off of the surrounding jnp code (sums rebalanced by the add rule, unit-scaled
matmuls), amplified by the condition number of the solve. The inputs are built well
conditioned (condition number below ~20), hence rtol 1e-4 (about 20 * 2^-23 * n, with
margin) instead of the default 2e-5; gradients of eigen- and singular vectors divide by
eigenvalue gaps and get 1e-3.
"""

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import jax.scipy.sparse.linalg
import numpy as np
import pytest
from jax import lax

import jax_scalify as jsa
from jax_scalify.lax import rules_linalg_solvers
from tests.invariance import STATIC_POLICY, Case, assert_pow2_scales, invariance_test, normal
from tests.invariance import exact_value as _value
from tests.invariance import scaled as _scaled

N = 4


# --- argument makers: well-conditioned matrices ----------------------------------------------
def general(n: int = N):
    """A random matrix 2I + G/sqrt(n): singular values within about [1, 3]."""
    return lambda rng: (2 * np.eye(n) + rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32)


def spd(n: int = N):
    """A symmetric positive definite matrix with eigenvalues in about [n, 3n]."""

    def make(rng):
        g = rng.standard_normal((n, n))
        return (g @ g.T / 2 + n * np.eye(n)).astype(np.float32)

    return make


def distinct_spectrum(n: int = N):
    """A symmetric matrix with well separated eigenvalues 1, 2, ..., n (stable eigenvectors)."""

    def make(rng):
        q, _ = np.linalg.qr(rng.standard_normal((n, n)))
        return (q @ np.diag(np.arange(1.0, n + 1)) @ q.T).astype(np.float32)

    return make


def lower_triangular(n: int = N):
    """Lower triangular with a dominant diagonal (in [2, 3]) and small off-diagonal entries."""

    def make(rng):
        off = np.tril(rng.standard_normal((n, n)) / n, -1)
        return (off + np.diag(rng.uniform(2, 3, n))).astype(np.float32)

    return make


def diagonal(low: float, high: float, n: int = N):
    return lambda rng: rng.uniform(low, high, n).astype(np.float32)


# --- functions -------------------------------------------------------------------------------
def _flat(fn):
    """``fn``'s floating outputs raveled into one vector: the harness takes grad of its sum."""

    def flat(*args):
        outs = [o for o in jax.tree.leaves(fn(*args)) if jnp.issubdtype(o.dtype, jnp.floating)]
        return jnp.concatenate([jnp.ravel(o) for o in outs])

    return flat


def _tridiagonal_solve(dl, d, du, b):
    return lax.linalg.tridiagonal_solve(dl.at[0].set(0.0), d, du.at[-1].set(0.0), b)


def _householder_q(a, taus):
    return lax.linalg.householder_product(a, taus)


def _eigvals_moduli(a):
    return jnp.sort(jnp.abs(jnp.linalg.eigvals(a)))


def _cg(a, b):
    return jax.scipy.sparse.linalg.cg(a, b, tol=1e-6)[0]


INVARIANCE_CASES = [
    # custom_linear_solve, lu, triangular_solve (unit and non-unit diagonal, transposed).
    Case("solve", jnp.linalg.solve, [general(), normal(N, 3)], grad=True, rtol=1e-4, atol=1e-5),
    Case("inv", jnp.linalg.inv, [general()], grad=True, rtol=1e-4, atol=1e-5),
    Case("det", jnp.linalg.det, [general()], grad=True, rtol=1e-4, atol=1e-5),
    Case("slogdet", lambda a: jnp.linalg.slogdet(a)[1], [general()], grad=True, rtol=1e-4, atol=1e-5),
    Case("lu", _flat(jsl.lu), [general()], grad=True, rtol=1e-4, atol=1e-5),
    Case("lu_solve", lambda a, b: jsl.lu_solve(jsl.lu_factor(a), b), [general(), normal(N, 2)], rtol=1e-4, atol=1e-5),
    Case(
        "solve_triangular",
        lambda a, b: jsl.solve_triangular(a, b, lower=True),
        [lower_triangular(), normal(N, 3)],
        grad=True,
        rtol=1e-4,
        atol=1e-5,
    ),
    Case(
        "solve_triangular_unit_transposed",
        lambda a, b: jsl.solve_triangular(a, b, lower=True, trans=1, unit_diagonal=True),
        [lower_triangular(), normal(N, 3)],
        grad=True,
        rtol=1e-4,
        atol=1e-5,
    ),
    Case(
        "triangular_solve_right",
        lambda a, b: lax.linalg.triangular_solve(a, b, left_side=False, lower=True),
        [lower_triangular(), normal(3, N)],
        rtol=1e-4,
        atol=1e-5,
    ),
    Case("cholesky", jnp.linalg.cholesky, [spd()], grad=True, rtol=1e-4, atol=1e-5),
    Case(
        "cho_solve",
        lambda a, b: jsl.cho_solve(jsl.cho_factor(a, lower=True), b),
        [spd(), normal(N, 2)],
        rtol=1e-4,
        atol=1e-5,
    ),
    Case("qr", _flat(jnp.linalg.qr), [general()], grad=True, rtol=1e-4, atol=1e-5),
    Case("qr_pivoting", lambda a: jsl.qr(a, pivoting=True), [general()], rtol=1e-4, atol=1e-5),
    Case("svd", _flat(jnp.linalg.svd), [general()], grad=True, rtol=1e-3, atol=1e-4),
    Case("svd_values", lambda a: jnp.linalg.svd(a, compute_uv=False), [normal(5, 3)], rtol=1e-4, atol=1e-5),
    Case("eigh", _flat(jnp.linalg.eigh), [distinct_spectrum()], grad=True, rtol=1e-3, atol=1e-4),
    Case("eig", _eigvals_moduli, [general()], rtol=1e-4, atol=1e-5),
    Case("schur", jsl.schur, [distinct_spectrum()], rtol=1e-4, atol=1e-5),
    Case("hessenberg", lambda a: jsl.hessenberg(a, calc_q=True), [general()], rtol=1e-4, atol=1e-5),
    Case("tridiagonal", lax.linalg.tridiagonal, [spd()], rtol=1e-4, atol=1e-5),
    Case("householder_product", _householder_q, [normal(N, 3), diagonal(1.0, 2.0, 3)], rtol=1e-4, atol=1e-5),
    Case(
        "tridiagonal_solve",
        _tridiagonal_solve,
        [normal(N), diagonal(3.0, 4.0), normal(N), normal(N, 2)],
        grad=True,
        rtol=1e-4,
        atol=1e-5,
    ),
    # Gradients through custom_linear_solve are checked by "solve" and "inv" (cheaper than cg's loop).
    Case("custom_linear_solve_cg", _cg, [spd(), normal(N)], rtol=1e-4, atol=1e-5),
]


test_invariance = invariance_test(INVARIANCE_CASES, max_examples=6)


# --- helpers ---------------------------------------------------------------------------------


def _scale(x) -> float:
    assert isinstance(x, jsa.ScaledArray), type(x)
    return float(np.asarray(x.scale))


_RNG = np.random.default_rng(7)
A = general()(_RNG)
S = spd()(_RNG)
L = lower_triangular()(_RNG)
B = _RNG.standard_normal((N, 3)).astype(np.float32)


# --- exact scales ----------------------------------------------------------------------------
@pytest.mark.parametrize("exponent", [-41, -40, 0, 39, 40])
def test_factorisations_are_exact_on_the_scale(exponent):
    """The data of each output is bitwise the factorisation of the data; scales are exact."""
    a, s = _scaled(A, exponent), _scaled(S, exponent)
    q, r = jsa.scalify(jnp.linalg.qr, policy=STATIC_POLICY)(a)
    q_d, r_d = jnp.linalg.qr(A)
    assert _scale(q) == 1.0 and _scale(r) == 2.0**exponent
    np.testing.assert_array_equal(q.data, q_d)
    np.testing.assert_array_equal(r.data, r_d)
    u, sv, vh = jsa.scalify(jnp.linalg.svd, policy=STATIC_POLICY)(a)
    assert (_scale(u), _scale(sv), _scale(vh)) == (1.0, 2.0**exponent, 1.0)
    v, w = jsa.scalify(lambda m: lax.linalg.eigh(m, symmetrize_input=False), policy=STATIC_POLICY)(s)
    assert _scale(w) == 2.0**exponent and _scale(v) == 1.0
    np.testing.assert_allclose(_value(w), np.linalg.eigvalsh(S.astype(np.float64)) * 2.0**exponent, rtol=1e-5)
    chol = jsa.scalify(lambda m: lax.linalg.cholesky(m, symmetrize_input=False), policy=STATIC_POLICY)(s)
    assert _scale(chol) == 2.0 ** -(-exponent // 2)  # sqrt of the scale rounded up to an even exponent
    np.testing.assert_allclose(
        _value(chol), np.linalg.cholesky(S.astype(np.float64)) * 2.0 ** (exponent / 2), rtol=1e-5
    )


@pytest.mark.parametrize("exponent", [-40, 0, 40])
def test_lu_packs_unit_l_and_scaled_u(exponent):
    lu, pivots, perm = jsa.scalify(lax.linalg.lu, policy=STATIC_POLICY)(_scaled(A, exponent))
    lu_d, pivots_d, perm_d = lax.linalg.lu(A)
    assert _scale(lu) == 2.0**exponent
    np.testing.assert_array_equal(pivots, pivots_d)
    np.testing.assert_array_equal(perm, perm_d)
    value = _value(lu)
    np.testing.assert_array_equal(np.tril(value, -1), np.tril(np.asarray(lu_d, np.float64), -1))  # L: scale 1
    np.testing.assert_array_equal(np.triu(value), np.triu(np.asarray(lu_d, np.float64)) * 2.0**exponent)  # U: s_a


@pytest.mark.parametrize("ea, eb", [(-40, 40), (40, -40), (-20, -20), (3, 0)])
def test_solves_are_exact(ea, eb):
    """solve(A * 2^ea, B * 2^eb) is bitwise solve(A, B) * 2^(eb - ea): values up to 2^80."""
    x = jsa.scalify(jnp.linalg.solve, policy=STATIC_POLICY)(_scaled(A, ea), _scaled(B, eb))
    assert _scale(x) == 2.0 ** (eb - ea)
    np.testing.assert_array_equal(x.data, jnp.linalg.solve(A, B))
    t = jsa.scalify(lambda a, b: jsl.solve_triangular(a, b, lower=True), policy=STATIC_POLICY)(
        _scaled(L, ea), _scaled(B, eb)
    )
    assert _scale(t) == 2.0 ** (eb - ea)
    np.testing.assert_array_equal(t.data, jsl.solve_triangular(L, B, lower=True))


def test_unit_diagonal_solve_is_not_a_scale_change():
    """With unit_diagonal the diagonal is 1 whatever a's scale: the result keeps b's scale."""
    a, b = _scaled(L, 10), _scaled(B, -5)
    fn = lambda a, b: jsl.solve_triangular(a, b, lower=True, unit_diagonal=True)  # noqa: E731
    x = jsa.scalify(fn, policy=STATIC_POLICY)(a, b)
    assert _scale(x) == 2.0**-5
    np.testing.assert_allclose(_value(x), fn(a.to_array(), b.to_array()), rtol=1e-5, atol=1e-7)


def test_float16_triangular_solve_outside_float16_range():
    """Values 2^30 and 2^-30 cannot be float16; their data and scales can."""
    a, b = _scaled(L, 30, jnp.float16), _scaled(B, -30, jnp.float16)
    fn = lambda a, b: jsl.solve_triangular(a, b, lower=True)  # noqa: E731
    x = jsa.scalify(fn, policy=STATIC_POLICY)(a, b)
    assert x.dtype == jnp.float16 and _scale(x) == 2.0**-60
    expected = fn(_value(a), _value(b))
    np.testing.assert_allclose(_value(x), expected, rtol=5e-3, atol=1e-3 * np.max(np.abs(expected)))
    plain = fn(a.to_array(jnp.float16), b.to_array(jnp.float16))  # a is inf and b is 0 in float16
    assert not np.allclose(np.asarray(plain, np.float64), expected, rtol=1e-2)
    # Unit diagonal (the L of an LU): b's scale is kept, a's value is used in float32.
    unit = _scaled(L, 0, jnp.float16)
    fn = lambda a, b: jsl.solve_triangular(a, b, lower=True, unit_diagonal=True)  # noqa: E731
    x = jsa.scalify(fn, policy=STATIC_POLICY)(unit, b)
    assert x.dtype == jnp.float16 and _scale(x) == 2.0**-30
    expected = fn(_value(unit), _value(b))
    np.testing.assert_allclose(_value(x), expected, rtol=5e-3, atol=1e-3 * np.max(np.abs(expected)))


def test_det_and_inverse_scales():
    a = _scaled(A, 20)
    det = jsa.scalify(jnp.linalg.det)(a)
    np.testing.assert_allclose(_value(det), np.linalg.det(A.astype(np.float64)) * 2.0**80, rtol=1e-5)
    inv = jsa.scalify(jnp.linalg.inv)(a)
    np.testing.assert_allclose(_value(inv), np.linalg.inv(A.astype(np.float64)) * 2.0**-20, rtol=1e-5, atol=1e-12)
    assert_pow2_scales((det, inv))


def test_eig_outputs_are_plain_complex():
    values, vectors = jsa.scalify(jnp.linalg.eig)(_scaled(A, -12))
    assert not isinstance(values, jsa.ScaledArray) and jnp.iscomplexobj(values)
    np.testing.assert_allclose(
        np.sort_complex(np.asarray(values)), np.sort_complex(np.linalg.eigvals(A) * 2.0**-12), rtol=1e-5
    )
    assert not isinstance(vectors, jsa.ScaledArray)


def test_packed_hessenberg_and_tridiagonal_keep_reflectors_unscaled():
    h, taus = jsa.scalify(lax.linalg.hessenberg, policy=STATIC_POLICY)(_scaled(A, 16))
    h_d, taus_d = lax.linalg.hessenberg(A)
    assert _scale(h) == 2.0**16 and _scale(taus) == 1.0
    np.testing.assert_array_equal(np.tril(_value(h), -2), np.tril(np.asarray(h_d, np.float64), -2))
    np.testing.assert_array_equal(np.triu(_value(h), -1), np.triu(np.asarray(h_d, np.float64), -1) * 2.0**16)
    packed, d, e, taus = jsa.scalify(lambda a: lax.linalg.tridiagonal(a, lower=False), policy=STATIC_POLICY)(
        _scaled(S, -16)
    )
    _, d_ref, e_ref, _ = lax.linalg.tridiagonal(S, lower=False)
    assert _scale(d) == _scale(e) == 2.0**-16 and _scale(taus) == 1.0
    np.testing.assert_array_equal(_value(d), np.asarray(d_ref, np.float64) * 2.0**-16)


def test_custom_linear_solve_runs_the_solve_jaxpr_scalified():
    x = jsa.scalify(_cg)(_scaled(S, 8), _scaled(B[:, 0], -8))
    assert isinstance(x, jsa.ScaledArray)
    assert_pow2_scales(x)
    np.testing.assert_allclose(_value(x), np.linalg.solve(S.astype(np.float64), B[:, 0]) * 2.0**-16, rtol=1e-4)


def test_linalg_rules_are_exported_with_summaries():
    assert "scaled_cholesky" in rules_linalg_solvers.__all__
    summaries = {prim.name: entry.summary for prim, entry in jsa.extend.registered_rules().items()}
    for name in ("triangular_solve", "cholesky", "lu", "qr", "svd", "eigh", "eig", "custom_linear_solve"):
        assert summaries[name], name


FLOAT16_LINALG = {
    "qr": lambda a: jnp.sum(jnp.log(jnp.abs(jnp.diagonal(jnp.linalg.qr(a)[1])))),
    "svd": lambda a: jnp.sum(jnp.linalg.svd(a, compute_uv=False)),
    "eigvalsh": lambda a: jnp.sum(jnp.log(jnp.linalg.eigvalsh(a @ a.T))),
    "slogdet": lambda a: jnp.linalg.slogdet(a)[1],
    "inv": lambda a: jnp.trace(jnp.linalg.inv(a)),
}


@pytest.mark.parametrize("name", list(FLOAT16_LINALG), ids=list(FLOAT16_LINALG))
def test_factorisations_of_float16_data_run_in_float32(name):
    """LAPACK has no float16 kernels: plain float16 raises ``Unsupported dtype float16``, and
    so did these rules on a float16 weight of the README recipe (a nuclear-norm or
    log-determinant term). The factorisation now runs on the data in float32."""
    a = np.eye(8, dtype=np.float32) + 0.3 * np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32)
    a16 = a.astype(np.float16)
    fn = FLOAT16_LINALG[name]
    expected_value, expected_grad = jax.value_and_grad(fn)(jnp.asarray(a16, jnp.float32))
    scaled = jsa.tree.astype(jsa.as_scaled_array(jnp.asarray(a16, jnp.float32), scale=np.float32(2.0**-6)), jnp.float16)
    value, grad = jax.jit(jsa.scalify(jax.value_and_grad(fn)))(scaled)
    assert grad.dtype == jnp.float16
    np.testing.assert_allclose(float(value), float(expected_value), rtol=0.01, atol=0.01)
    np.testing.assert_allclose(np.asarray(jsa.asarray(grad, jnp.float32)), expected_grad, rtol=0.05, atol=0.05)
