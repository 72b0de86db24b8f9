"""A plain-JAX MLP on the digits: parameters in a list of dicts, ``jax.value_and_grad``, an optax chain."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

import jax_scalify as jsa

from . import data, recipe
from .harness import Program, functional_call

SIZES = (64, 128, 128, 10)
BATCH = 64


def init_params(key, sizes=SIZES):
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        key, wkey = jax.random.split(key)
        params.append(
            {"w": jax.random.normal(wkey, (fan_in, fan_out)) * jnp.sqrt(2.0 / fan_in), "b": jnp.zeros(fan_out)}
        )
    return params


def dense(x, layer):
    return x @ layer["w"] + layer["b"]


def fp8_dense(x, layer):
    """The same layer through the documented FP8 path."""
    return jsa.nn.linear(x, layer["w"], layer["b"], **recipe.FP8_LINEAR)


def predict(params, images, dense=dense):
    x = images.reshape(images.shape[0], -1)
    for layer in params[:-1]:
        x = jax.nn.gelu(dense(x, layer))
    return dense(x, params[-1])


def loss_fn(params, images, labels, dense=dense):
    logits = predict(params, images, dense)
    one_hot = jax.nn.one_hot(labels, logits.shape[-1])
    return -jnp.mean(jnp.sum(one_hot * jax.nn.log_softmax(logits), axis=-1))


def make_optimizer():
    schedule = optax.exponential_decay(3e-3, transition_steps=100, decay_rate=0.5)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.scale_by_adam(),
        optax.add_decayed_weights(1e-4),
        optax.scale_by_learning_rate(schedule),
    )


def make_train_step(tx, fp8=False):
    layer = fp8_dense if fp8 else dense

    def train_step(params, opt_state, images, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, images, labels, layer)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return train_step


def init(seed, tx, fp8=False):
    params = init_params(jax.random.PRNGKey(seed))
    return params, tx.init(params)


PROGRAM = Program(
    name="mlp_jax",
    make_optimizer=make_optimizer,
    init=init,
    make_train_step=make_train_step,
    jit=jax.jit,
    call=functional_call,
    batches=functools.partial(data.digit_batches, batch=BATCH),
    slow_steps=100,  # by 300 steps the training loss nears 0.01, too close to 0 for a relative 5% check
)
