"""Matmuls and convolutions under scalify: invariance, unit scaling, FP8 and float16 range."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_scalify as jsa
from tests.invariance import STATIC_POLICY, Case, assert_pow2_scales, integers, invariance_test, normal


def conv1d(x, w, stride=2):
    return lax.conv_general_dilated(x, w, (stride,), "SAME")  # NCH / OIH


def conv2d_nhwc(x, w, **kwargs):
    return lax.conv_general_dilated(x, w, dimension_numbers=("NHWC", "HWIO", "NHWC"), **kwargs)


def grouped_conv(x, w):
    return conv2d_nhwc(x, w, window_strides=(1, 1), padding="SAME", feature_group_count=2)


INVARIANCE_CASES = [
    Case("matmul", lambda x, w: x @ w, [normal(4, 8), normal(8, 3)], grad=True),
    Case("matmul_weight_grad", lambda w, x: x @ w, [normal(8, 3), normal(4, 8)], grad=True),
    Case("matvec", lambda x, v: x @ v, [normal(5, 6), normal(6)], grad=True),
    Case(
        "batched_matmul", lambda a, b: jnp.einsum("bij,bjk->bik", a, b), [normal(2, 3, 4), normal(2, 4, 5)], grad=True
    ),
    Case(
        "einsum_two_contractions",
        lambda a, b: jnp.einsum("abc,bcd->ad", a, b),
        [normal(3, 4, 2), normal(4, 2, 5)],
        grad=True,
    ),
    Case(
        "dot_general_transposed_dims",
        lambda a, b: lax.dot_general(a, b, (((0,), (1,)), ((2,), (0,)))),
        [normal(4, 3, 2), normal(2, 4, 5)],
        grad=True,
    ),
    Case(
        "int8_weights",
        lambda x, w: jnp.matmul(x, w, preferred_element_type=jnp.float32),
        [normal(4, 8), integers(8, 3, low=-3, high=4, dtype=np.int8)],
        grad=True,
    ),
    Case("conv1d_strided", conv1d, [normal(2, 3, 9), normal(4, 3, 3)], grad=True),
    Case("conv1d_kernel_grad", lambda w, x: conv1d(x, w), [normal(4, 3, 3), normal(2, 3, 9)], grad=True),
    Case(
        "conv2d_dilated",
        lambda x, w: conv2d_nhwc(x, w, window_strides=(1, 1), padding="SAME", rhs_dilation=(2, 1)),
        [normal(2, 6, 5, 3), normal(3, 2, 3, 4)],
        grad=True,
    ),
    Case(
        "conv2d_strided_valid",
        lambda x, w: conv2d_nhwc(x, w, window_strides=(2, 2), padding="VALID"),
        [normal(1, 7, 7, 2), normal(3, 3, 2, 4)],
        grad=True,
    ),
    Case("conv2d_grouped", grouped_conv, [normal(2, 5, 5, 4), normal(3, 3, 2, 6)], grad=True),
    Case(
        "conv2d_grouped_kernel_grad",
        lambda w, x: grouped_conv(x, w),
        [normal(3, 3, 2, 6), normal(2, 5, 5, 4)],
        grad=True,
    ),
    Case(
        "conv_lhs_dilated",
        lambda x, w: lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)), lhs_dilation=(2, 2)),
        [normal(1, 2, 4, 4), normal(3, 2, 3, 3)],
    ),
    Case(
        "conv_batch_group",
        lambda x, w: lax.conv_general_dilated(x, w, (1,), "VALID", batch_group_count=2),
        [normal(4, 3, 6), normal(4, 3, 2)],
    ),
]


test_invariance = invariance_test(INVARIANCE_CASES, max_examples=8)


def scaled(x, scale, dtype=jnp.float32):
    return jsa.ScaledArray(jnp.asarray(x, dtype), jnp.float32(scale))


def _dot_eqn(jaxpr):
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    return eqn


def test_matmul_unit_scaling():
    rng = np.random.default_rng(0)
    x = scaled(rng.standard_normal((32, 256)), 2.0**-5)
    w = scaled(rng.standard_normal((256, 64)), 2.0**9)
    out = jsa.scalify(lambda x, w: x @ w)(x, w)
    assert float(out.scale) == 2.0**-5 * 2.0**9 * 16
    rms = float(jnp.sqrt(jnp.mean(out.data**2)))
    assert 0.8 < rms < 1.25, rms
    np.testing.assert_allclose(out.to_array(), x.to_array() @ w.to_array(), rtol=1e-4, atol=1e-2)


def test_conv_unit_scaling_fan_in():
    rng = np.random.default_rng(0)
    x = scaled(rng.standard_normal((4, 8, 8, 16)), 1.0)
    w = scaled(rng.standard_normal((3, 3, 8, 32)), 1.0)  # two groups of 8 input features
    fn = lambda x, w: conv2d_nhwc(x, w, window_strides=(1, 1), padding="VALID", feature_group_count=2)
    out = jsa.scalify(fn)(x, w)
    assert float(out.scale) == 8.0  # fan-in 8 * 3 * 3 = 72, pow2 down of sqrt(72) = 8
    rms = float(jnp.sqrt(jnp.mean(out.data**2)))
    assert 0.7 < rms < 1.5, rms


@pytest.mark.parametrize("out_dtype, rhs_dtype", [(jnp.float32, jnp.float8_e4m3fn), (jnp.bfloat16, jnp.float8_e5m2)])
def test_fp8_operands_reach_dot_general_unchanged(out_dtype, rhs_dtype):
    rng = np.random.default_rng(0)
    a = scaled(rng.standard_normal((16, 64)), 2.0**-10, jnp.float8_e4m3fn)
    b = scaled(rng.standard_normal((64, 8)), 2.0**12, rhs_dtype)

    def f(a, b):
        return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=out_dtype)

    jaxpr = jax.make_jaxpr(jsa.scalify(f, policy=STATIC_POLICY))(a, b).jaxpr
    eqn = _dot_eqn(jaxpr)
    assert [v.aval.dtype for v in eqn.invars] == [jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(rhs_dtype)]
    assert eqn.invars[0] in jaxpr.invars and eqn.invars[1] in jaxpr.invars  # no rescale before the GEMM
    assert eqn.params["preferred_element_type"] == out_dtype
    out = jsa.scalify(f, policy=STATIC_POLICY)(a, b)
    assert out.dtype == out_dtype and float(out.scale) == 2.0**-10 * 2.0**12 * 8
    value = lambda x: x.to_array()  # float32 values
    expected = value(a) @ value(b)
    np.testing.assert_allclose(value(out), expected, rtol=2e-2, atol=0.1)


def test_float16_operands_float32_result():
    rng = np.random.default_rng(0)
    a = scaled(rng.standard_normal((8, 32)), 2.0**-40, jnp.float16)
    b = scaled(rng.standard_normal((32, 4)), 2.0**-40, jnp.float16)
    f = lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32)
    out = jsa.scalify(f)(a, b)
    assert out.dtype == jnp.float32 and float(out.scale) == 2.0**-80 * 4
    expected = np.asarray(a.data, np.float64) @ np.asarray(b.data, np.float64) * 2.0**-80
    np.testing.assert_allclose(np.asarray(out.to_array(), np.float64), expected, rtol=1e-5, atol=1e-6 * 2.0**-80 * 8)


@pytest.mark.parametrize(
    "fn, shapes",
    [
        (lambda a, b: a @ b, [(8, 48), (48, 4)]),
        (conv1d, [(2, 4, 12), (5, 4, 3)]),
        (lambda x, w: conv2d_nhwc(x, w, window_strides=(1, 1), padding="SAME"), [(1, 5, 5, 4), (3, 3, 4, 2)]),
    ],
)
def test_float16_range(fn, shapes):
    """Scales 2^-40: the values underflow float16, the scaled result is right."""
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    args = [scaled(x, 2.0**-40, jnp.float16) for x in xs]
    out = jsa.scalify(fn)(*args)
    assert out.dtype == jnp.float16
    assert_pow2_scales(out)
    plain = fn(*[a.to_array(jnp.float16) for a in args])
    assert not np.any(np.asarray(plain))  # plain float16 underflows to zero
    expected = np.asarray(fn(*[jnp.asarray(a.data, jnp.float32) for a in args]), np.float64) * 2.0**-80
    got = np.asarray(out.to_array(jnp.float32), np.float64)
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2 * 2.0**-80)


def test_float16_large_contraction_does_not_overflow():
    # K = 16384 products of 4: the sum 65536 overflows float16; data / r = 512 does not.
    a = scaled(np.full((1, 16384), 2.0), 2.0**30, jnp.float16)
    b = scaled(np.full((16384, 1), 2.0), 2.0**30, jnp.float16)
    out = jsa.scalify(lambda a, b: a @ b, policy=STATIC_POLICY)(a, b)
    assert out.dtype == jnp.float16 and float(out.scale) == 2.0**67
    assert float(out.to_array(jnp.float32)[0, 0]) == 2.0**76


def test_guarded_matmul_of_zero_data_at_the_largest_scale_stays_zero():
    """``sa * sb * r`` past float32 with ``guard_traced_scales``: the excess moves into the data
    (a finite factor), so zero data stay zero. Multiplying ``sa * r`` first overflowed to inf
    and the excess ``inf * 0`` gave NaN (an all-zero cotangent through a deep network)."""
    a = jsa.ScaledArray(jnp.zeros((4, 64)), jnp.float32(2.0**127))
    b = jsa.ScaledArray(jnp.ones((64, 4)), jnp.float32(2.0**4))
    with jsa.ScalifyConfig(guard_traced_scales=True):
        out = jax.jit(jsa.scalify(lambda a, b: a @ b, policy=STATIC_POLICY))(a, b)
    assert float(out.scale) == 2.0**127
    assert np.all(np.asarray(out.data) == 0)


@pytest.mark.parametrize("lhs_shape, rhs_shape", [((64, 256), (256, 4)), ((2, 256), (256, 512))])
@pytest.mark.parametrize("dtype", [jnp.float16])
def test_one_over_r_goes_on_the_float32_accumulator_of_a_float16_result(lhs_shape, rhs_shape, dtype):
    """The operands (weights the backward pass reads again) reach the contraction as they are."""
    a, b = scaled(np.ones(lhs_shape), 1.0, dtype), scaled(np.ones(rhs_shape), 1.0, dtype)
    fn = jsa.scalify(lambda a, b: a @ b, policy=STATIC_POLICY)
    jaxpr = jax.make_jaxpr(fn)(a, b).jaxpr
    eqn = _dot_eqn(jaxpr)
    assert all(v in jaxpr.invars for v in eqn.invars)
    assert eqn.outvars[0].aval.dtype == jnp.float32
    out = fn(a, b)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out.to_array(jnp.float32), np.full((lhs_shape[0], rhs_shape[1]), 256.0))


@pytest.mark.parametrize(
    "lhs_shape, rhs_shape, rescaled",
    [
        ((64, 256), (256, 4), "out"),  # output (256 elements) is smallest
        ((2, 256), (256, 512), "lhs"),  # lhs (512) smaller than output (1024)
        ((4, 4), (4, 4), "out"),  # tie: the output
    ],
)
def test_one_over_r_goes_where_it_costs_least_for_a_float32_result(lhs_shape, rhs_shape, rescaled):
    a, b = scaled(np.ones(lhs_shape), 1.0), scaled(np.ones(rhs_shape), 1.0)
    jaxpr = jax.make_jaxpr(jsa.scalify(lambda a, b: a @ b, policy=STATIC_POLICY))(a, b).jaxpr
    eqn = _dot_eqn(jaxpr)
    lhs_direct, rhs_direct = (v in jaxpr.invars for v in eqn.invars)
    out_direct = eqn.outvars[0] in jaxpr.outvars
    assert (not lhs_direct, not rhs_direct, not out_direct) == (rescaled == "lhs", rescaled == "rhs", rescaled == "out")


def test_conv_pool_matmul_grad_under_jit():
    """Traced scales (jit outside scalify) through a small CNN loss and its gradient."""
    rng = np.random.default_rng(3)
    x, k, w = rng.standard_normal((2, 6, 6, 2)), rng.standard_normal((3, 3, 2, 4)), rng.standard_normal((36, 3))

    def loss(k, w, x):
        h = conv2d_nhwc(x, k, window_strides=(1, 1), padding="SAME")
        h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        y = h.reshape(2, 36) @ w
        return jnp.mean(y * y) + jnp.prod(jnp.max(y, axis=0))

    grad_fn = jax.value_and_grad(loss, argnums=(0, 1))
    args = [scaled(k, 2.0**-9), scaled(w, 2.0**5), scaled(x, 2.0**-3)]
    got = jax.jit(jsa.scalify(grad_fn))(*args)
    expected = grad_fn(*[a.to_array() for a in args])
    assert_pow2_scales(got)
    for g, e in zip(jax.tree.leaves(jsa.asarray(got)), jax.tree.leaves(expected)):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(e))))
