"""A character GPT in Flax Linen: tied embeddings (``nn.Embed.attend``), AdamW with warmup-cosine.

Trained on windows of tiny Shakespeare with a ``flax.training.train_state.TrainState``.
Every dense layer is an ``nn.Dense`` taking the model's ``dot_general`` (``lax.dot_general``
unless the FP8 run passes another).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state
from jax import lax

from . import data, recipe
from .harness import Program

SEQ, BATCH = 32, 16


class CausalSelfAttention(nn.Module):
    num_heads: int
    dot_general: Callable[..., Any] = lax.dot_general

    @nn.compact
    def __call__(self, x):
        batch, length, width = x.shape
        head = width // self.num_heads
        # No bias: a key bias shifts every score of a query by the same amount, which softmax
        # ignores, so its exact gradient is 0 and Adam would turn round-off into +-lr steps.
        qkv = nn.Dense(3 * width, use_bias=False, dot_general=self.dot_general, name="qkv")(x)
        q, k, v = jnp.split(qkv.reshape(batch, length, 3 * self.num_heads, head), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head).astype(x.dtype)
        mask = nn.make_causal_mask(jnp.ones((batch, length)), dtype=bool)
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        attention = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", attention, v).reshape(batch, length, width)
        return nn.Dense(width, dot_general=self.dot_general, name="proj")(out)


class Block(nn.Module):
    num_heads: int
    dot_general: Callable[..., Any] = lax.dot_general

    @nn.compact
    def __call__(self, x):
        x = x + CausalSelfAttention(self.num_heads, self.dot_general)(nn.LayerNorm()(x))
        h = nn.Dense(4 * x.shape[-1], dot_general=self.dot_general)(nn.LayerNorm()(x))
        return x + nn.Dense(x.shape[-1], dot_general=self.dot_general)(nn.gelu(h))


class GPT(nn.Module):
    vocab_size: int
    width: int = 64
    depth: int = 2
    num_heads: int = 4
    max_length: int = SEQ
    dot_general: Callable[..., Any] = lax.dot_general

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab_size, self.width, embedding_init=nn.initializers.normal(0.02))
        positions = nn.Embed(self.max_length, self.width, embedding_init=nn.initializers.normal(0.02))
        x = embed(tokens) + positions(jnp.arange(tokens.shape[-1]))
        for _ in range(self.depth):
            x = Block(self.num_heads, self.dot_general)(x)
        return embed.attend(nn.LayerNorm()(x))


def make_optimizer(total_steps: int = 300):
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=3e-3, warmup_steps=10, decay_steps=total_steps, end_value=3e-4
    )
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))


def init(seed, tx, fp8=False):
    _, vocab = data.shakespeare()
    model = GPT(vocab, dot_general=recipe.fp8_dot_general if fp8 else lax.dot_general)
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, SEQ), jnp.int32))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def loss_and_grads(state, tokens, targets):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return jax.value_and_grad(loss_fn)(state.params)


def train_step(state, tokens, targets):
    loss, grads = loss_and_grads(state, tokens, targets)
    return loss, state.apply_gradients(grads=grads)


def call(compiled, state, batch):
    return compiled(state, *batch)


PROGRAM = Program(
    name="gpt_linen",
    make_optimizer=make_optimizer,
    init=init,
    make_train_step=lambda tx, fp8: train_step,
    jit=jax.jit,
    call=call,
    batches=functools.partial(data.text_batches, batch=BATCH, length=SEQ),
)
