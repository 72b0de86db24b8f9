"""Inputs asserted zero (scale 0, the design's "the user asserts x is zero") give plain results.

Users pass scale-0 arrays (e.g. fresh optimizer moments, so that the first
``b * m + (1 - b) * g`` takes the gradient's scale), so every rule must accept scale-0
operands without turning ``0 / 0`` into nan. This runs every
invariance case of the test suite on all-zero floating inputs with scale 0 and compares with
the plain function on zeros (nan where the plain function gives nan, e.g. ``0 / 0``).
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
