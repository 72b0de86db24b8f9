"""LoRA fine-tuning in Flax NNX: ``nnx.LoRALinear`` layers, ``nnx.Optimizer(wrt=nnx.LoRAParam)``
and ``nnx.value_and_grad(argnums=nnx.DiffState(0, nnx.LoRAParam))``, so that only the low-rank
adapters train and the base weights must not move; Adam, on the digits."""

from __future__ import annotations

import functools

import optax
from flax import nnx

from . import data
from .harness import Program, nnx_call

BATCH, RANK = 64, 4


class LoRAMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden1 = nnx.LoRALinear(64, 128, lora_rank=RANK, rngs=rngs)
        self.hidden2 = nnx.LoRALinear(128, 128, lora_rank=RANK, rngs=rngs)
        self.head = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, images):
        x = nnx.relu(self.hidden1(images.reshape(images.shape[0], -1)))
        return self.head(nnx.relu(self.hidden2(x)))


def init(seed, tx, fp8=False):
    model = LoRAMLP(nnx.Rngs(seed))
    return model, nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)


def train_step(model: LoRAMLP, optimizer: nnx.Optimizer, images, labels):
    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(images), labels).mean()

    loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
    optimizer.update(model, grads)
    return loss


PROGRAM = Program(
    name="lora_nnx",
    make_optimizer=lambda: optax.adam(1e-2),
    init=init,
    make_train_step=lambda tx, fp8: train_step,
    jit=nnx.jit,
    call=nnx_call,
    batches=functools.partial(data.digit_batches, batch=BATCH),
    has_dense=False,
    fp16_steps=60,
)
