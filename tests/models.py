"""Small plain-JAX models and training steps for the whole-program tests (``tests/properties``).

Every program here is ordinary JAX code, written without any knowledge of scalify: the tests
run it once plainly and once under ``jsa.scalify`` and compare. Parameters are initialised
with NumPy from a ``np.random.Generator`` so that a Hypothesis seed fixes everything.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jax_scalify as jsa


# --- helpers ---------------------------------------------------------------------------------
def _normal(rng: np.random.Generator, *shape: int, std: float = 1.0) -> np.ndarray:
    return (std * rng.standard_normal(shape)).astype(np.float32)


def random_pow2_scaling(tree: Any, draw, low: int = -10, high: int = 10) -> Any:
    """Every floating leaf as a ``ScaledArray`` with its own random scale ``2**k``, k in [low, high].

    ``draw`` is a Hypothesis ``data.draw``; integer and boolean leaves (tokens, step counts,
    PRNG keys) are left plain. The data is ``value / scale`` computed exactly (a power of two).
    """
    import hypothesis.strategies as st

    def scale_leaf(x):
        x = np.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.asarray(x)
        scale = np.float32(2.0 ** draw(st.integers(low, high)))
        return jsa.ScaledArray(jnp.asarray(x / scale, x.dtype), jnp.asarray(scale))

    return jax.tree.map(scale_leaf, tree)


def random_adam_state(rng: np.random.Generator, params: Any, count: int = 3) -> Any:
    """An ``optax.adam``-shaped state with random moments (nu > 0) and step count ``count``.

    A fresh ``opt.init`` state holds zeros only, which would leave half of Adam's arithmetic
    untested; random moments make every term of the update non-trivial.
    """
    state = optax.adam(1e-3).init(params)
    adam_state = state[0]
    mu = jax.tree.map(lambda p: _normal(rng, *np.shape(p), std=0.1), params)
    nu = jax.tree.map(lambda p: (rng.uniform(0.5, 2.0, np.shape(p)) * 1e-2).astype(np.float32), params)
    return (adam_state._replace(count=jnp.asarray(count, jnp.int32), mu=mu, nu=nu), *state[1:])


# --- GPT-style decoder -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 32
    seq: int = 8
    width: int = 16
    heads: int = 2
    layers: int = 2
    mlp_ratio: int = 4
    tied: bool = True
    mask_value: float = -jnp.inf  # what masked attention scores are set to


def init_gpt(rng: np.random.Generator, cfg: GPTConfig) -> dict:
    """Parameters of the decoder; per-layer parameters are stacked along a leading layer axis."""
    w, h, n = cfg.width, cfg.width * cfg.mlp_ratio, cfg.layers
    params = {
        "tok": _normal(rng, cfg.vocab, w),
        "pos": _normal(rng, cfg.seq, w, std=0.1),
        "layers": {
            "ln1_g": 1.0 + _normal(rng, n, w, std=0.1),
            "ln1_b": _normal(rng, n, w, std=0.1),
            "wqkv": _normal(rng, n, w, 3 * w, std=w**-0.5),
            "wo": _normal(rng, n, w, w, std=w**-0.5),
            "ln2_g": 1.0 + _normal(rng, n, w, std=0.1),
            "ln2_b": _normal(rng, n, w, std=0.1),
            "w1": _normal(rng, n, w, h, std=w**-0.5),
            "b1": _normal(rng, n, h, std=0.1),
            "w2": _normal(rng, n, h, w, std=h**-0.5),
            "b2": _normal(rng, n, w, std=0.1),
        },
        "lnf_g": 1.0 + _normal(rng, w, std=0.1),
        "lnf_b": _normal(rng, w, std=0.1),
    }
    if not cfg.tied:
        params["head"] = _normal(rng, w, cfg.vocab, std=w**-0.5)
    return params


def gpt_batch(rng: np.random.Generator, cfg: GPTConfig, batch: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Random token sequences and their next-token targets (int32)."""
    tokens = rng.integers(0, cfg.vocab, (batch, cfg.seq + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def layer_norm(x, gain, bias, eps=1e-5):
    """Pre-LayerNorm in plain jnp: mean, variance, rsqrt."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * gain + bias


def causal_attention(x, wqkv, wo, heads: int, mask_value: float):
    """Multi-head causal self-attention with batched ``dot_general`` (einsum)."""
    b, t, w = x.shape
    q, k, v = jnp.split(x @ wqkv, 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, w // heads) for a in (q, k, v))
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(w // heads).astype(np.float32)
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(mask, scores, mask_value)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, w)
    return out @ wo


def gpt_logits(params, tokens, cfg: GPTConfig):
    t = tokens.shape[1]
    x = params["tok"][tokens] + params["pos"][:t]  # gather (scatter-add in the gradient)

    def block(x, p):
        x = x + causal_attention(layer_norm(x, p["ln1_g"], p["ln1_b"]), p["wqkv"], p["wo"], cfg.heads, cfg.mask_value)
        hidden = jax.nn.gelu(layer_norm(x, p["ln2_g"], p["ln2_b"]) @ p["w1"] + p["b1"])
        return x + hidden @ p["w2"] + p["b2"], None

    x, _ = lax.scan(block, x, params["layers"])
    x = layer_norm(x, params["lnf_g"], params["lnf_b"])
    head = params["tok"].T if cfg.tied else params["head"]
    return x @ head


def gpt_loss(params, tokens, targets, cfg: GPTConfig):
    """Mean next-token cross-entropy on integer targets."""
    logp = jax.nn.log_softmax(gpt_logits(params, tokens, cfg), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def make_adam_step(loss_fn, optimizer: optax.GradientTransformation):
    """``step(params, opt_state, *batch) -> (loss, params, opt_state)``: one value_and_grad + optax update."""

    def step(params, opt_state, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return step
