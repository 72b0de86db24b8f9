"""jsa.nn activations: the jax.nn function outside scalify, their scale rules under it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa
from jax_scalify import nn
from tests.invariance import STATIC_POLICY, Case, assert_close_values, assert_pow2_scales, invariance_test, normal

E4M3 = jnp.float8_e4m3fn

INVARIANCE_CASES = [
    Case("nn_relu", nn.relu, [normal(4, 6)], grad=True),
    Case("nn_gelu_tanh", nn.gelu, [normal(4, 6)], grad=True),
    Case("nn_gelu_erf", lambda x: nn.gelu(x, approximate=False), [normal(4, 6)], grad=True),
    Case("nn_silu", nn.silu, [normal(4, 6)], grad=True),
    # Weighted so that the gradient of the sum is not identically zero.
    Case("nn_softmax", lambda x, w: nn.softmax(x) * w, [normal(4, 6), normal(4, 6)], grad=True),
    Case("nn_softmax_axes", lambda x, w: nn.softmax(x, axis=(0, 2)) * w, [normal(2, 3, 4), normal(2, 3, 4)], grad=True),
    Case("nn_log_softmax", lambda x: nn.log_softmax(x, axis=0), [normal(4, 6)], grad=True),
    Case("nn_logsumexp", nn.logsumexp, [normal(4, 6)], grad=True),
    Case("nn_logsumexp_keepdims", lambda x: nn.logsumexp(x, axis=1, keepdims=True), [normal(4, 6)], grad=True),
]

PAIRS = {
    "relu": (nn.relu, jax.nn.relu),
    "gelu": (nn.gelu, jax.nn.gelu),
    "gelu_erf": (lambda x: nn.gelu(x, approximate=False), lambda x: jax.nn.gelu(x, approximate=False)),
    "silu": (nn.silu, jax.nn.silu),
    "softmax": (nn.softmax, jax.nn.softmax),
    "softmax_axis0": (lambda x: nn.softmax(x, axis=0), lambda x: jax.nn.softmax(x, axis=0)),
    "log_softmax": (nn.log_softmax, jax.nn.log_softmax),
    "logsumexp": (nn.logsumexp, jax.nn.logsumexp),
    "logsumexp_axis": (lambda x: nn.logsumexp(x, -1, True), lambda x: jax.nn.logsumexp(x, -1, keepdims=True)),
}

X = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32) * 2
W = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)


def scaled(x, exponent, dtype=np.float32):
    return jsa.ScaledArray(jnp.asarray(x / 2.0**exponent, dtype), jnp.float32(2.0**exponent))


test_invariance = invariance_test(INVARIANCE_CASES, max_examples=2)


# --- outside scalify: the jax.nn function ------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_equals_jax_nn_outside_scalify(name):
    ours, ref = PAIRS[name]
    np.testing.assert_allclose(ours(X), ref(X), rtol=1e-6, atol=1e-7)
    weights = np.random.default_rng(3).standard_normal(np.shape(ref(X))).astype(np.float32)
    grad = jax.grad(lambda x: jnp.sum(ours(x) * weights))(X)
    expected = jax.grad(lambda x: jnp.sum(ref(x) * weights))(X)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-6 * np.max(np.abs(expected)))


def test_vmap_outside_scalify():
    np.testing.assert_allclose(jax.vmap(nn.gelu)(X), jax.nn.gelu(X), rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(nn.softmax, in_axes=1, out_axes=1)(X), jax.nn.softmax(X, axis=0), rtol=1e-6)


def test_functions_are_custom_scale_calls():
    for name in ["relu", "silu", "gelu", "softmax", "log_softmax", "logsumexp"]:
        jaxpr = jax.make_jaxpr(getattr(nn, name))(X)
        names = [(e.primitive.name, e.params.get("name")) for e in jaxpr.eqns]
        assert ("custom_scale_call", name) in names, names


# --- under scalify: the scale rules ------------------------------------------------------------
@pytest.mark.parametrize("name", ["relu", "gelu", "gelu_erf", "silu"])
@pytest.mark.parametrize("exponent", [-12, 0, 7])
def test_near_identity_maps_keep_the_input_scale(name, exponent):
    ours, ref = PAIRS[name]
    out = jsa.scalify(ours, policy=STATIC_POLICY)(scaled(X, exponent))
    assert float(out.scale) == 2.0**exponent
    np.testing.assert_allclose(out.to_array(), ref(X), rtol=1e-6, atol=1e-6 * 2.0**exponent)


def test_relu_rule_is_exact():
    out = jsa.scalify(nn.relu, policy=STATIC_POLICY)(scaled(X, -3, np.float16))
    np.testing.assert_array_equal(out.data, jnp.maximum(jnp.asarray(X * 8, np.float16), 0))


@pytest.mark.parametrize("axis, n", [(-1, 6), (0, 4), ((0, 1), 24), (None, 24)])
def test_softmax_output_scale_is_one_over_n(axis, n):
    out = jsa.scalify(lambda x: nn.softmax(x, axis), policy=STATIC_POLICY)(scaled(X, 5))
    k = 2 ** int(np.floor(np.log2(n)))
    assert float(out.scale) == 1.0 / k
    np.testing.assert_allclose(out.to_array(), jax.nn.softmax(X, axis), rtol=1e-6, atol=1e-7)
    # Unit scale: the data average to k/n in (1/2, 1] along the axis, and never exceed k.
    mean = np.mean(np.asarray(out.data), axis=axis)
    np.testing.assert_allclose(mean, k / n, rtol=1e-5)
    assert np.max(out.data) <= k


def test_softmax_scale_capped_by_the_data_dtype():
    x = np.random.default_rng(2).standard_normal((2, 1024)).astype(np.float32)
    out = jsa.scalify(nn.softmax, policy=STATIC_POLICY)(scaled(x, 0, E4M3))
    assert out.dtype == E4M3 and float(out.scale) == 1 / 256  # 256: E4M3's largest power of two
    assert np.all(np.isfinite(np.asarray(out.data, np.float32)))
    out16 = jsa.scalify(nn.softmax, policy=STATIC_POLICY)(scaled(x, 0, np.float16))
    assert float(out16.scale) == 1 / 1024


@pytest.mark.parametrize("exponent, out_exponent", [(-6, 0), (0, 0), (9, 9)])
def test_log_softmax_and_logsumexp_scale_is_max_of_input_scale_and_one(exponent, out_exponent):
    x = scaled(X, exponent)
    value = X
    for fn, ref in [(nn.log_softmax, jax.nn.log_softmax), (nn.logsumexp, jax.nn.logsumexp)]:
        out = jsa.scalify(fn, policy=STATIC_POLICY)(x)
        assert float(out.scale) == 2.0**out_exponent
        np.testing.assert_allclose(out.to_array(), ref(value), rtol=1e-6, atol=1e-6)


REFERENCES_F64 = {
    "gelu": lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3))),
    "silu": lambda v: v / (1 + np.exp(-v)),
    "softmax": lambda v: (
        np.exp(v - v.max(-1, keepdims=True)) / np.exp(v - v.max(-1, keepdims=True)).sum(-1, keepdims=True)
    ),
    "log_softmax": lambda v: (
        v - v.max(-1, keepdims=True) - np.log(np.exp(v - v.max(-1, keepdims=True)).sum(-1, keepdims=True))
    ),
    "logsumexp": lambda v: v.max() + np.log(np.exp(v - v.max()).sum()),
}


@pytest.mark.parametrize("name", sorted(REFERENCES_F64))
@pytest.mark.parametrize("exponent", [-60, 60])
def test_float16_far_outside_its_range(name, exponent):
    """Values 2**±60 (plain float16: 0 or inf) come out right to float16 precision."""
    x = scaled(X * 2.0**exponent, exponent, np.float16)
    value = np.asarray(x.data, np.float64) * 2.0**exponent
    out = jsa.scalify(PAIRS[name][0])(x)
    assert out.dtype == np.float16
    assert_pow2_scales(out)
    got = np.asarray(out.data, np.float64) * np.float64(out.scale)
    with np.errstate(over="ignore", under="ignore"):
        expected = REFERENCES_F64[name](value)
    np.testing.assert_allclose(got, expected, rtol=2e-3, atol=2e-3 * np.max(np.abs(expected)))


def test_vmap_and_jit_inside_scalify():
    fn = jax.jit(jax.vmap(lambda x: nn.softmax(nn.gelu(x))))
    out = jsa.scalify(fn)(scaled(X, 3))
    assert_pow2_scales(out)
    np.testing.assert_allclose(out.to_array(), jax.nn.softmax(jax.nn.gelu(X)), rtol=1e-6, atol=1e-7)


def test_grad_inside_scalify_in_float16():
    fn = jax.value_and_grad(lambda x: jnp.sum((nn.log_softmax(nn.silu(x)) * W).astype(jnp.float32)))
    value, grad = jsa.scalify(fn)(scaled(X * 2.0**-20, -20, np.float16))
    expected_value, expected_grad = fn(jnp.asarray(X * 2.0**-20))
    assert_close_values(value, expected_value, rtol=2e-3, atol=1e-3)
    np.testing.assert_allclose(
        grad.to_array(np.float32), expected_grad, rtol=5e-3, atol=5e-3 * np.max(np.abs(expected_grad))
    )


# --- errors ----------------------------------------------------------------------------------
def test_bad_axis_raises():
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        nn.softmax(X, axis=2)
    with pytest.raises(ValueError, match="repeats"):
        nn.logsumexp(X, axis=(1, -1))


def test_non_scalar_scale_raises_with_advice():
    x = jsa.ScaledArray(jnp.asarray(X), jnp.ones((1, 6), jnp.float32))
    with pytest.raises(ValueError, match="need a scalar scale"):  # rejected where scalify receives it
        jsa.scalify(nn.gelu)(x)
