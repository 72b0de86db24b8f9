"""A Flax Linen residual CNN on the digits, as the Flax ImageNet example writes it.

``nn.BatchNorm`` with ``use_running_average=not train`` and its ``batch_stats`` collection
carried in a ``TrainState`` subclass (``apply(..., mutable=["batch_stats"])``), a
``GroupNorm`` inside the residual blocks, an ``RMSNorm`` before the head, and SGD with
Nesterov momentum after decoupled weight decay.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from . import data
from .harness import Program

BATCH = 64


class TrainState(train_state.TrainState):
    batch_stats: Any


class ResidualBlock(nn.Module):
    channels: int

    @nn.compact
    def __call__(self, x, train: bool):
        y = nn.Conv(self.channels, (3, 3), use_bias=False)(x)
        y = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(y))
        y = nn.Conv(self.channels, (3, 3), use_bias=False)(y)
        y = nn.GroupNorm(num_groups=4)(y)
        return nn.relu(x + y)


class ResNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(16, (3, 3), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        x = ResidualBlock(16)(x, train)
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = ResidualBlock(16)(x, train)
        x = nn.RMSNorm()(jnp.mean(x, axis=(1, 2)))
        return nn.Dense(10)(x)


def make_optimizer():
    return optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(0.05, momentum=0.9, nesterov=True))


def init(seed, tx, fp8=False):
    model = ResNet()
    variables = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 8, 8, 1)), train=False)
    return TrainState.create(
        apply_fn=model.apply, params=variables["params"], batch_stats=variables["batch_stats"], tx=tx
    )


def train_step(state, images, labels):
    def loss_fn(params):
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats}, images[..., None], train=True, mutable=["batch_stats"]
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads).replace(batch_stats=updates["batch_stats"])
    return loss, state


PROGRAM = Program(
    name="resnet_linen",
    make_optimizer=make_optimizer,
    init=init,
    make_train_step=lambda tx, fp8: train_step,
    jit=jax.jit,
    call=lambda compiled, state, batch: compiled(state, *batch),
    batches=functools.partial(data.digit_batches, batch=BATCH),
    has_dense=False,
    fp16_steps=60,
)
