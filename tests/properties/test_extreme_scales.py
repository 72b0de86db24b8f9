"""Input scales near the ends of the float32 range (2**±100 .. 2**±120) give finite output scales.

Every rule's invariance case (see ``tests/invariance.py``) runs on inputs whose scales are
drawn from ``2**100 .. 2**120`` and ``2**-120 .. 2**-100``. Products and quotients of such
scales leave float32 (``2**120 * 2**20`` is inf); with ``guard_traced_scales`` (the input
scales here are traced) the rules keep every output scale a finite power of two, moving any
excess into the data, and the values equal the exact ones (the
plain function in float64) wherever those are finite float32 numbers. (The plain function in
float32 is no reference at these scales: its intermediate products overflow or flush to zero
where the scalified program, which keeps magnitudes in the scales, computes the exact value.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa
from tests.invariance import assert_pow2_scales, float64_reference
from tests.properties.test_rule_coverage import _all_cases

# Cases whose values are not compared at these scales, with the reason (their scales are
# still checked).
VALUES_NOT_COMPARED = {
    # The rule keeps the operand's scale and applies the updates by value (an element hit k
    # times would need the updates' scale to the k-th power): updates of magnitude 2**114
    # overflow the data. Multiplicative updates are expected near 1 (see the rule).
    "scatter_mul": "updates applied by value",
    # Factorisations of a general matrix: the float64 reference pivots differently.
    "lu": "pivoting differs from the float64 reference",
    "hessenberg": "pivoting differs from the float64 reference",
    "tridiagonal": "pivoting differs from the float64 reference",
    "schur": "Schur vectors are defined up to sign: the float64 reference picks other signs",
    "bitcast_convert_type": "the float64 reference has another bit pattern",
    # Computed on float32 values, as plain JAX does; jax.scipy's float32 polygamma is 0 at 2**110.
    "polygamma": "float32 special function underflows where float64 does not",
    # The three diagonals share one data scale: drawn 2**220 apart, the smaller ones flush.
    "tridiagonal_solve": "diagonals of scales 2**±110 do not fit one data scale",
}
CASES = _all_cases()


def _is_float(x) -> bool:
    return jnp.issubdtype(np.asarray(x).dtype, jnp.floating)


def _extreme_exponent(rng: np.random.Generator) -> int:
    return int(rng.integers(100, 121)) * (1 if rng.random() < 0.5 else -1)


def _assert_finite_scales(tree) -> None:
    for leaf in jax.tree.leaves(tree, is_leaf=jsa.is_scaled_leaf):
        if isinstance(leaf, jsa.ScaledArray):
            assert np.all(np.isfinite(np.asarray(leaf.scale))), f"scale {leaf.scale} is not finite"


def _compare_where_representable(got, expected, rtol: float, atol: float) -> None:
    got_leaves, exp_leaves = jax.tree.leaves(jsa.asarray(got)), jax.tree.leaves(expected)
    assert len(got_leaves) == len(exp_leaves)
    for g, e in zip(got_leaves, exp_leaves):
        g, e = np.asarray(g, np.float64), np.asarray(e, np.float64)
        if not _is_float(e):
            continue
        finite = np.isfinite(e) & (np.abs(e) <= np.finfo(np.float32).max)
        if not finite.any():
            continue
        magnitude = float(np.max(np.abs(e[finite])))
        # Below float32's smallest normal number a value is not representable (flushed to 0).
        floor = 2 * float(np.finfo(np.float32).tiny)
        np.testing.assert_allclose(g[finite], e[finite], rtol=rtol, atol=max(atol * magnitude, floor))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_extreme_input_scales(case):
    rng = np.random.default_rng(0)
    args = [make(rng) for make in case.args]
    flags = case.scaled if case.scaled is not None else [_is_float(a) for a in args]
    inputs, values = [], []
    for a, flag in zip(args, flags):
        if flag and _is_float(a):
            scale = np.float32(2.0 ** _extreme_exponent(rng))
            inputs.append(jsa.ScaledArray(jnp.asarray(a), jnp.asarray(scale)))
            values.append(np.asarray(a, np.float64) * np.float64(scale))
        else:
            inputs.append(jnp.asarray(a))
            values.append(a)
    with jsa.ScalifyConfig(guard_traced_scales=True):
        got = jsa.scalify(case.fn)(*inputs)
    assert_pow2_scales(got)
    _assert_finite_scales(got)
    if case.name not in VALUES_NOT_COMPARED:
        _compare_where_representable(got, float64_reference(case.fn, values), case.rtol, case.atol)
