"""Regression tests of the default rescale policy on the programs where static propagation drifted.

Each program is plain JAX. Under ``RescalePolicy.static()`` its scales drift away from the
values (reproduced here, so the tests show what the policy fixes); under the default policy
the data stay near unit size and the results equal the plain program's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scalify as jsa
from experiments import rescale_policy as cnn
from tests import models
from tests.invariance import exact_value

STATIC = jsa.RescalePolicy.static()
DEFAULT = jsa.RescalePolicy()


def off_by_2_pow_8(tree, rng: np.random.Generator):
    """Every floating leaf scaled with its unit scale times ``2**8`` or ``2**-8`` (data off by the inverse)."""
    return models.random_pow2_scaling(tree, lambda: int(rng.choice([-8, 8])))


def log2_data_rms(x: jsa.ScaledArray) -> float:
    data = np.asarray(x.data, np.float64)
    return float(np.log2(np.sqrt(np.mean(np.square(data))) + 1e-300))


def scaled_leaves(tree) -> list[jsa.ScaledArray]:
    return [x for x in jax.tree.leaves(tree, is_leaf=jsa.is_scaled_leaf) if isinstance(x, jsa.ScaledArray)]


def assert_matches_plain(got, expected, rtol: float, atol: float) -> None:
    got_leaves = jax.tree.leaves(got, is_leaf=jsa.is_scaled_leaf)
    expected_leaves = jax.tree.leaves(expected)
    assert len(got_leaves) == len(expected_leaves)
    for g, e in zip(got_leaves, expected_leaves):
        np.testing.assert_allclose(exact_value(g), np.asarray(e, np.float64), rtol=rtol, atol=atol)


def sgd(loss_fn):
    def step(params, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        return loss, grads, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return step


# --- FP16 CNN + BatchNorm + SGD momentum ---------------------------------------------------------
@pytest.mark.slow  # training run; tests/programs' cnn_nnx FP16 run covers it by default
def test_fp16_cnn_with_sgd_momentum_trains_like_plain_fp16():
    steps = 5
    plain, _, _ = cnn.train("plain", steps)
    default, default_scales, _ = cnn.train("default", steps)
    static, static_scales, _ = cnn.train("static", steps)
    assert np.all(np.isfinite(plain)) and plain[-1] < plain[0]
    np.testing.assert_allclose(default, plain, rtol=2e-2)
    assert max(default_scales) <= 2
    # The symptom the policy fixes: static scales climb every step until the data flush to 0.
    assert static_scales[-1] >= 10 and not np.all(np.isfinite(static))


# --- float32 invariance with input scales off by 2**±8 -------------------------------------------
def gelu_scan_loss(ws, x):
    def layer(h, w):
        return h + jax.nn.gelu(h @ w), None

    return jnp.sum(jax.lax.scan(layer, x, ws)[0] ** 2)


def test_gelu_scan_with_weights_at_scale_2_pow_10_keeps_finite_gradients():
    rng = np.random.default_rng(0)
    ws = (rng.standard_normal((3, 16, 16)) / 4).astype(np.float32)
    x = rng.standard_normal((4, 16)).astype(np.float32)
    step = sgd(gelu_scan_loss)
    expected = jax.jit(step)(ws, x)
    args = (jsa.ScaledArray(jnp.asarray(ws / 2.0**10), jnp.float32(2.0**10)), jsa.as_scaled_array(x))
    static = jax.jit(jsa.scalify(step, policy=STATIC))(*args)
    default = jax.jit(jsa.scalify(step))(*args)
    assert not np.all(np.isfinite(exact_value(static[1])))  # x**3 of a drifted scale overflows
    assert_matches_plain(default, expected, rtol=1e-4, atol=1e-5)
    assert all(-2 <= log2_data_rms(x) < 2 for x in scaled_leaves(default))


def gru_loss(params, xs, targets):
    def cell(h, x):
        z = jax.nn.sigmoid(x @ params["wz"] + h @ params["uz"])
        r = jax.nn.sigmoid(x @ params["wr"] + h @ params["ur"])
        c = jnp.tanh(x @ params["wc"] + (r * h) @ params["uc"])
        return (1 - z) * h + z * c, None

    h0 = jnp.zeros((xs.shape[1], params["uz"].shape[0]), xs.dtype)
    h, _ = jax.lax.scan(cell, h0, xs)
    return jnp.mean((h @ params["out"] - targets) ** 2)


def test_gru_scan_of_16_steps_keeps_gradient_data_near_unit_size():
    rng = np.random.default_rng(1)
    hidden, inputs = 16, 8
    params = {
        name: (rng.standard_normal((inputs if name[0] == "w" else hidden, hidden)) / np.sqrt(hidden)).astype(np.float32)
        for name in ("wz", "uz", "wr", "ur", "wc", "uc")
    }
    params["out"] = (rng.standard_normal((hidden, 4)) / 4).astype(np.float32)
    xs = rng.standard_normal((16, 4, inputs)).astype(np.float32)
    targets = rng.standard_normal((4, 4)).astype(np.float32)
    step = sgd(gru_loss)
    args = off_by_2_pow_8((params, xs, targets), rng)
    static = jax.jit(jsa.scalify(step, policy=STATIC))(*args)
    default = jax.jit(jsa.scalify(step))(*args)
    assert_matches_plain(default, jax.jit(step)(params, xs, targets), rtol=2e-5, atol=1e-6)
    assert max(abs(log2_data_rms(g)) for g in scaled_leaves(static[1])) > 20  # static gradient scales ran away
    assert all(-2 <= log2_data_rms(x) < 2 for x in scaled_leaves(default))


def test_gpt_adam_step_is_invariant_and_keeps_moments_near_unit_size():
    rng = np.random.default_rng(2)
    cfg = models.GPTConfig()
    params = models.init_gpt(rng, cfg)
    tokens, targets = models.gpt_batch(rng, cfg)
    optimizer = optax.adam(1e-3)
    step = models.make_adam_step(functools.partial(models.gpt_loss, cfg=cfg), optimizer)
    opt_state = models.warm_optimizer_state(optimizer, params, rng)
    args = off_by_2_pow_8((params, opt_state, tokens, targets), rng)
    expected = jax.jit(step)(params, opt_state, tokens, targets)
    default = jax.jit(jsa.scalify(step))(*args)
    assert_matches_plain(default, expected, rtol=2e-5, atol=1e-6)
    state = scaled_leaves(default[1:])
    assert state and all(-3 <= log2_data_rms(x) < 2 for x in state if np.any(np.asarray(x.data) != 0))
