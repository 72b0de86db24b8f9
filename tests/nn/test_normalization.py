"""jsa.nn normalisation: plain LayerNorm/RMSNorm outside scalify, unit-RMS data under it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa
from jax_scalify import nn
from tests.invariance import STATIC_POLICY, Case, assert_pow2_scales, invariance_test, normal

INVARIANCE_CASES = [
    # Weighted so that the gradient of the sum is not identically zero.
    Case("nn_layer_norm", lambda x, w: nn.layer_norm(x) * w, [normal(4, 6), normal(4, 6)], grad=True),
    Case("nn_layer_norm_affine", nn.layer_norm, [normal(4, 6), normal(6), normal(6)], grad=True),
    Case(
        "nn_layer_norm_axes",
        lambda x, g: nn.layer_norm(x, g, axis=(0, 2)),
        [normal(2, 3, 4), normal(2, 1, 4)],
        grad=True,
    ),
    Case("nn_rms_norm", nn.rms_norm, [normal(4, 6), normal(6)], grad=True),
    Case("nn_layer_norm_grad_rescale", nn.layer_norm_grad_rescale, [normal(4, 6), normal(6), normal(6)], grad=True),
]

RNG = np.random.default_rng(0)
X = (RNG.standard_normal((4, 6)) * 3 + 1).astype(np.float32)
GAIN = (1 + 0.1 * RNG.standard_normal(6)).astype(np.float32)
BIAS = (0.1 * RNG.standard_normal(6)).astype(np.float32)


def scaled(x, exponent, dtype=np.float32):
    return jsa.ScaledArray(jnp.asarray(x / 2.0**exponent, dtype), jnp.float32(2.0**exponent))


def row_rms(data):
    return np.sqrt(np.mean(np.square(np.asarray(data, np.float64)), axis=-1))


test_invariance = invariance_test(INVARIANCE_CASES, max_examples=2)


# --- outside scalify ------------------------------------------------------------------------
def test_layer_norm_equals_jax_nn_standardize():
    expected = jax.nn.standardize(X, algorithm="stable") * GAIN + BIAS
    np.testing.assert_allclose(nn.layer_norm(X, GAIN, BIAS), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        jax.jit(nn.layer_norm)(X), jax.nn.standardize(X, algorithm="stable"), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        nn.layer_norm(X, axis=0, eps=1e-3),
        jax.nn.standardize(X, axis=0, epsilon=1e-3, algorithm="stable"),
        rtol=1e-5,
        atol=1e-6,
    )
    weights = RNG.standard_normal(X.shape).astype(np.float32)
    grad = jax.grad(lambda x: jnp.sum(nn.layer_norm(x, GAIN, BIAS) * weights))(X)
    expected_grad = jax.grad(lambda x: jnp.sum((jax.nn.standardize(x, algorithm="stable") * GAIN + BIAS) * weights))(X)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-4, atol=1e-5)


def test_rms_norm_equals_jax_nn_standardize_with_zero_mean():
    expected = jax.nn.standardize(X, mean=0, epsilon=1e-6) * GAIN
    np.testing.assert_allclose(nn.rms_norm(X, GAIN), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.vmap(nn.rms_norm)(X), jax.nn.standardize(X, mean=0, epsilon=1e-6), rtol=1e-5)


def test_layer_norm_grad_rescale_is_layer_norm_with_the_same_gradient():
    np.testing.assert_array_equal(nn.layer_norm_grad_rescale(X, GAIN, BIAS), nn.layer_norm(X, GAIN, BIAS))
    grad = jax.grad(lambda x: jnp.sum(nn.layer_norm_grad_rescale(x, GAIN) ** 2))(X)
    np.testing.assert_allclose(grad, jax.grad(lambda x: jnp.sum(nn.layer_norm(x, GAIN) ** 2))(X), rtol=1e-6)


def test_float16_statistics_in_float32_outside_scalify():
    x16 = jnp.asarray(X * 300, np.float16)  # squares overflow float16
    out = nn.layer_norm(x16)
    assert out.dtype == np.float16 and np.all(np.isfinite(np.asarray(out, np.float32)))
    expected = jax.nn.standardize(np.asarray(x16, np.float32), algorithm="stable")
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=2e-3, atol=2e-3)


# --- under scalify: unit-RMS data --------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("exponent", [-30, -8, 0, 8, 30])
def test_normalised_data_have_unit_rms_and_scale_one(dtype, exponent):
    value = X * 2.0**exponent
    for fn, ref in [
        (nn.layer_norm, lambda v: (v - v.mean(-1, keepdims=True)) / np.sqrt(v.var(-1, keepdims=True) + 1e-5)),
        (nn.rms_norm, lambda v: v / np.sqrt(np.mean(v**2, -1, keepdims=True) + 1e-6)),
    ]:
        out = jsa.scalify(fn, policy=STATIC_POLICY)(scaled(value, exponent, dtype))
        assert out.dtype == dtype
        expected = ref(np.asarray(scaled(value, exponent, dtype).data, np.float64) * 2.0**exponent)
        rms = row_rms(out.data)
        # Unit-RMS data in every case: the largest row RMS is in (1/2, 1], none is above 1.
        assert 0.5 < np.max(rms) <= 1.0 + 2e-3, rms
        if exponent >= 0:  # eps negligible: scale 1, RMS 1
            assert float(out.scale) == 1.0
            np.testing.assert_allclose(rms, 1.0, rtol=2e-3)
        elif exponent == -8:  # eps matters (values ~1e-2), output RMS ~0.93: still scale 1
            assert float(out.scale) == 1.0
        else:  # eps dominates: the output's RMS (< 1) moves into the scale
            assert float(out.scale) < 2.0**-8
        got = np.asarray(out.data, np.float64) * np.float64(out.scale)
        tol = 1e-5 if dtype == np.float32 else 2e-3
        np.testing.assert_allclose(got, expected, rtol=tol, atol=tol * np.max(np.abs(expected)))


def test_eps_is_divided_by_the_scale_squared():
    # Values ~2**-10 * 3: var ~ 1e-5, comparable to eps, so eps matters to the result.
    value = X * 2.0**-10
    out = jsa.scalify(lambda x: nn.layer_norm(x, eps=1e-5))(scaled(value, -10))
    np.testing.assert_allclose(out.to_array(), nn.layer_norm(value, eps=1e-5), rtol=1e-5, atol=1e-6)
    assert not np.allclose(nn.layer_norm(value, eps=1e-5), nn.layer_norm(value, eps=0.0), rtol=1e-3)


def test_gain_and_bias_scaled_or_plain():
    x = scaled(X, 4)
    gain, bias = jsa.as_scaled_array(GAIN * 2.0**-9), jsa.as_scaled_array(BIAS * 2.0**-9)
    out = jsa.scalify(nn.layer_norm)(x, gain, bias)
    assert_pow2_scales(out)
    np.testing.assert_allclose(out.to_array(), nn.layer_norm(X, GAIN, BIAS) * 2.0**-9, rtol=1e-5, atol=1e-8)
    assert float(out.scale) <= 2.0**-8  # the gain's scale carries through
    out_plain = jsa.scalify(nn.rms_norm)(x, GAIN)
    np.testing.assert_allclose(out_plain.to_array(), nn.rms_norm(X, GAIN), rtol=1e-5, atol=1e-6)


def test_layer_norm_grad_rescale_rescales_the_input_gradient():
    x = scaled(X * 2.0**-12, -12, np.float16)

    def grad_of(layer):
        return jsa.scalify(jax.grad(lambda a: jnp.sum((layer(a, GAIN) * X).astype(jnp.float32))), policy=STATIC_POLICY)(
            x
        )

    plain, rescaled = grad_of(nn.layer_norm), grad_of(nn.layer_norm_grad_rescale)
    expected = plain.to_array(np.float32)
    np.testing.assert_allclose(rescaled.to_array(np.float32), expected, rtol=2e-3, atol=1e-3 * np.max(np.abs(expected)))
    # The rescaled gradient's data has an RMS in [1, 2) (dynamic_rescale_l2, rounded down).
    assert 1.0 <= float(row_rms(np.ravel(rescaled.data))) < 2.0
    assert not 1.0 <= float(row_rms(np.ravel(plain.data))) < 2.0


def test_vmap_inside_scalify():
    out = jsa.scalify(jax.vmap(lambda x: nn.layer_norm(x, GAIN, BIAS)))(scaled(X, -3))
    assert_pow2_scales(out)
    np.testing.assert_allclose(out.to_array(), nn.layer_norm(X, GAIN, BIAS), rtol=1e-5, atol=1e-6)


def test_bad_eps_raises():
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        nn.layer_norm(X, eps=-1.0)
    with pytest.raises(ValueError, match="eps"):
        nn.rms_norm(X, eps=float("nan"))
