"""A small GPT-2-style decoder in plain JAX, with the numeric formats as a parameter.

Architecture: token embedding + learned position embedding, ``layers`` pre-LayerNorm blocks
(causal multi-head self-attention, then a GELU MLP of width ``4 * width``), a final
LayerNorm, and a language-model head **tied** to the token embedding (logits =
``h @ embed.T``). The blocks are stacked along a leading axis and run with ``lax.scan``.

The same model code runs every configuration of the experiments; :class:`Precision` says
which formats it uses:

- ``compute``: the dtype of activations and of matmul inputs (weights are cast to it where
  they are used, so FP32 master weights give FP32 gradients back through the cast);
- ``fp8``: the four linear layers of each block (qkv, attention output, MLP up and down) use
  FP8 matmuls (``jsa.nn.linear``): inputs and weights E4M3 in the forward pass, the output
  gradient E5M2 in the backward pass, FP16 results. The attention score matmuls and the LM
  head stay in ``compute``;
- ``ln_grad_rescale``: a dynamic (L2) rescale of the gradient of each LayerNorm input
  (paper algorithm 5; a no-op outside scalify).

LayerNorm statistics, the softmax of the attention and the final log-softmax are computed
in float32 from ``compute`` inputs, as mixed-precision recipes usually do; everything else
(residual stream, matmuls, GELU, their gradients) is in ``compute``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_scalify as jsa

Array = Any
Params = dict[str, Any]

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model size."""

    vocab: int = 65
    seq: int = 128
    width: int = 128
    heads: int = 4
    layers: int = 4

    def num_params(self) -> int:
        """Number of parameters (the tied head counted once)."""
        w = self.width
        block = 2 * w + 3 * w * w + w * w + 2 * w + 8 * w * w
        return self.vocab * w + self.seq * w + self.layers * block + 2 * w  # + final LayerNorm gain and bias


@dataclasses.dataclass(frozen=True)
class Precision:
    """Numeric formats of the forward and backward passes (see the module docstring)."""

    compute: Any = jnp.float32
    fp8: bool = False
    ln_grad_rescale: bool = False


# --- initialisation ---------------------------------------------------------------------------
def init_params(key: Array, cfg: GPTConfig) -> Params:
    """GPT-2 initialisation in float32: N(0, 0.02) embeddings, N(0, 1/fan_in) linear weights,
    residual output projections further scaled by ``1/sqrt(2 * layers)``, LayerNorm gains 1
    and biases 0. Linear layers have no bias."""
    k = jax.random.split(key, 6)
    w, n = cfg.width, cfg.layers
    resid = 1.0 / np.sqrt(2 * n)

    def normal(key, shape, std):
        return std * jax.random.normal(key, shape, jnp.float32)

    return {
        "embed": normal(k[0], (cfg.vocab, w), 0.02),
        "pos": normal(k[1], (cfg.seq, w), 0.02),
        "blocks": {
            "ln1_g": jnp.ones((n, w)),
            "ln1_b": jnp.zeros((n, w)),
            "qkv": normal(k[2], (n, w, 3 * w), 1 / np.sqrt(w)),
            "proj": normal(k[3], (n, w, w), resid / np.sqrt(w)),
            "ln2_g": jnp.ones((n, w)),
            "ln2_b": jnp.zeros((n, w)),
            "up": normal(k[4], (n, w, 4 * w), 1 / np.sqrt(w)),
            "down": normal(k[5], (n, 4 * w, w), resid / np.sqrt(4 * w)),
        },
        "lnf_g": jnp.ones((w,)),
        "lnf_b": jnp.zeros((w,)),
    }


# --- layers -----------------------------------------------------------------------------------
def layer_norm(x: Array, gain: Array, bias: Array, grad_rescale: bool = False) -> Array:
    """LayerNorm over the last axis; statistics in float32, output in ``x.dtype``.

    With ``grad_rescale`` the gradient of ``x`` is dynamically rescaled (L2) under scalify.
    """
    if grad_rescale:
        x = jsa.ops.dynamic_rescale_l2_grad(x)
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    centred = x32 - mean
    var = jnp.mean(jnp.square(centred), axis=-1, keepdims=True)
    normed = (centred * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype)
    return normed * gain.astype(x.dtype) + bias.astype(x.dtype)


def linear(x: Array, w: Array, prec: Precision) -> Array:
    """A bias-free linear layer in the formats of ``prec``.

    FP8: ``jsa.nn.linear`` casts ``x`` and ``w`` to E4M3 for the forward matmul and the
    output gradient to E5M2 for the two backward matmuls (a custom VJP, so the weight
    gradient is not rounded to E4M3 as plain autodiff through a cast would do); the three
    matmuls produce FP16 results, cast back to the dtypes of ``x`` and ``w``. Under scalify
    the casts keep the scales, and ``jsa.nn.linear`` rescales the output gradient to unit
    RMS before its cast, so the FP8 data stays in range.
    """
    w = w.astype(prec.compute)
    if prec.fp8:
        return jsa.nn.linear(x, w, fwd_dtype=E4M3, bwd_dtype=E5M2, preferred_element_type=jnp.float16)
    return x @ w


def attention(x: Array, qkv_w: Array, proj_w: Array, heads: int, prec: Precision) -> Array:
    """Causal multi-head self-attention (softmax in float32)."""
    b, t, d = x.shape
    q, k, v = jnp.split(linear(x, qkv_w, prec), 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / np.sqrt(d // heads))
    causal = jnp.tril(jnp.ones((t, t), bool))
    logits = jnp.where(causal, logits.astype(jnp.float32), -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1).astype(x.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)
    return linear(out, proj_w, prec)


def block(x: Array, p: Params, heads: int, prec: Precision) -> Array:
    """One pre-LayerNorm transformer block."""
    h = layer_norm(x, p["ln1_g"], p["ln1_b"], prec.ln_grad_rescale)
    x = x + attention(h, p["qkv"], p["proj"], heads, prec)
    h = layer_norm(x, p["ln2_g"], p["ln2_b"], prec.ln_grad_rescale)
    return x + linear(jax.nn.gelu(linear(h, p["up"], prec)), p["down"], prec)


# --- model ------------------------------------------------------------------------------------
def logits_fn(params: Params, tokens: Array, cfg: GPTConfig, prec: Precision) -> Array:
    """Next-token logits (float32) for ``tokens`` of shape ``(batch, time)``, time <= seq."""
    t = tokens.shape[1]
    embed = params["embed"].astype(prec.compute)
    x = embed[tokens] + params["pos"][:t].astype(prec.compute)

    def body(h, p):
        return block(h, p, cfg.heads, prec), None

    x, _ = jax.lax.scan(body, x, params["blocks"])
    x = layer_norm(x, params["lnf_g"], params["lnf_b"], prec.ln_grad_rescale)
    return (x @ embed.T).astype(jnp.float32)


def loss_fn(params: Params, batch: Array, cfg: GPTConfig, prec: Precision) -> Array:
    """Mean next-token cross-entropy (float32) of a ``(batch, time + 1)`` token array."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logp = jax.nn.log_softmax(logits_fn(params, inputs, cfg, prec), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
