"""Whole programs under scalify: invariance in float32, range robustness in float16."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings

import jax_scalify as jsa
from tests.invariance import assert_close_values, assert_pow2_scales, examples

SIZES = (12, 16, 16, 5)


def init_mlp(rng, sizes=SIZES, bias=0.1):
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        w = rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)
        b = bias * rng.standard_normal(fan_out)
        params.append({"w": w.astype(np.float32), "b": b.astype(np.float32)})
    return params


def mlp(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(_dense(layer, x))
    return _dense(params[-1], x)


def _dense(layer, x):
    return x @ layer["w"] + layer["b"] if "b" in layer else x @ layer["w"]


def cross_entropy(params, x, labels):
    logits = mlp(params, x)
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * labels, axis=-1))


def sgd_step(params, x, labels, lr):
    loss, grads = jax.value_and_grad(cross_entropy)(params, x, labels)
    return loss, jax.tree.map(lambda p, g: p - lr * g, params, grads)


def batch(rng, n=8, sizes=SIZES):
    x = rng.standard_normal((n, sizes[0])).astype(np.float32)
    labels = np.eye(sizes[-1], dtype=np.float32)[rng.integers(0, sizes[-1], n)]
    return x, labels


def random_pow2_scaling(tree, draw):
    def scale_leaf(x):
        scale = np.float32(2.0 ** draw(st.integers(-20, 20)))
        return jsa.ScaledArray(jnp.asarray(x / scale), jnp.asarray(scale))

    return jax.tree.map(scale_leaf, tree)


plain_sgd_step = jax.jit(sgd_step)
scalified_sgd_step = jax.jit(jsa.scalify(sgd_step))


@settings(max_examples=examples(10), deadline=None)
@given(data=st.data())
def test_mlp_sgd_step_invariance(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    params, (x, labels) = init_mlp(rng), batch(rng)
    lr = np.float32(0.05)
    expected = plain_sgd_step(params, x, labels, lr)
    inputs = random_pow2_scaling((params, x, labels, lr), data.draw)
    got = scalified_sgd_step(*inputs)
    assert_pow2_scales(got)
    assert_close_values(got, expected, rtol=2e-5, atol=1e-6)


def test_mlp_sgd_step_without_jit_and_jit_inside():
    rng = np.random.default_rng(0)
    params, (x, labels) = init_mlp(rng), batch(rng)
    expected = sgd_step(params, x, labels, 0.1)
    scaled = jsa.as_scaled_array((params, x, labels))
    got = jsa.scalify(jax.jit(sgd_step))(*scaled, 0.1)
    assert_close_values(got, expected, rtol=2e-5, atol=1e-6)


def mse_step(params, x, y):
    def loss_fn(p):
        return jnp.mean((mlp(p, x) - y) ** 2)

    return jax.value_and_grad(loss_fn)(params)


def test_float16_far_below_range():
    """Inputs and targets near 2^-40: plain float16 flushes them to zero, scaled float16 keeps them.

    The network has no biases so every value is homogeneous in the input scale: the loss is
    near 2^-80, the weight gradients near 2^-80 (in float32's normal range, so float32 on the
    values is a valid reference).
    """
    rng = np.random.default_rng(1)
    tiny = np.float32(2.0**-40)
    params = [{"w": layer["w"]} for layer in init_mlp(rng)]
    x, _ = batch(rng)
    y = rng.standard_normal((x.shape[0], SIZES[-1])).astype(np.float32)
    values = (params, x * tiny, y * tiny)
    expected_loss, expected_grads = jax.jit(mse_step)(*values)
    assert 0 < expected_loss < 2.0**-70

    plain16 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float16), values)
    plain_loss, plain_grads = jax.jit(mse_step)(*plain16)
    assert float(plain_loss) == 0.0
    assert all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(plain_grads))

    scaled16 = (
        jsa.tree.astype(jsa.as_scaled_array(params), jnp.float16),
        jsa.ScaledArray(jnp.asarray(x, jnp.float16), jnp.float32(tiny)),
        jsa.ScaledArray(jnp.asarray(y, jnp.float16), jnp.float32(tiny)),
    )
    loss, grads = jax.jit(jsa.scalify(mse_step))(*scaled16)
    assert_pow2_scales((loss, grads))
    assert jax.tree.leaves(loss)[0].dtype == jnp.float16
    np.testing.assert_allclose(float(loss.to_array(jnp.float32)), float(expected_loss), rtol=2e-2)
    for g, e in zip(jax.tree.leaves(jsa.asarray(grads, jnp.float32)), jax.tree.leaves(expected_grads)):
        np.testing.assert_allclose(g, e, rtol=5e-2, atol=5e-2 * np.max(np.abs(e)))


def test_float16_far_above_range():
    """Values near 2^30 overflow plain float16; scaled float16 represents them."""
    big = np.float32(2.0**30)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    w = (rng.standard_normal((8, 3)) / np.sqrt(8)).astype(np.float32)

    def f(x, w):
        return jnp.sum(jnp.tanh(x @ w / 2.0**30)) + jnp.max(x)

    expected = f(x * big, w)
    assert not np.isfinite(f(jnp.asarray(x * big, jnp.float16), jnp.asarray(w, jnp.float16)))
    xs = jsa.ScaledArray(jnp.asarray(x, jnp.float16), jnp.float32(big))
    got = jsa.scalify(f)(xs, jsa.as_scaled_array(jnp.asarray(w, jnp.float16)))
    np.testing.assert_allclose(float(got.to_array(jnp.float32)), float(expected), rtol=1e-2)
