"""An Equinox CNN on the digits: ``eqx.nn.Conv2d``, ``eqx.nn.MaxPool2d``, ``eqx.nn.Linear``, RMSProp.

Models are applied per example and ``jax.vmap``-ed over the batch, as Equinox users do;
parameters and the rest of the model are split with ``eqx.partition`` / ``eqx.combine``.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from . import data
from .harness import Program, functional_call

BATCH = 64


class ConvNet(eqx.Module):
    layers: list

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.layers = [
            eqx.nn.Conv2d(1, 8, kernel_size=3, padding=1, key=keys[0]),
            eqx.nn.MaxPool2d(kernel_size=2, stride=2),
            jax.nn.relu,
            eqx.nn.Conv2d(8, 16, kernel_size=3, padding=1, key=keys[1]),
            eqx.nn.MaxPool2d(kernel_size=2, stride=2),
            jax.nn.relu,
            jnp.ravel,
            eqx.nn.Linear(16 * 2 * 2, 64, key=keys[2]),
            jax.nn.sigmoid,
            eqx.nn.Linear(64, 10, key=keys[3]),
            jax.nn.log_softmax,
        ]

    def __call__(self, image):
        x = image[None]  # one channel
        for layer in self.layers:
            x = layer(x)
        return x


def loss_fn(params, static, images, labels):
    model = eqx.combine(params, static)
    log_probs = jax.vmap(model)(images)
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))


def make_optimizer():
    return optax.rmsprop(1e-3, momentum=0.9)


def make_train_step(tx, fp8=False):
    def train_step(model, opt_state, images, labels):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        loss, grads = jax.value_and_grad(loss_fn)(params, static, images, labels)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, eqx.combine(optax.apply_updates(params, updates), static), opt_state

    return train_step


def init(seed, tx, fp8=False):
    model = ConvNet(jax.random.PRNGKey(seed))
    return model, tx.init(eqx.filter(model, eqx.is_inexact_array))


PROGRAM = Program(
    name="conv_eqx",
    make_optimizer=make_optimizer,
    init=init,
    make_train_step=make_train_step,
    jit=eqx.filter_jit,
    call=functional_call,
    batches=functools.partial(data.digit_batches, batch=BATCH),
    slow_steps=100,  # by 300 steps the training loss nears 0.01, too close to 0 for a relative 5% check
    has_dense=False,
)
