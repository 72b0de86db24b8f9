"""Reductions, cumulative ops and windowed reductions under scalify."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_scalify as jsa
from tests.invariance import STATIC_POLICY, Case, assert_pow2_scales, invariance_test, normal, positive


def max_pool(x, window=(1, 2, 2, 1), strides=(1, 2, 2, 1), padding="VALID"):
    return lax.reduce_window(x, -jnp.inf, lax.max, window, strides, padding)


def min_pool(x):
    return lax.reduce_window(x, jnp.inf, lax.min, (1, 2, 2, 1), (1, 1, 1, 1), "SAME")


def avg_pool(x):
    return lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4.0


def relu_pool(x):
    """Init 0 is not max's identity: JAX emits the generic reduce_window."""
    return lax.reduce_window(x, 0.0, lax.max, (1, 2, 2, 1), (1, 1, 1, 1), "SAME")


IMG = (2, 6, 6, 3)

INVARIANCE_CASES = [
    # full reductions
    Case("sum_axis", lambda x, y: jnp.sum(x * y, axis=1), [normal(4, 6), normal(4, 6)], grad=True),
    Case("sum_all", jnp.sum, [normal(3, 5, 2)]),
    Case("lax_reduce_sum", lambda x: lax.reduce_sum(x, (0, 2)), [normal(3, 4, 5)]),
    Case("mean", lambda x, y: jnp.mean(x, axis=0) * y, [normal(8, 3), normal(3)], grad=True),
    Case("max", lambda x: jnp.max(x, axis=1), [normal(4, 7)], grad=True),
    Case("min", lambda x: jnp.min(x, axis=(0, 2)), [normal(3, 4, 2)], grad=True),
    Case("argmax", lambda x: jnp.argmax(x, axis=1), [normal(5, 7)]),
    Case("argmin", lambda x: jnp.argmin(x, axis=0), [normal(5, 7)]),
    Case("prod", lambda x: jnp.prod(x, axis=1), [positive(3, 4)]),  # its grad uses no reduce_prod
    # cumulative ops
    Case("cumsum", lambda x: x * jnp.cumsum(x, axis=1), [normal(3, 6)], grad=True),
    Case("cumsum_reverse", lambda x: lax.cumsum(x, axis=0, reverse=True), [normal(5, 2)]),
    Case("cumprod", lambda x: jnp.cumprod(x, axis=0), [positive(4, 3, low=0.5, high=2.0)]),
    Case("cummax", lambda x: lax.cummax(x, axis=1), [normal(3, 6)]),
    Case("cummin", lambda x: lax.cummin(x, axis=0, reverse=True), [normal(5, 3)]),
    Case("cumlogsumexp", lambda x: lax.cumlogsumexp(x, axis=1), [normal(3, 6)]),
    # windows and their gradients
    Case("max_pool", lambda x, y: max_pool(x) * y, [normal(*IMG), normal(2, 3, 3, 3)], grad=True),
    Case(
        "max_pool_overlapping",
        lambda x, y: max_pool(x, (1, 3, 3, 1), (1, 2, 2, 1), "SAME") * y,
        [normal(*IMG), normal(2, 3, 3, 3)],
        grad=True,
    ),
    Case("min_pool", lambda x, y: min_pool(x) * y, [normal(*IMG), normal(*IMG)], grad=True),
    Case("avg_pool", lambda x, y: avg_pool(x) * y, [normal(*IMG), normal(2, 3, 3, 3)], grad=True),
    Case(
        "sum_pool_1d_dilated",
        lambda x: lax.reduce_window(x, 0.0, lax.add, (3,), (1,), "SAME", None, (2,)),
        [normal(9)],
    ),
    Case("relu_pool", relu_pool, [normal(*IMG)]),
    Case("generic_window_add", lambda x: lax.reduce_window(x, 1.0, lax.add, (2,), (2,), "VALID"), [normal(8)]),
    Case("generic_window_mul", lambda x: lax.reduce_window(x, 1.0, lax.mul, (2,), (1,), "VALID"), [normal(8)]),
    Case("max_pool_jvp", lambda x, t: jax.jvp(max_pool, (x,), (t,))[1], [normal(*IMG), normal(*IMG)]),
]


test_invariance = invariance_test(INVARIANCE_CASES, max_examples=8)


def scaled(x, scale, dtype=jnp.float32):
    return jsa.ScaledArray(jnp.asarray(x, dtype), jnp.float32(scale))


def test_reduce_sum_unit_scaling():
    x = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
    out = jsa.scalify(lambda x: jnp.sum(x, axis=1))(scaled(x, 2.0**-3))
    assert float(out.scale) == 2.0**-3 * 16
    assert 0.4 < float(jnp.sqrt(jnp.mean(out.data**2))) < 2.5
    np.testing.assert_allclose(out.to_array(), x.sum(1) * 2.0**-3, rtol=1e-5, atol=1e-5)


def test_rounding_mode_up_gives_larger_factor():
    x = scaled(np.ones((8,)), 1.0)
    assert float(jsa.scalify(jnp.sum, policy=STATIC_POLICY)(x).scale) == 2.0  # pow2 down of sqrt(8)
    with jsa.ScalifyConfig(rounding_mode=jsa.Pow2RoundMode.UP):
        out = jsa.scalify(jnp.sum, policy=STATIC_POLICY)(x)
    assert float(out.scale) == 4.0 and float(out.to_array()) == 8.0


def test_float16_sum_does_not_overflow():
    # 65536 terms of 1: the sum (65536) overflows float16, the unit-scaled data (256) does not.
    x = scaled(np.ones((65536,)), 2.0**40, jnp.float16)
    out = jsa.scalify(lambda x: lax.reduce_sum(x, (0,)), policy=STATIC_POLICY)(x)
    assert out.dtype == jnp.float16 and float(out.scale) == 2.0**48
    assert float(out.to_array(jnp.float32)) == 2.0**56


def test_float16_tiny_scales_cumsum_and_pools():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4, 4, 1)).astype(np.float32)
    xs = scaled(x, 2.0**-40, jnp.float16)
    value = x.astype(np.float16).astype(np.float64) * 2.0**-40
    for fn, ref in [
        (lambda x: jnp.cumsum(x, axis=1), np.cumsum(value, axis=1)),
        (max_pool, value.reshape(2, 2, 2, 2, 2, 1).max(axis=(2, 4))),
        (
            lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
            value.reshape(2, 2, 2, 2, 2, 1).sum(axis=(2, 4)),
        ),
    ]:
        out = jsa.scalify(fn)(xs)
        assert out.dtype == jnp.float16
        assert_pow2_scales(out)
        assert not np.any(np.asarray(fn(jnp.asarray(value, jnp.float16))))  # plain float16 flushes to 0
        got = np.asarray(out.to_array(jnp.float32), np.float64)
        np.testing.assert_allclose(got, ref, rtol=2e-3, atol=1e-3 * 2.0**-40)


def test_reduce_prod_exact_scale():
    x = scaled(np.array([[1.5, 2.0, -1.25]]), 2.0**-30, jnp.float16)
    out = jsa.scalify(lambda x: jnp.prod(x, axis=1), policy=STATIC_POLICY)(x)
    assert float(out.scale) == 2.0**-90 and out.dtype == jnp.float16
    assert float(out.data[0]) == -3.75


def test_argmax_ignores_scale():
    x = scaled(np.array([1.0, 3.0, -2.0]), 2.0**-50)
    out = jsa.scalify(jnp.argmax)(x)
    assert not isinstance(out, jsa.ScaledArray) and int(out) == 1


def test_max_keeps_scale():
    out = jsa.scalify(lambda x: jnp.max(x, axis=0), policy=STATIC_POLICY)(scaled(np.arange(6.0).reshape(3, 2), 2.0**7))
    assert float(out.scale) == 2.0**7
    np.testing.assert_array_equal(out.data, [4.0, 5.0])


def test_select_and_scatter_add_overlap_factor():
    # 3x3 windows with stride 2 overlap: a position can receive up to 2*2 = 4 cotangents (r = 2).
    x = scaled(np.random.default_rng(0).standard_normal((1, 6, 6, 1)), 1.0)
    ct = scaled(np.ones((1, 3, 3, 1)), 2.0**5)
    fn = lambda x, ct: jax.vjp(lambda x: max_pool(x, (1, 3, 3, 1), (1, 2, 2, 1), "SAME"), x)[1](ct)[0]
    out = jsa.scalify(fn, policy=STATIC_POLICY)(x, ct)
    assert float(out.scale) == 2.0**6
    np.testing.assert_array_equal(out.to_array(), fn(x.to_array(), ct.to_array()))


def test_generic_reduce_window_max_keeps_scale():
    x = scaled(np.array([-1.0, 2.0, -3.0, 4.0]), 2.0**-20)
    out = jsa.scalify(lambda x: lax.reduce_window(x, 0.0, lax.max, (2,), (1,), "VALID"), policy=STATIC_POLICY)(x)
    assert float(out.scale) == 2.0**-20  # the init value 0 takes the operand's scale
    np.testing.assert_array_equal(out.data, [2.0, 2.0, 4.0])
