"""State the user keeps beside the weights and the optimizer: an exponential moving average of the weights.

The README's advice: such state moves by a small fraction of itself each step and keeps
float32 data (``jsa.as_scaled_array`` without ``astype``). In float16 data an increment below
half an ulp (2**-12 of the value) rounds away whatever the scale.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scalify as jsa

from . import data, mlp_jax, recipe

DECAY = 0.999
STEPS = 150


def make_step(tx):
    def step(params, opt_state, average, images, labels):
        loss, grads = jax.value_and_grad(mlp_jax.loss_fn)(params, images, labels)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        average = jax.tree.map(lambda a, p: DECAY * a + (1 - DECAY) * p, average, params)
        return loss, params, opt_state, average

    return step


def weight_average(storage: str):
    """The average after :data:`STEPS` Adam steps: ``"float32"`` plain, or scalified with the average's data in ``storage``."""
    params = mlp_jax.init_params(jax.random.PRNGKey(0))
    average = jax.tree.map(jnp.array, params)
    tx = optax.adam(1e-3)
    if storage == "plain":
        step = jax.jit(make_step(tx))
    else:
        tx = recipe.optimizer(tx)
        step = jax.jit(jsa.scalify(make_step(tx)))
        params = recipe.scale_state(params)
        average = jsa.tree.astype(jsa.as_scaled_array(average), jnp.dtype(storage))
    opt_state = tx.init(params)
    for images, labels in data.digit_batches(0, STEPS, 64):
        batch = (jnp.asarray(images), jnp.asarray(labels))
        if storage != "plain":
            batch = recipe.scale_batch(batch)
        _, params, opt_state, average = step(params, opt_state, average, *batch)
    return [np.asarray(recipe.value(a), np.float32) for a in jax.tree.leaves(average, is_leaf=jsa.is_scaled_leaf)]


def worst_relative_error(got, expected):
    return max(float(np.max(np.abs(g - e)) / np.max(np.abs(e))) for g, e in zip(got, expected))


@pytest.fixture(scope="module")
def float32_average():
    return weight_average("plain")


def test_an_average_with_float32_data_follows_float32(float32_average):
    assert worst_relative_error(weight_average("float32"), float32_average) < 1e-2


def test_an_average_with_float16_data_loses_its_increments(float32_average):
    """Why the README keeps it in float32: ``0.999 * a`` in float16 rounds back towards ``a``."""
    assert worst_relative_error(weight_average("float16"), float32_average) > 3e-2
