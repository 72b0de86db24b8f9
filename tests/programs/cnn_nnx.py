"""A Flax NNX CNN on the digits: ``nnx.Conv``, ``nnx.BatchNorm``, ``nnx.Dropout``, SGD with momentum.

The training step is the NNX idiom: ``nnx.value_and_grad`` over the model, then
``optimizer.update(model, grads)`` in place; it returns only the loss.
"""

from __future__ import annotations

import functools

import jax
import optax
from flax import nnx

from . import data, recipe
from .harness import Program, mean_loss, nnx_call

BATCH = 64


class CNN(nnx.Module):
    def __init__(self, *, dot_general=jax.lax.dot_general, rngs: nnx.Rngs):
        # Convolutions feeding a BatchNorm take no bias (the usual idiom): BatchNorm subtracts
        # the batch mean, so such a bias has an exactly zero gradient and only drifts by round-off.
        self.conv1 = nnx.Conv(1, 16, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(16, rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(32, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.hidden = nnx.Linear(32 * 4 * 4, 64, dot_general=dot_general, rngs=rngs)
        self.head = nnx.Linear(64, 10, dot_general=dot_general, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn1(self.conv1(x)))
        x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nnx.relu(self.bn2(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)
        x = self.dropout(nnx.relu(self.hidden(x)))
        return self.head(x)


def make_optimizer():
    return optax.sgd(0.05, momentum=0.9)


def init(seed, tx, fp8=False):
    model = CNN(dot_general=recipe.fp8_dot_general if fp8 else jax.lax.dot_general, rngs=nnx.Rngs(seed))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def train_step(model: CNN, optimizer: nnx.Optimizer, images, labels):
    def loss_fn(model):
        logits = model(images[..., None])
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


PROGRAM = Program(
    name="cnn_nnx",
    make_optimizer=make_optimizer,
    init=init,
    make_train_step=lambda tx, fp8: train_step,
    jit=nnx.jit,
    call=nnx_call,
    batches=functools.partial(data.digit_batches, batch=BATCH),
    slow_steps=100,  # by 300 steps the training loss nears 0.01, too close to 0 for a relative 5% check
    slow_summary=mean_loss,  # SGD momentum at 0.05 on 1,437 digits: the path is chaotic by step 100
)
