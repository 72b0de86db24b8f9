"""Scale analysis of a GPT block training step in scaled FP16: static scales, manual rescales, default policy.

Run with ``python -m experiments.scale_analysis --out docs/images``. The model is a small
GPT (token and position embeddings, one pre-LayerNorm transformer block with causal
attention and a GELU MLP, a final LayerNorm and a tied output head) in plain JAX; the
training step is ``jax.value_and_grad`` of the cross-entropy followed by an SGD update.
It is recorded with ``jsa.analysis.record_scales`` in scaled FP16 three times: under the
paper's pure static propagation (``RescalePolicy.static()``) as written ("before"); the
same with ``jsa.ops.dynamic_rescale_l2_grad`` on the input of every LayerNorm ("after",
the paper's algorithm 5: the gradient flowing back through each LayerNorm is rescaled to
unit RMS); and under scalify's default rescale policy as written ("default"). The charts
are saved, and the text summaries printed.
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp

import jax_scalify as jsa

CONFIG = dict(vocab=128, seq=32, width=64, heads=4, batch=8)
LEARNING_RATE = 0.1
LOW_LOG2 = -10.0  # the summaries count values whose data RMS is below 2**LOW_LOG2


def init_params(key: jax.Array, vocab: int, seq: int, width: int, **_) -> dict:
    """Unit-scaling style initialisation: matmul weights of variance 1/fan_in."""
    ks = jax.random.split(key, 6)

    def normal(k, shape, std):
        return jax.random.normal(k, shape) * std

    return {
        "embed": normal(ks[0], (vocab, width), 1.0),
        "pos": normal(ks[1], (seq, width), 1.0),
        "ln1": jnp.ones((width,)),
        "qkv": normal(ks[2], (width, 3 * width), width**-0.5),
        "proj": normal(ks[3], (width, width), width**-0.5),
        "ln2": jnp.ones((width,)),
        "up": normal(ks[4], (width, 4 * width), width**-0.5),
        "down": normal(ks[5], (4 * width, width), (4 * width) ** -0.5),
        "ln_f": jnp.ones((width,)),
    }


def layer_norm(x: jax.Array, gain: jax.Array, rescale_grad: bool) -> jax.Array:
    """LayerNorm over the last axis; optionally rescale the gradient of its input."""
    if rescale_grad:
        x = jsa.ops.dynamic_rescale_l2_grad(x)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centred = x - mean
    var = jnp.mean(jnp.square(centred), axis=-1, keepdims=True)
    return centred * jax.lax.rsqrt(var + 1e-5) * gain


def attention(h: jax.Array, params: dict, heads: int) -> jax.Array:
    """Causal multi-head self-attention (softmax in float32)."""
    b, t, d = h.shape
    q, k, v = jnp.split(h @ params["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (d // heads) ** -0.5
    mask = jnp.tril(jnp.ones((t, t), bool))
    weights = jax.nn.softmax(jnp.where(mask, logits.astype(jnp.float32), -jnp.inf), axis=-1).astype(h.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d) @ params["proj"]


def mlp(h: jax.Array, params: dict) -> jax.Array:
    """GELU MLP, 4x wide."""
    return jax.nn.gelu(h @ params["up"]) @ params["down"]


def loss_fn(params: dict, tokens: jax.Array, heads: int, rescale_grad: bool) -> jax.Array:
    """Next-token cross-entropy of a one-block GPT (output head tied to the embedding, 1/sqrt(width))."""
    x = params["embed"][tokens[:, :-1]] + params["pos"][: tokens.shape[1] - 1]
    x = x + attention(layer_norm(x, params["ln1"], rescale_grad), params, heads)
    x = x + mlp(layer_norm(x, params["ln2"], rescale_grad), params)
    width = x.shape[-1]
    logits = (layer_norm(x, params["ln_f"], rescale_grad) @ params["embed"].T * width**-0.5).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def make_step(heads: int, rescale_grad: bool):
    """The training step: loss and gradients, then an SGD update."""

    def step(params: dict, tokens: jax.Array):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, heads, rescale_grad)
        return loss, jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)

    return step


def make_inputs(seed: int = 0) -> tuple[dict, jax.Array]:
    """Scaled FP16 parameters and a batch of random tokens."""
    key_params, key_tokens = jax.random.split(jax.random.PRNGKey(seed))
    params = jsa.tree.astype(jsa.as_scaled_array(init_params(key_params, **CONFIG)), jnp.float16)
    shape = (CONFIG["batch"], CONFIG["seq"] + 1)
    return params, jax.random.randint(key_tokens, shape, 0, CONFIG["vocab"])


def analyse(rescale_grad: bool, policy: jsa.RescalePolicy) -> jsa.analysis.ScaleReport:
    """Record the scales of one jitted training step under ``policy``."""
    params, tokens = make_inputs()
    return jsa.analysis.record_scales(
        jsa.scalify(make_step(CONFIG["heads"], rescale_grad), policy=policy), params, tokens
    )


def describe(name: str, report: jsa.analysis.ScaleReport) -> None:
    """Print the summary of a report and the backward values with the most subnormal data."""
    loss = float(jsa.asarray(report.outputs[0]))
    print(f"== {name}: {len(report)} values recorded, loss {loss:.4f}")
    print(report.summary(low=LOW_LOG2))
    worst = sorted(report.select("backward"), key=lambda r: -r.frac_underflow)[:5]
    print("backward values with the most subnormal data:")
    print(jsa.analysis.ScaleReport(worst).to_table())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/images", help="folder for the three PNG charts")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    runs = {
        "before": (False, jsa.RescalePolicy.static(), "static scales, as written"),
        "after": (True, jsa.RescalePolicy.static(), "static scales, dynamic_rescale_l2_grad on the LayerNorm inputs"),
        "default": (False, jsa.RescalePolicy(), "default rescale policy, as written"),
    }
    for name, (rescale, policy, what) in runs.items():
        report = analyse(rescale, policy)
        describe(name, report)
        path = report.plot(out / f"scales_gpt_block_{name}.png", title=f"GPT block training step, scaled FP16, {what}")
        print(f"chart: {path} ({path.stat().st_size / 1024:.0f} KB)\n")


if __name__ == "__main__":
    main()
