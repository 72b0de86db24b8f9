"""A character LSTM in Flax Linen: ``nn.Embed``, ``nn.RNN(nn.OptimizedLSTMCell)`` (a lifted
``scan`` over time), a ``nn.Dense`` head, Adam, trained on tiny Shakespeare with a ``TrainState``."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from . import data
from .harness import Program

SEQ, BATCH, HIDDEN = 32, 16, 64


class CharLSTM(nn.Module):
    vocab: int

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, 32)(tokens)
        x = nn.RNN(nn.OptimizedLSTMCell(HIDDEN))(x)
        return nn.Dense(self.vocab)(x)


def init(seed, tx, fp8=False):
    _, vocab = data.shakespeare()
    model = CharLSTM(vocab)
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, SEQ), jnp.int32))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def train_step(state, tokens, targets):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return loss, state.apply_gradients(grads=grads)


PROGRAM = Program(
    name="lstm_linen",
    make_optimizer=lambda: optax.adam(3e-3),
    init=init,
    make_train_step=lambda tx, fp8: train_step,
    jit=jax.jit,
    call=lambda compiled, state, batch: compiled(state, *batch),
    batches=functools.partial(data.text_batches, batch=BATCH, length=SEQ),
    has_dense=False,
    fp16_steps=60,
)
