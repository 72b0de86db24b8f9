"""Inputs asserted zero (scale 0, the design's "the user asserts x is zero") give plain results.

Users pass scale-0 arrays (e.g. fresh optimizer moments, so that the first
``b * m + (1 - b) * g`` takes the gradient's scale), so every rule must accept scale-0
operands without turning ``0 / 0`` into nan. This runs every
invariance case of the test suite on all-zero floating inputs with scale 0 and compares with
the plain function on zeros (nan where the plain function gives nan, e.g. ``0 / 0``); then on
random nonzero float32 and float16 data at scale 0, which assert zeros just the same.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa
from tests.properties.test_rule_coverage import _all_cases

# Cases left out, with the reason.
NOT_APPLICABLE = {
    # Factorisations of the singular zero matrix: plain and scalified runs divide 0 by 0 in
    # different places, so where nan appears is not defined by the value.
    "lu": "singular input",
    "hessenberg": "singular input",
    "tridiagonal": "singular input",
    # Rules written in the tests to exercise custom_scale: user rules need not handle scale 0.
    "custom_scale_gelu": "test-defined rule",
    "custom_scale_in_program": "test-defined rule",
}
CASES = [c for c in _all_cases() if c.name not in NOT_APPLICABLE]
# The inverse of the zero matrix is non-finite everywhere, but which entries LAPACK leaves inf
# rather than nan depends on the build: compare where the result is finite, and its values there.
NON_FINITE_ANYHOW = {"inv"}


def _is_float(x) -> bool:
    return jnp.issubdtype(np.asarray(x).dtype, jnp.floating)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_asserted_zero_inputs(case):
    rng = np.random.default_rng(0)
    args = [make(rng) for make in case.args]
    scaled = case.scaled if case.scaled is not None else [_is_float(a) for a in args]
    zeros = [np.zeros_like(a) if s else a for a, s in zip(args, scaled)]
    inputs = [jsa.ScaledArray(jnp.asarray(z), np.float32(0)) if s else z for z, s in zip(zeros, scaled)]
    expected = jax.tree.leaves(case.fn(*[jnp.asarray(z) for z in zeros]))
    got = jax.tree.leaves(jsa.asarray(jsa.scalify(case.fn)(*inputs)))
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        g, e = np.asarray(g, np.float64), np.asarray(e, np.float64)
        if case.name in NON_FINITE_ANYHOW:
            np.testing.assert_array_equal(np.isfinite(g), np.isfinite(e))
            g, e = np.where(np.isfinite(g), g, 0), np.where(np.isfinite(e), e, 0)
        np.testing.assert_array_equal(g, e)


def _nonzero_like(rng, a, dtype):
    """Random data of ``a``'s shape, none of it zero (magnitudes in [0.5, 2], both signs), in ``dtype``."""
    a = np.asarray(a)
    data = rng.uniform(0.5, 2.0, a.shape) * rng.choice([-1.0, 1.0], a.shape)
    return jnp.asarray(data.astype(np.float32)).astype(dtype)


# float16 in the default run; float32 (the same rules on wider data) in the slow run, for time.
@pytest.mark.parametrize(
    "dtype", [pytest.param(jnp.float32, marks=pytest.mark.slow), jnp.float16], ids=["float32", "float16"]
)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_zero_scale_ignores_the_data(case, dtype):
    """A zero scale asserts the value is zero whatever the data: random nonzero data at scale 0
    give plain JAX's answer on the zeros ``to_array`` gives (signed as the data: ``-1.0 * 0`` is
    ``-0.0``), through ``jax.jit(jsa.scalify(f))`` as users call it.

    Before, comparisons, argmax, sign, sort keys, roots and factorisations read the data
    (``ScaledArray([1, 2, 3], 0) > 0`` was True), and a clamp or a select beside a constant
    aligned to the zero scale (``jnp.clip(x, -1, 1)`` was nan).
    """
    rng = np.random.default_rng(0)
    args = [make(rng) for make in case.args]
    scaled = case.scaled if case.scaled is not None else [_is_float(a) for a in args]
    inputs = [
        jsa.ScaledArray(
            _nonzero_like(rng, a, dtype if np.asarray(a).dtype == np.float32 else np.asarray(a).dtype), jnp.float32(0)
        )
        if s
        else jnp.asarray(a)
        for a, s in zip(args, scaled)
    ]
    zeros = [x.to_array(x.dtype) if isinstance(x, jsa.ScaledArray) else x for x in inputs]
    if dtype == jnp.float16:
        try:  # the case's function may not take float16 (float32 init values, LAPACK, FFT)
            expected = jax.tree.leaves(case.fn(*zeros))
        except (TypeError, ValueError, NotImplementedError):
            pytest.skip("the plain function does not take float16 inputs")
    else:
        expected = jax.tree.leaves(case.fn(*zeros))
    got = jax.tree.leaves(jsa.asarray(jax.jit(jsa.scalify(case.fn))(*inputs)))
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        g, e = np.asarray(g, np.float64), np.asarray(e, np.float64)
        if case.name in NON_FINITE_ANYHOW:
            np.testing.assert_array_equal(np.isfinite(g), np.isfinite(e))
            g, e = np.where(np.isfinite(g), g, 0), np.where(np.isfinite(e), e, 0)
        if dtype == jnp.float32:
            np.testing.assert_array_equal(g, e)
        else:  # scalify computes some float16 functions in float32 and rounds once
            np.testing.assert_allclose(g, e, rtol=4e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_zero_scale_in_user_code(dtype):
    """The examples of the issue, as a user writes them: plain JAX on zeros beside scalify on scale 0."""
    x = jsa.ScaledArray(jnp.array([1.0, 2.0, 3.0], dtype), jnp.float32(0))
    y = jsa.ScaledArray(jnp.array([0.5, 3.0, -2.0, 1.0], dtype), jnp.float32(0))
    run = lambda f, v: jsa.asarray(jax.jit(jsa.scalify(f))(v))  # noqa: E731
    for f in [
        lambda x: jnp.clip(x, -1, 1),
        lambda x: jnp.maximum(x, -1),
        lambda x: jnp.minimum(x, 1),
        lambda x: jnp.maximum(x, -1e-3),
        lambda x: x > 0,
        lambda x: x >= 0,
        lambda x: jnp.where(x > 0, x, -1),
        lambda x: jnp.where(x > 0, x, -jnp.inf),
        jnp.argmax,
        jnp.argmin,
        jnp.sign,
        jnp.sort,
        jnp.argsort,
        jnp.sqrt,
    ]:
        for v in (x, y):
            np.testing.assert_array_equal(run(f, v), f(jnp.zeros(v.shape, dtype)))
