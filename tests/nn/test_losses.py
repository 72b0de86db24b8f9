"""jsa.nn.cross_entropy: optax's integer-label cross-entropy outside scalify, exact loss split under it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scalify as jsa
from jax_scalify import nn
from tests.invariance import Case, integers, invariance_test, normal

INVARIANCE_CASES = [
    Case("nn_cross_entropy", nn.cross_entropy, [normal(4, 6), integers(4, high=6)], grad=True),
    Case("nn_cross_entropy_3d", nn.cross_entropy, [normal(2, 3, 4), integers(2, 3, high=4)], grad=True),
]

RNG = np.random.default_rng(0)
LOGITS = (RNG.standard_normal((4, 6)) * 3).astype(np.float32)
LABELS = RNG.integers(0, 6, 4).astype(np.int32)


def reference(logits, labels):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


test_invariance = invariance_test(INVARIANCE_CASES, max_examples=2)


def test_equals_optax_outside_scalify():
    np.testing.assert_allclose(nn.cross_entropy(LOGITS, LABELS), reference(LOGITS, LABELS), rtol=1e-6)
    grad = jax.grad(nn.cross_entropy)(LOGITS, LABELS)
    np.testing.assert_allclose(grad, jax.grad(reference)(LOGITS, LABELS), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("exponent", [-40, 0, 40])
def test_loss_is_split_exactly_into_mantissa_and_power_of_two(exponent):
    logits = jsa.ScaledArray(jnp.asarray(LOGITS, np.float16), jnp.float32(2.0**exponent))
    out = jsa.scalify(nn.cross_entropy)(logits, LABELS)
    assert out.dtype == np.float16
    assert 1.0 <= float(out.data) < 2.0
    value = np.asarray(LOGITS, np.float16).astype(np.float64) * 2.0**exponent
    shifted = value - value.max(-1, keepdims=True)
    lse = np.log(np.exp(shifted).sum(-1))
    expected = np.mean(lse - shifted[np.arange(4), LABELS])
    np.testing.assert_allclose(float(out.data) * float(out.scale), expected, rtol=2e-3)


def test_grad_inside_scalify_in_float16():
    logits = jsa.ScaledArray(jnp.asarray(LOGITS * 2**10, np.float16), jnp.float32(2.0**-10))
    loss, grad = jsa.scalify(jax.value_and_grad(nn.cross_entropy))(logits, LABELS)
    expected_loss, expected_grad = jax.value_and_grad(reference)(jnp.asarray(LOGITS), LABELS)
    np.testing.assert_allclose(loss.to_array(np.float32), expected_loss, rtol=2e-3)
    np.testing.assert_allclose(
        grad.to_array(np.float32), expected_grad, rtol=1e-2, atol=2e-3 * np.max(np.abs(expected_grad))
    )


def test_bad_labels_raise():
    with pytest.raises(TypeError, match="integer labels of shape logits.shape"):
        nn.cross_entropy(LOGITS, LABELS.astype(np.float32))
    with pytest.raises(TypeError, match="integer labels"):
        nn.cross_entropy(LOGITS, LABELS[:, None])
