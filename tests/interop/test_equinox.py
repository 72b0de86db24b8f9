"""Equinox programs under ``eqx.filter_jit(jsa.scalify(step))``.

Regression: every Equinox program tried failed, because scalify traced the Python leaves
that ``eqx.filter_jit`` keeps static (a ``MaxPool2d``'s ``init=-inf``, a GRU's
``hidden_size`` used as a shape, a diffusion end time ``t1``), and ``jsa.as_scaled_array``
rejected a module's function leaves. In float32 the scalified step with scaled inputs gives
the plain step's loss and model.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scalify as jsa
from tests.invariance import assert_close_values, assert_pow2_scales

eqx = pytest.importorskip("equinox")

RNG = np.random.default_rng(0)
X = RNG.standard_normal((6, 1, 8, 8)).astype(np.float32)
Y = RNG.standard_normal((6, 2)).astype(np.float32)
OPT = optax.adam(1e-2)


class ConvGRU(eqx.Module):
    """Conv -> max-pool -> rows read by a GRU cell through ``lax.scan`` -> MLP head."""

    conv: eqx.nn.Conv2d
    pool: eqx.nn.MaxPool2d
    cell: eqx.nn.GRUCell
    head: eqx.nn.MLP

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv = eqx.nn.Conv2d(1, 4, 3, padding=1, key=k1)
        self.pool = eqx.nn.MaxPool2d(2, 2)
        self.cell = eqx.nn.GRUCell(16, 8, key=k2)
        self.head = eqx.nn.MLP(8, 2, 16, depth=1, activation=jax.nn.gelu, key=k3)

    def __call__(self, x):
        rows = self.pool(jax.nn.relu(self.conv(x))).reshape(4, 16)
        state, _ = jax.lax.scan(lambda h, row: (self.cell(row, h), None), jnp.zeros(self.cell.hidden_size), rows)
        return self.head(state)


def step(model, opt_state, x, y):
    def loss_fn(model):
        return jnp.mean(jnp.square(jax.vmap(model)(x) - y))

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, opt_state = OPT.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    return loss, eqx.apply_updates(model, updates), opt_state


@pytest.fixture(scope="module")
def model():
    return ConvGRU(jax.random.PRNGKey(0))


def test_as_scaled_array_keeps_the_static_leaves_of_a_module(model):
    scaled = jsa.as_scaled_array(model)
    assert scaled.head.activation is jax.nn.gelu and scaled.pool.init == -np.inf
    assert scaled.cell.hidden_size == 8 and type(scaled.cell.hidden_size) is int
    assert isinstance(scaled.conv.weight, jsa.ScaledArray)
    params, static = eqx.partition(scaled, lambda x: isinstance(x, jsa.ScaledArray), is_leaf=jsa.is_scaled_leaf)
    assert jax.tree.structure(static) == jax.tree.structure(eqx.partition(model, eqx.is_inexact_array)[1])


def test_filter_jit_scalified_step_matches_the_plain_step(model):
    opt_state = OPT.init(eqx.filter(model, eqx.is_inexact_array))
    plain, scalified = eqx.filter_jit(step), eqx.filter_jit(jsa.scalify(step))
    ref, ref_state = model, opt_state
    got, got_state = jsa.as_scaled_array(model), jsa.as_scaled_array(opt_state)
    xs = jsa.ScaledArray(jnp.asarray(X), jnp.float32(2.0**-10))  # value X * 2**-10
    for _ in range(3):
        ref_loss, ref, ref_state = plain(ref, ref_state, X * np.float32(2.0**-10), Y)
        loss, got, got_state = scalified(got, got_state, xs, Y)
        np.testing.assert_allclose(loss.to_array(), ref_loss, rtol=1e-5)
    assert got.head.activation is jax.nn.gelu and got.pool.init == -np.inf
    assert_pow2_scales(eqx.filter(got, eqx.is_inexact_array))
    params, ref_params = eqx.filter(got, eqx.is_inexact_array), eqx.filter(ref, eqx.is_inexact_array)
    assert_close_values(params, ref_params, rtol=1e-5, atol=1e-6)
    assert_close_values(got_state, ref_state, rtol=1e-5, atol=1e-6)


def test_a_python_float_end_time_stays_static(model):
    """A diffusion-style time grid from a Python float ``t1`` (``jnp.arange`` needs it concrete)."""

    def noisy_outputs(model, x, t1):
        times = jnp.arange(0.0, t1, 0.25)
        return jax.vmap(lambda t: jax.vmap(model)(x * (1 - t)))(times)

    ref = eqx.filter_jit(noisy_outputs)(model, X, 1.0)
    got = eqx.filter_jit(jsa.scalify(noisy_outputs))(jsa.as_scaled_array(model), jsa.as_scaled_array(X), 1.0)
    assert got.shape == (4, 6, 2)
    np.testing.assert_allclose(jsa.asarray(got), ref, rtol=1e-5, atol=1e-6)


class BatchNormMLP(eqx.Module):
    """Linear -> BatchNorm (running statistics in ``eqx.nn.State``) -> tanh -> Linear.

    The first layer has no bias, as before any normalisation: a bias there has a true
    gradient near 0, made of float32 round-off that Adam scales to full-size updates, so
    plain float32 itself follows its rounding (scalify's exact values round elsewhere).
    """

    first: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    last: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.first = eqx.nn.Linear(8, 16, use_bias=False, key=k1)
        self.norm = eqx.nn.BatchNorm(16, axis_name="batch")
        self.last = eqx.nn.Linear(16, 2, key=k2)

    def __call__(self, x, state):
        h, state = self.norm(self.first(x), state)
        return self.last(jnp.tanh(h)), state


def batch_norm_step(model, state, opt_state, x, y):
    def loss_fn(model):
        batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
        out, new_state = batched(x, state)
        return jnp.mean(jnp.square(out - y)), new_state

    (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model)
    updates, opt_state = OPT.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    return loss, eqx.apply_updates(model, updates), state, opt_state


def test_batch_norm_with_state_over_a_vmap_axis_name_matches_the_plain_step():
    """Equinox's BatchNorm takes its batch statistics with collectives over the ``vmap`` axis
    name, which JAX turns into psum over a positional axis (the rule used to ask for a device
    axis there and failed)."""
    model, state = eqx.nn.make_with_state(BatchNormMLP)(jax.random.PRNGKey(0))
    opt_state = OPT.init(eqx.filter(model, eqx.is_inexact_array))
    x = RNG.standard_normal((32, 8)).astype(np.float32)
    y = RNG.standard_normal((32, 2)).astype(np.float32)
    plain, scalified = eqx.filter_jit(batch_norm_step), eqx.filter_jit(jsa.scalify(batch_norm_step))
    ref = (model, state, opt_state)
    got = jsa.as_scaled_array(ref)
    xs = jsa.ScaledArray(jnp.asarray(x), jnp.float32(2.0**-6))  # value x * 2**-6
    for _ in range(2):
        ref_loss, *ref = plain(*ref, x * np.float32(2.0**-6), y)
        loss, *got = scalified(*got, xs, y)
        np.testing.assert_allclose(loss.to_array(), ref_loss, rtol=1e-5)
    got_arrays, ref_arrays = (eqx.filter(jsa.asarray(t), eqx.is_inexact_array) for t in (got, ref))
    assert_close_values(got_arrays, ref_arrays, rtol=1e-5, atol=1e-6)
