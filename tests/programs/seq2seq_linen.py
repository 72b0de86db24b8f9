"""A Flax Linen LSTM encoder-decoder that learns to reverse sequences of digits.

The encoder is ``nn.RNN(nn.LSTMCell)`` over dropped-out embeddings (``nn.Dropout``), and
returns its carry; the decoder is an ``nn.scan`` over a cell whose carry holds the LSTM
state and the one-hot of the previous token (teacher forcing: the true previous token),
made in the carry's dtype (``jax.nn.one_hot``'s default float32 would not match a float16
carry, in plain JAX as under scalify). The training step closes over a typed PRNG key
(``jax.random.key``) and folds the step count into it for dropout, as Flax's examples do;
Adam, a ``TrainState``. The FP8 run gives the ``nn.Dense`` layers ``jsa.nn.cast_dot_general()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax import lax

from . import recipe
from .harness import Program

LENGTH, BATCH, DIGITS, HIDDEN = 8, 32, 10, 64
START = DIGITS  # the decoder's first input
VOCAB = DIGITS + 1


class DecoderCell(nn.Module):
    dot_general: Callable[..., Any] = lax.dot_general

    @nn.compact
    def __call__(self, carry, token):
        lstm_state, previous = carry
        lstm_state, h = nn.LSTMCell(HIDDEN)(lstm_state, previous)
        logits = nn.Dense(DIGITS, dot_general=self.dot_general)(h)
        return (lstm_state, jax.nn.one_hot(token, VOCAB, dtype=previous.dtype)), logits


class Seq2Seq(nn.Module):
    dot_general: Callable[..., Any] = lax.dot_general

    @nn.compact
    def __call__(self, inputs, targets, *, train: bool):
        x = nn.Embed(VOCAB, 32)(inputs)
        x = nn.Dropout(0.1, deterministic=not train)(x)
        x = nn.Dense(HIDDEN, dot_general=self.dot_general)(x)
        lstm_state, _ = nn.RNN(nn.LSTMCell(HIDDEN), return_carry=True)(x)
        decoder = nn.scan(
            DecoderCell, variable_broadcast="params", split_rngs={"params": False}, in_axes=1, out_axes=1
        )(self.dot_general)
        start = jax.nn.one_hot(jnp.full(inputs.shape[:1], START), VOCAB, dtype=x.dtype)
        _, logits = decoder((lstm_state, start), targets)
        return logits


def make_train_step(tx, fp8=False):
    dropout_key = jax.random.key(0)

    def train_step(state, inputs, targets):
        key = jax.random.fold_in(dropout_key, state.step)

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, inputs, targets, train=True, rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return loss, state.apply_gradients(grads=grads)

    return train_step


def init(seed, tx, fp8=False):
    model = Seq2Seq(recipe.fp8_dot_general if fp8 else lax.dot_general)
    tokens = jnp.zeros((1, LENGTH), jnp.int32)
    params = model.init(jax.random.key(seed), tokens, tokens, train=False)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def reversal_batches(seed: int, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``count`` batches of ``(digits (B, L), the same digits reversed)``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        digits = rng.integers(0, DIGITS, (BATCH, LENGTH)).astype(np.int32)
        out.append((digits, digits[:, ::-1].copy()))
    return out


PROGRAM = Program(
    name="seq2seq_linen",
    make_optimizer=lambda: optax.adam(3e-3),
    init=init,
    make_train_step=make_train_step,
    jit=jax.jit,
    call=lambda compiled, state, batch: compiled(state, *batch),
    batches=reversal_batches,
    fp16_steps=40,
    slow_steps=300,
)
