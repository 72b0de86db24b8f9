"""A selective state-space model in Equinox (Mamba-style): a character LM of two residual blocks
``x + mixer(rms_norm(x))``. The mixer projects the input into a branch and a gate, runs a causal
depthwise convolution and SiLU on the branch, projects it again into an input-dependent step
``dt`` (through a low-rank projection and softplus) and the ``B``, ``C`` of the recurrence
``h[t] = exp(dt * A) * h[t-1] + dt * B * x[t]``, ``y = C . h + D * x``, evaluated by
``jax.lax.associative_scan`` over the sequence, gated by ``silu(z)`` and projected back; AdamW,
``eqx.filter_jit``. Its chain of projections with no normalisation in between is what drifted
under static contraction scales."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from . import eqx_char_lm

WIDTH, INNER, STATE, DT_RANK, KERNEL, SEQ, BATCH = 32, 64, 8, 4, 4, 64, 8


def combine(earlier, later):
    """Compose two steps of ``h -> a * h + u``: the associative operator of a linear recurrence."""
    return earlier[0] * later[0], later[0] * earlier[1] + later[1]


class SelectiveMixer(eqx.Module):
    in_proj: eqx.nn.Linear
    conv: eqx.nn.Conv1d
    x_proj: eqx.nn.Linear
    dt_proj: eqx.nn.Linear
    a_log: jax.Array
    skip: jax.Array
    out_proj: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 5)
        self.in_proj = eqx.nn.Linear(WIDTH, 2 * INNER, use_bias=False, key=keys[0])
        self.conv = eqx.nn.Conv1d(INNER, INNER, KERNEL, padding=((KERNEL - 1, 0),), groups=INNER, key=keys[1])
        self.x_proj = eqx.nn.Linear(INNER, DT_RANK + 2 * STATE, use_bias=False, key=keys[2])
        self.dt_proj = eqx.nn.Linear(DT_RANK, INNER, key=keys[3])
        self.a_log = jnp.log(jnp.broadcast_to(jnp.arange(1, STATE + 1, dtype=jnp.float32), (INNER, STATE)))
        self.skip = jnp.ones(INNER)
        self.out_proj = eqx.nn.Linear(INNER, WIDTH, use_bias=False, key=keys[4])

    def __call__(self, x):  # (SEQ, WIDTH)
        branch, gate = jnp.split(jax.vmap(self.in_proj)(x), 2, axis=-1)
        branch = jax.nn.silu(self.conv(branch.T).T)
        dt, b, c = jnp.split(jax.vmap(self.x_proj)(branch), [DT_RANK, DT_RANK + STATE], axis=-1)
        dt = jax.nn.softplus(jax.vmap(self.dt_proj)(dt))  # (SEQ, INNER)
        decay = jnp.exp(dt[..., None] * -jnp.exp(self.a_log))  # (SEQ, INNER, STATE)
        inputs = dt[..., None] * b[:, None, :] * branch[..., None]
        _, states = jax.lax.associative_scan(combine, (decay, inputs))
        y = jnp.einsum("lds,ls->ld", states, c) + self.skip * branch
        return jax.vmap(self.out_proj)(y * jax.nn.silu(gate))


class MambaLM(eqx.Module):
    embed: eqx.nn.Embedding
    norms: list
    mixers: list
    final_norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(self, vocab, key):
        k_embed, k_blocks, k_head = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(vocab, WIDTH, key=k_embed)
        self.norms = [eqx.nn.RMSNorm(WIDTH) for _ in range(2)]
        self.mixers = [SelectiveMixer(k) for k in jax.random.split(k_blocks, 2)]
        self.final_norm = eqx.nn.RMSNorm(WIDTH)
        self.head = eqx.nn.Linear(WIDTH, vocab, key=k_head)

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        for norm, mixer in zip(self.norms, self.mixers):
            x = x + mixer(jax.vmap(norm)(x))
        return jax.vmap(self.head)(jax.vmap(self.final_norm)(x))


PROGRAM = eqx_char_lm.program("mamba_eqx", MambaLM, lambda: optax.adamw(3e-3), BATCH, SEQ, fp16_steps=60)
