"""A Haiku-style character transformer written in plain JAX functions.

Parameters are nested dicts named by module path, as ``hk.transform`` gives them; LayerNorm
computes its statistics with ``jnp.mean`` and ``jnp.var`` (as ``hk.LayerNorm`` does),
multi-head attention projects queries, keys and values separately and masks the scores
with ``jnp.where``, and the optimizer is ``optax.chain(optax.clip_by_global_norm(1.0),
optax.adam(...))``. Trained on windows of tiny Shakespeare; the FP8 run takes every linear
layer through ``jsa.nn.linear``'s FP8 recipe.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_scalify as jsa

from . import data, recipe
from .harness import Program, functional_call

SEQ, BATCH, WIDTH, HEADS, LAYERS = 32, 16, 64, 4, 2


def linear_params(key, fan_in, fan_out):
    """Haiku's default ``hk.Linear`` initialisation: truncated normal, stddev 1/sqrt(fan_in)."""
    w = jax.random.truncated_normal(key, -2.0, 2.0, (fan_in, fan_out)) / np.sqrt(fan_in)
    return {"w": w, "b": jnp.zeros(fan_out)}


def layer_norm_params(width):
    return {"scale": jnp.ones(width), "offset": jnp.zeros(width)}


def init_params(key, vocab):
    keys = iter(jax.random.split(key, 3 + 6 * LAYERS))
    params = {
        "embed": {"embeddings": jax.random.truncated_normal(next(keys), -2.0, 2.0, (vocab, WIDTH))},
        "pos_embed": {"embeddings": 0.02 * jax.random.normal(next(keys), (SEQ, WIDTH))},
        "ln_f": layer_norm_params(WIDTH),
        "unembed": linear_params(next(keys), WIDTH, vocab),
    }
    for i in range(LAYERS):
        params[f"block_{i}"] = {
            "ln_1": layer_norm_params(WIDTH),
            "ln_2": layer_norm_params(WIDTH),
            "attn": {name: linear_params(next(keys), WIDTH, WIDTH) for name in ("query", "key", "value", "out")},
            "mlp": {
                "fc": linear_params(next(keys), WIDTH, 4 * WIDTH),
                "proj": linear_params(next(keys), 4 * WIDTH, WIDTH),
            },
        }
        # No key bias: it shifts every score of a query by the same amount, which softmax
        # ignores, so its exact gradient is 0 and its Adam moments hold nothing but round-off.
        del params[f"block_{i}"]["attn"]["key"]["b"]
    return params


def linear(p, x):
    return x @ p["w"] + p["b"] if "b" in p else x @ p["w"]


def fp8_linear(p, x):
    return jsa.nn.linear(x, p["w"], p.get("b"), **recipe.FP8_LINEAR)


def layer_norm(p, x, eps=1e-5):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.var(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(variance + eps) * p["scale"] + p["offset"]


def attention(p, x, linear):
    batch, length, width = x.shape
    head = width // HEADS

    def heads(name):
        return linear(p[name], x).reshape(batch, length, HEADS, head)

    q, k, v = heads("query"), heads("key"), heads("value")
    logits = jnp.einsum("bthd,bThd->bhtT", q, k) / head**0.5
    causal = jnp.tril(jnp.ones((length, length), bool))
    logits = jnp.where(causal, logits, -1e30)
    weights = jax.nn.softmax(logits)
    out = jnp.einsum("bhtT,bThd->bthd", weights, v).reshape(batch, length, width)
    return linear(p["out"], out)


def forward(params, tokens, linear=linear):
    x = params["embed"]["embeddings"][tokens] + params["pos_embed"]["embeddings"][: tokens.shape[1]]
    for i in range(LAYERS):
        block = params[f"block_{i}"]
        x = x + attention(block["attn"], layer_norm(block["ln_1"], x), linear)
        h = jax.nn.gelu(linear(block["mlp"]["fc"], layer_norm(block["ln_2"], x)))
        x = x + linear(block["mlp"]["proj"], h)
    return linear(params["unembed"], layer_norm(params["ln_f"], x))


def loss_fn(params, tokens, targets, linear=linear):
    logits = forward(params, tokens, linear)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_optimizer():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(3e-3))


def make_train_step(tx, fp8=False):
    layer = fp8_linear if fp8 else linear

    def train_step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets, layer)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return train_step


def init(seed, tx, fp8=False):
    _, vocab = data.shakespeare()
    params = init_params(jax.random.PRNGKey(seed), vocab)
    return params, tx.init(params)


PROGRAM = Program(
    name="transformer_jax",
    make_optimizer=make_optimizer,
    init=init,
    make_train_step=make_train_step,
    jit=jax.jit,
    call=functional_call,
    batches=functools.partial(data.text_batches, batch=BATCH, length=SEQ),
    fp16_steps=40,
    slow_steps=200,
)
