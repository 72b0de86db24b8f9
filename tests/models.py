"""Small plain-JAX models and training steps for the whole-program tests (``tests/properties``).

Every program here is ordinary JAX code, written without any knowledge of scalify: the tests
run it once plainly and once under ``jsa.scalify`` and compare. Parameters are initialised
with NumPy from a ``np.random.Generator`` so that a Hypothesis seed fixes everything.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jax_scalify as jsa


# --- helpers ---------------------------------------------------------------------------------
def _normal(rng: np.random.Generator, *shape: int, std: float = 1.0) -> np.ndarray:
    return (std * rng.standard_normal(shape)).astype(np.float32)


SCALE_EXPONENTS = (-10, 10)  # default range of the random exponents k below


def hypothesis_exponents(data, low: int = SCALE_EXPONENTS[0], high: int = SCALE_EXPONENTS[1]) -> Callable[[], int]:
    """Scale exponents drawn by Hypothesis (``data`` is ``st.data()``'s object): shrinkable and reported."""
    return lambda: data.draw(st.integers(low, high), label="scale exponent")


def numpy_exponents(rng: np.random.Generator, low: int = SCALE_EXPONENTS[0], high: int = SCALE_EXPONENTS[1]):
    """Scale exponents from a NumPy generator, for tests outside Hypothesis."""
    return lambda: int(rng.integers(low, high + 1))


def random_pow2_scaling(tree: Any, exponent: Callable[[], int]) -> Any:
    """Every floating leaf as a ``ScaledArray`` whose data is ``2**-k`` times unit size, ``k = exponent()``.

    The scale is ``2**k`` times the one ``jsa.as_scaled_array`` picks (the power of two
    below the leaf's RMS), so the data has an RMS in ``[2**-k, 2**(1-k))``: unit-scaled
    inputs, as a scalified training loop starts from, perturbed by a random power of two
    per leaf. The data is ``value / scale``, exact since the scale is a power of two.
    Integer and boolean leaves (tokens, step counts, PRNG keys) are left plain.
    """

    def scale_leaf(x):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return x if isinstance(x, jax.Array) else jnp.asarray(x)
        x = np.asarray(x)
        unit = jsa.as_scaled_array(x)
        factor = np.float32(2.0 ** exponent())
        return jsa.ScaledArray(jnp.asarray(unit.data / factor), jnp.asarray(unit.scale * factor))

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
    # Dynamic rescaling of every LayerNorm input, forward and backward (the identity on
    # values): where the paper re-centres drifting statistics. See ``layer_norm``.
    rescale_norms: bool = False


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


def layer_norm(x, gain, bias, eps=1e-5, rescale: bool = False):
    """Pre-LayerNorm in plain jnp: mean, variance, rsqrt.

    With ``rescale``, the input's data (forward) and its cotangent's data (backward) are
    re-centred to unit RMS by ``jsa.ops.dynamic_rescale_l2`` / ``dynamic_rescale_l2_grad``.
    Both are the identity on values, and outside scalify.
    """
    if rescale:
        x = jsa.ops.dynamic_rescale_l2_grad(jsa.ops.dynamic_rescale_l2(x))
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * gain + bias


def causal_attention(x, wqkv, wo, heads: int, mask_value: float):
    """Multi-head causal self-attention with batched ``dot_general`` (einsum)."""
    b, t, w = x.shape
    q, k, v = jnp.split(x @ wqkv, 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, w // heads) for a in (q, k, v))
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / float(np.sqrt(w // heads))  # weak type: keeps float16
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(mask, scores, mask_value)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, w)
    return out @ wo


def gpt_logits(params, tokens, cfg: GPTConfig):
    t = tokens.shape[1]
    x = params["tok"][tokens] + params["pos"][:t]  # gather (scatter-add in the gradient)

    norm = functools.partial(layer_norm, rescale=cfg.rescale_norms)

    def block(x, p):
        x = x + causal_attention(norm(x, p["ln1_g"], p["ln1_b"]), p["wqkv"], p["wo"], cfg.heads, cfg.mask_value)
        hidden = jax.nn.gelu(norm(x, p["ln2_g"], p["ln2_b"]) @ p["w1"] + p["b1"])
        return x + hidden @ p["w2"] + p["b2"], None

    x, _ = lax.scan(block, x, params["layers"])
    x = norm(x, params["lnf_g"], params["lnf_b"])
    head = params["tok"].T if cfg.tied else params["head"]
    return x @ head


def gpt_loss(params, tokens, targets, cfg: GPTConfig):
    """Mean next-token cross-entropy on integer targets."""
    logp = jax.nn.log_softmax(gpt_logits(params, tokens, cfg), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def make_adam_step(
    loss_fn, optimizer: optax.GradientTransformation, rescale_grads: bool = False, optimizer_dtype=jnp.float32
):
    """``step(params, opt_state, *batch) -> (loss, params, opt_state)``: value_and_grad, then an optax update.

    With ``rescale_grads``, the gradients go through ``jsa.ops.dynamic_rescale_l2`` before
    the optimizer, as in the library's typical training step: the identity on values (and
    outside scalify), under scalify it re-centres each gradient's data to unit RMS.

    The gradients are cast to ``optimizer_dtype`` before the optimizer (a no-op for float32
    gradients): float16 parameters, activations and gradients with float32 optimizer
    moments, the usual mixed-precision recipe. (Adam computed in float16 divides by
    ``sqrt(nu)`` with no epsilon at all: optax's ``eps=1e-8`` is a weakly typed constant that
    JAX rounds to float16 zero when tracing, and any gradient element whose square
    underflows float16 then gets an infinite update, with or without scalify.)
    ``optax.apply_updates`` casts the new parameters back to the parameters' dtype.
    """

    def step(params, opt_state, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        if rescale_grads:
            grads = jsa.ops.dynamic_rescale_l2(grads)
        grads = jax.tree.map(lambda g: g.astype(optimizer_dtype), grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return step


# --- MLP ---------------------------------------------------------------------------------------
def init_mlp(rng: np.random.Generator, sizes=(8, 16, 16, 4)) -> list[dict]:
    return [
        {"w": _normal(rng, m, n, std=m**-0.5), "b": _normal(rng, n, std=0.1)} for m, n in zip(sizes[:-1], sizes[1:])
    ]


def mlp_loss(params, x, labels):
    """Softmax cross-entropy of a ReLU MLP on integer labels."""
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def mlp_batch(rng: np.random.Generator, n: int = 8, sizes=(8, 16, 16, 4)):
    return _normal(rng, n, sizes[0]), rng.integers(0, sizes[-1], n).astype(np.int32)


def warm_optimizer_state(optimizer: optax.GradientTransformation, params, rng: np.random.Generator, steps: int = 2):
    """``optimizer``'s state after ``steps`` updates with random gradients: non-zero moments, count > 0."""
    state, update = optimizer.init(params), jax.jit(optimizer.update)
    for _ in range(steps):
        grads = jax.tree.map(lambda p: _normal(rng, *np.shape(p), std=0.3), params)
        state = update(grads, state, params)[1]
    return jax.tree.map(np.asarray, state)


def sgd_step(loss_fn, lr: float = 0.05):
    """``step(params, *batch) -> (loss, params)``: value_and_grad and plain SGD."""

    def step(params, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        return loss, jax.tree.map(lambda p, g: p - lr * g, params, grads)

    return step


# --- CNN ---------------------------------------------------------------------------------------
def init_cnn(rng: np.random.Generator, channels: int = 3, width: int = 8, classes: int = 5) -> dict:
    return {
        "conv1": _normal(rng, 3, 3, channels, width, std=(9 * channels) ** -0.5),
        "b1": _normal(rng, width, std=0.1),
        "conv2": _normal(rng, 3, 3, width, width, std=(9 * width) ** -0.5),
        "b2": _normal(rng, width, std=0.1),
        "dense": _normal(rng, 4 * width, classes, std=(4 * width) ** -0.5),
        "bias": _normal(rng, classes, std=0.1),
    }


def cnn_batch(rng: np.random.Generator, n: int = 4, size: int = 8, channels: int = 3, classes: int = 5):
    return _normal(rng, n, size, size, channels), rng.integers(0, classes, n).astype(np.int32)


def _conv(x, w, stride: int = 1):
    return lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def cnn_loss(params, images, labels):
    """conv + ReLU, 2x2 max pool, strided conv + ReLU, 2x2 average pool, dense head, cross-entropy."""
    x = jax.nn.relu(_conv(images, params["conv1"]) + params["b1"])  # (n, 8, 8, c)
    x = lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")  # (n, 4, 4, c)
    x = jax.nn.relu(_conv(x, params["conv2"]) + params["b2"])
    x = lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4.0  # (n, 2, 2, c)
    logits = x.reshape(x.shape[0], -1) @ params["dense"] + params["bias"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


# --- RNN ---------------------------------------------------------------------------------------
def init_rnn(rng: np.random.Generator, inputs: int = 4, hidden: int = 8, outputs: int = 3) -> dict:
    return {
        "w": _normal(rng, hidden, hidden, std=hidden**-0.5),
        "u": _normal(rng, inputs, hidden, std=inputs**-0.5),
        "b": _normal(rng, hidden, std=0.1),
        "h0": _normal(rng, hidden, std=0.5),
        "v": _normal(rng, hidden, outputs, std=hidden**-0.5),
    }


def rnn_batch(rng: np.random.Generator, steps: int = 6, batch: int = 3, inputs: int = 4, outputs: int = 3):
    return _normal(rng, steps, batch, inputs), _normal(rng, steps, batch, outputs)


def rnn_loss(params, xs, ys):
    """Elman RNN (tanh cell) scanned over time; squared error of a linear readout at every step."""

    def cell(h, x):
        h = jnp.tanh(h @ params["w"] + x @ params["u"] + params["b"])
        return h, h @ params["v"]

    h0 = jnp.broadcast_to(params["h0"], (xs.shape[1], params["h0"].shape[0]))
    _, preds = lax.scan(cell, h0, xs)
    return jnp.mean((preds - ys) ** 2)


# --- dropout and rematerialisation -------------------------------------------------------------
def dropout(key, x, rate: float):
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def dropout_remat_loss(params, x, y, key):
    """MLP with dropout (``jax.random`` from a key argument) and a ``jax.checkpoint`` residual block."""
    k1, k2 = jax.random.split(key)
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    h = dropout(k1, h, 0.25)

    @jax.checkpoint
    def block(h):
        return jnp.tanh(h @ params["w2"] + params["b2"]) + h

    h = dropout(jax.random.fold_in(k2, 7), block(h), 0.1)
    return jnp.mean((h @ params["w3"] - y) ** 2)


def init_dropout_model(rng: np.random.Generator, inputs: int = 6, hidden: int = 16, outputs: int = 3) -> dict:
    return {
        "w1": _normal(rng, inputs, hidden, std=inputs**-0.5),
        "b1": _normal(rng, hidden, std=0.1),
        "w2": _normal(rng, hidden, hidden, std=hidden**-0.5),
        "b2": _normal(rng, hidden, std=0.1),
        "w3": _normal(rng, hidden, outputs, std=hidden**-0.5),
    }


# --- control flow inside a differentiated function ---------------------------------------------
def control_flow_loss(params, x):
    """fori_loop (static trip count: a scan), while_loop on stop_gradient values, cond, switch."""
    w, a = params["w"], params["a"]
    h = lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w) + 0.5 * h, x)
    # A data-dependent trip count: halve until max|h| <= 1 (not differentiated through).
    peak = lax.stop_gradient(jnp.max(jnp.abs(h)))
    _, halvings = lax.while_loop(lambda c: c[0] > 1.0, lambda c: (0.5 * c[0], c[1] + 1), (peak, 0))
    h = h * jnp.exp2(-halvings.astype(h.dtype))
    h = lax.cond(jnp.sum(h) > 0, lambda h: h * a, lambda h: jnp.sin(h) - a, h)
    branch = jnp.argmax(jnp.sum(h, axis=0)) % 3
    h = lax.switch(branch, [lambda h: h @ w, jax.nn.sigmoid, lambda h: h * h], h)
    return jnp.mean(h**2)


def init_control_flow_model(rng: np.random.Generator, width: int = 4) -> dict:
    return {"w": _normal(rng, width, width, std=width**-0.5), "a": _normal(rng, width)}
