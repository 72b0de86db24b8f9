"""A linear recurrent model in Equinox, computed as a parallel scan: a character LM of two
residual blocks ``x + C(gelu(h))``, ``h[t] = a * h[t-1] + sqrt(1 - a**2) * B(norm(x[t]))`` with a
learned real diagonal decay ``a = exp(-exp(log_nu))`` (LRU-style), the recurrence evaluated by
``jax.lax.associative_scan`` over the sequence; Adam, ``eqx.filter_jit``."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from . import eqx_char_lm

WIDTH, STATE, SEQ, BATCH = 32, 64, 128, 8


def combine(earlier, later):
    """Compose two steps of ``h -> a * h + u``: the associative operator of a linear recurrence."""
    return earlier[0] * later[0], later[0] * earlier[1] + later[1]


class RecurrentBlock(eqx.Module):
    log_nu: jax.Array
    norm: eqx.nn.LayerNorm
    encode: eqx.nn.Linear
    decode: eqx.nn.Linear

    def __init__(self, key):
        k_decay, k_encode, k_decode = jax.random.split(key, 3)
        decay = jax.random.uniform(k_decay, (STATE,), minval=0.9, maxval=0.999)
        self.log_nu = jnp.log(-jnp.log(decay))
        self.norm = eqx.nn.LayerNorm(WIDTH)
        self.encode = eqx.nn.Linear(WIDTH, STATE, key=k_encode)
        self.decode = eqx.nn.Linear(STATE, WIDTH, key=k_decode)

    def __call__(self, x):  # (SEQ, WIDTH)
        decay = jnp.exp(-jnp.exp(self.log_nu))
        inputs = jax.vmap(self.encode)(jax.vmap(self.norm)(x)) * jnp.sqrt(1 - decay**2)
        _, states = jax.lax.associative_scan(combine, (jnp.broadcast_to(decay, inputs.shape), inputs))
        return x + jax.vmap(self.decode)(jax.nn.gelu(states))


class RecurrentLM(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, vocab, key):
        k_embed, k_blocks, k_head = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(vocab, WIDTH, key=k_embed)
        self.blocks = [RecurrentBlock(k) for k in jax.random.split(k_blocks, 2)]
        self.head = eqx.nn.Linear(WIDTH, vocab, key=k_head)

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(x)


PROGRAM = eqx_char_lm.program("lru_eqx", RecurrentLM, lambda: optax.adam(3e-3), BATCH, SEQ, fp16_steps=60)
