"""Flax (NNX and Linen) and Equinox models trained under scalify.

Float32: the scalified training step gives the plain losses and parameters (model
invariance). Float16: scaled FP16 parameters train with a finite, decreasing loss. The
gradients are dynamically rescaled as the paper does: without it the static rules
overestimate the gradients' scales, the parameters' scales follow through the update's
``add`` rule, and in FP16 the parameters' data underflow to 0 within a few steps.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scalify as jsa
from tests.invariance import assert_close_values, assert_pow2_scales
from tests.nn.helpers import as_scaled_state

flax = pytest.importorskip("flax")
from flax import linen, nnx  # noqa: E402

RNG = np.random.default_rng(0)
X = RNG.standard_normal((32, 8)).astype(np.float32)
Y = np.tanh(X @ RNG.standard_normal((8, 2)).astype(np.float32))
OPT = optax.sgd(0.05, momentum=0.9)


def mse(pred, y):
    return jnp.mean(jnp.square(pred.astype(jnp.float32) - y.astype(jnp.float32)))


def make_step(loss_fn):
    """A training step on a pytree of parameters (an nnx.State, Linen or Equinox params)."""

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads = jsa.ops.dynamic_rescale_l2(grads)  # without it, FP16 scales drift (see the module docstring)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return step


def run(step, params, steps, dtype=None):
    """``steps`` steps of ``step``; plain when ``dtype`` is None, else scalified with ``dtype`` data."""
    if dtype is None:
        fn, opt_state, x, y = jax.jit(step), OPT.init(params), X, Y
    else:
        fn = jax.jit(jsa.scalify(step))
        opt_state = as_scaled_state(OPT.init(params), dtype)
        params = jsa.tree.astype(jsa.as_scaled_array(params), dtype)
        x, y = jsa.tree.astype(jsa.as_scaled_array((X, Y)), dtype)
    losses = []
    for _ in range(steps):
        loss, params, opt_state = fn(params, opt_state, x, y)
        losses.append(float(jsa.asarray(loss, jnp.float32)))
    return losses, params, opt_state


def check_float32_invariance(step, params, steps=3):
    losses, new_params, _ = run(step, params, steps)
    scaled_losses, scaled_params, scaled_state = run(step, params, steps, jnp.float32)
    assert_pow2_scales((scaled_params, scaled_state))
    np.testing.assert_allclose(scaled_losses, losses, rtol=1e-4, atol=1e-6)
    assert_close_values(scaled_params, new_params, rtol=1e-4, atol=1e-5)


def check_float16_training(step, params, steps=10):
    losses, new_params, _ = run(step, params, steps, jnp.float16)
    assert all(isinstance(p, jsa.ScaledArray) and p.dtype == jnp.float16 for p in jsa.tree.leaves(new_params))
    assert np.all(np.isfinite(losses)), losses
    assert losses[-1] < 0.7 * losses[0], losses


# --- Flax NNX --------------------------------------------------------------------------------
class NNXModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense1 = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.dense2 = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.dense2(jsa.nn.gelu(self.norm(self.dense1(x))))


@pytest.fixture(scope="module")
def nnx_setup():
    graphdef, state = nnx.split(NNXModel(nnx.Rngs(0)))

    def loss_fn(state, x, y):
        return mse(nnx.merge(graphdef, state)(x), y)

    return make_step(loss_fn), state


def test_nnx_float32_matches_plain(nnx_setup):
    check_float32_invariance(*nnx_setup)


@pytest.mark.slow  # training run; tests/programs trains these libraries' idiomatic programs by default
def test_nnx_float16_trains(nnx_setup):
    check_float16_training(*nnx_setup)


# --- Flax Linen ------------------------------------------------------------------------------
class LinenModel(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.Dense(2)(jsa.nn.silu(linen.Dense(16)(x)))


@pytest.fixture(scope="module")
def linen_setup():
    model = LinenModel()
    params = model.init(jax.random.PRNGKey(0), X)

    def loss_fn(params, x, y):
        return mse(model.apply(params, x), y)

    return make_step(loss_fn), params


def test_linen_float32_matches_plain(linen_setup):
    check_float32_invariance(*linen_setup)


@pytest.mark.slow  # training run; tests/programs trains these libraries' idiomatic programs by default
def test_linen_float16_trains(linen_setup):
    check_float16_training(*linen_setup)


# --- Equinox ---------------------------------------------------------------------------------
@pytest.mark.slow  # training run; tests/programs trains these libraries' idiomatic programs by default
def test_equinox_float16_trains_and_starts_at_the_plain_loss():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(8, 2, 16, depth=2, activation=jsa.nn.gelu, key=jax.random.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss_fn(params, x, y):
        return mse(jax.vmap(eqx.combine(params, static))(x), y)

    losses, _, _ = run(make_step(loss_fn), params, steps=10, dtype=jnp.float16)
    np.testing.assert_allclose(losses[0], float(jax.jit(loss_fn)(params, X, Y)), rtol=5e-3)
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0], losses
