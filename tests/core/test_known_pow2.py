"""Known powers of two: marks, the exact shortcuts they enable, and the lean scale arithmetic.

The shortcuts must give exactly the scales (and data) of the general formulas whenever the
scales are powers of two, 0, inf or nan; they only change how many equations are emitted.
"""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_scalify as jsa
from jax_scalify.core import known_pow2
from jax_scalify.core.pow2 import pow2_exponent, pow2_round_down, pow2_round_up
from tests.invariance import assert_pow2_scales

STATIC_POLICY = jsa.RescalePolicy.static()  # tests of the rules' static scales

SPECIAL_SCALES = [0.0, np.inf, np.nan, 2.0**-149, 2.0**-127, 2.0**-126, 2.0**-20, 0.5, 1.0, 2.0, 2.0**30, 2.0**127]


def count(jaxpr, name=None) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        n += name is None or eqn.primitive.name == name
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += count(getattr(sub, "jaxpr", sub), name)
    return n


# --- the registry -------------------------------------------------------------------------------
def test_numpy_values_are_checked():
    assert known_pow2.is_known_pow2(np.float32(0.25))
    assert known_pow2.is_known_pow2(np.array([0.0, np.inf, np.nan, 8.0], np.float32))
    assert not known_pow2.is_known_pow2(np.float32(3.0))
    assert not known_pow2.is_known_pow2(np.float32(-2.0))
    assert not known_pow2.is_known_pow2(np.float32(-np.inf))


def test_marks_live_in_the_scope_only():
    def fn(s):
        assert not known_pow2.is_known_pow2(s)
        with known_pow2.tracking():
            known_pow2.mark_pow2(s)
            assert known_pow2.is_known_pow2(s)
            assert not known_pow2.is_known_pow2(s * 1)
        assert not known_pow2.is_known_pow2(s)
        known_pow2.mark_pow2(s)  # outside a scope: not remembered
        assert not known_pow2.is_known_pow2(s)
        return s

    jax.make_jaxpr(fn)(np.float32(1))


# --- lean bit-level pow2 functions ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float16, jnp.bfloat16, jnp.float8_e4m3fn])
def test_lean_jax_pow2_functions_match_numpy(dtype):
    rng = np.random.default_rng(0)
    values = rng.standard_normal(512) * 10.0 ** rng.uniform(-40, 40, 512)
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-44, 3e-39, 2.0**-149, 3 * 2.0**-140, -5e-42, 1.0, 2.0, 0.5]
    with np.errstate(over="ignore"):
        x = np.concatenate([values, specials]).astype(np.float32).astype(dtype)
    for fn in (pow2_round_down, pow2_round_up, pow2_exponent):
        expected = np.asarray(fn(x)).astype(np.float64)
        for got in (fn(jnp.asarray(x)), jax.jit(fn)(jnp.asarray(x))):
            got = np.asarray(got).astype(np.float64)
            np.testing.assert_array_equal(got, expected, err_msg=f"{fn.__name__} {np.dtype(dtype).name}")


def test_lean_round_emits_no_nested_jit():
    jaxpr = jax.make_jaxpr(pow2_round_down)(np.float32(3))
    assert count(jaxpr.jaxpr, "jit") == 0 and count(jaxpr.jaxpr) <= 16


# --- shortcuts give the general path's results ----------------------------------------------------
def _add_with_known_scales(a, b):
    """``a + b`` through the add rule with both (traced) scales marked as powers of two."""
    with known_pow2.tracking():
        known_pow2.mark_pow2(a.scale)
        known_pow2.mark_pow2(b.scale)
        return jsa.lax.scaled_add(a, b)


def _sum_both_ways(sa, sb):
    """The scalified sum of two arrays with scales sa, sb: general path, then shortcut."""
    a = jsa.ScaledArray.unchecked(jnp.asarray([1.0, -2.0, 3.0]), jnp.float32(sa))
    b = jsa.ScaledArray.unchecked(jnp.asarray([0.5, 0.25, -1.0]), jnp.float32(sb))
    general = jax.jit(jsa.lax.scaled_add)(a, b)
    fast = jax.jit(_add_with_known_scales)(a, b)
    return general, fast


@pytest.mark.parametrize("sa, sb", list(itertools.product(SPECIAL_SCALES, repeat=2)))
def test_sum_scale_shortcut_is_exact(sa, sb):
    general, fast = _sum_both_ways(sa, sb)
    np.testing.assert_array_equal(np.asarray(fast.scale), np.asarray(general.scale))
    np.testing.assert_array_equal(np.asarray(fast.data), np.asarray(general.data))


def test_shortcut_emits_no_sqrt_and_fewer_equations():
    x = jsa.as_scaled_array(jnp.ones((4, 4)))
    general = jax.make_jaxpr(jsa.lax.scaled_add)(x, x).jaxpr
    fast = jax.make_jaxpr(_add_with_known_scales)(x, x).jaxpr
    assert count(general, "sqrt") == 1 and count(fast, "sqrt") == 0
    assert count(fast) <= count(general) - 8


def test_marks_propagate_through_products_jit_and_scan():
    """After one sum every scale is known: the next sums (in jit and scan bodies too) take the shortcut."""

    def fn(x, w):
        h = jnp.tanh(x @ w) + x  # general path once: w's scale is not known
        h = jax.jit(lambda v: v * 3.0 + v)(h)
        h, _ = lax.scan(lambda c, _: (c @ w + c, None), h, None, length=3)
        return h * 3.0 - h

    x = jsa.as_scaled_array(jnp.ones((4, 4)))
    jaxpr = jax.make_jaxpr(jsa.scalify(fn, policy=STATIC_POLICY))(x, x).jaxpr
    assert count(jaxpr, "sqrt") == 2  # the first sum, and the first sum in the scan body with the unknown w
    rng = np.random.default_rng(0)
    args = [jsa.as_scaled_array(jnp.asarray(rng.standard_normal((4, 4)), jnp.float32)) for _ in range(2)]
    got = jsa.scalify(fn, policy=STATIC_POLICY)(*args)
    assert_pow2_scales(got)
    np.testing.assert_allclose(np.asarray(got.to_array()), fn(*jsa.asarray(args)), rtol=1e-5, atol=1e-5)


def test_jit_body_bakes_constant_scales():
    """A ScaledArray with a constant scale passes only its data into a jitted call."""
    inner = jax.jit(lambda v: v * 2.0)

    def fn(data):  # the scale is a trace-time constant of the traced function
        return jsa.scalify(lambda v: inner(v), policy=STATIC_POLICY)(jsa.ScaledArray(data, np.float32(4.0)))

    jaxpr = jax.make_jaxpr(fn)(jnp.ones(3)).jaxpr
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "jit"]
    assert len(eqn.invars) == 1
    np.testing.assert_allclose(np.asarray(fn(jnp.ones(3)).to_array()), np.full(3, 8.0))
