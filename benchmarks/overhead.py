"""Overhead of scalify: a scalified training step against the same step under plain jax.jit.

Run: ``python -m benchmarks.overhead`` (``--quick`` for a short run). Prints, for each
benchmark, the median runtime of both steps (interleaved A/B timing in one process), the
median trace+lower+compile time of both (wall clock, and CPU time of the process, which other
processes on the machine disturb less), and their ratios. The last column, "const", is the
compile CPU-time ratio of the scalified step with its input scales fixed at trace time (see
:func:`with_constant_scales`): what remains when the scale arithmetic that depends only on
input scales folds away. The column "static" is the compile CPU-time ratio of the step under
:meth:`jsa.RescalePolicy.static`, and "floor" is the compile CPU-time ratio of the step under
the static policy that also computes the statistics of the state it returns (see
:func:`with_state_statistics`): what any policy that re-estimates the state's scales from its
data costs at least.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_scalify as jsa

from .common import compile_times, interleaved_compile_medians, interleaved_medians


# --- MLP 784-1024-1024-1024-10, batch 256, SGD -------------------------------------------------
def mlp_init(key, sizes=(784, 1024, 1024, 1024, 10)):
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        key, sub = jax.random.split(key)
        params.append({"w": jax.random.normal(sub, (fan_in, fan_out)) / np.sqrt(fan_in), "b": jnp.zeros(fan_out)})
    return params


def mlp_loss(params, x, labels):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    logits = (x @ params[-1]["w"] + params[-1]["b"]).astype(jnp.float32)
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * labels, axis=-1))


def mlp_step(params, x, labels):
    loss, grads = jax.value_and_grad(mlp_loss)(params, x, labels)
    return loss, jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)


def mlp_inputs(dtype):
    key = jax.random.PRNGKey(0)
    params = jsa.tree.astype(mlp_init(key), dtype)
    x = jax.random.normal(key, (256, 784)).astype(dtype)
    labels = jax.nn.one_hot(jax.random.randint(key, (256,), 0, 10), 10, dtype=dtype)
    return params, x, labels


# --- 4-layer GPT step, lax.scan over layers, Adam --------------------------------------------
GPT = dict(vocab=256, seq=128, width=256, heads=4, layers=4, batch=8)


def gpt_init(key, vocab, seq, width, heads, layers, batch):
    ks = jax.random.split(key, 8)
    normal = lambda k, shape, fan_in: jax.random.normal(k, shape) / np.sqrt(fan_in)
    return {
        "embed": normal(ks[0], (vocab, width), 1.0) * 0.02,
        "pos": normal(ks[1], (seq, width), 1.0) * 0.02,
        "layers": {
            "ln1": jnp.ones((layers, width)),
            "qkv": normal(ks[2], (layers, width, 3 * width), width),
            "proj": normal(ks[3], (layers, width, width), width),
            "ln2": jnp.ones((layers, width)),
            "up": normal(ks[4], (layers, width, 4 * width), width),
            "down": normal(ks[5], (layers, 4 * width, width), 4 * width),
        },
        "ln_f": jnp.ones((width,)),
    }


def layer_norm(x, gain):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype) * gain


def gpt_block(x, p, heads):
    b, t, d = x.shape
    h = layer_norm(x, p["ln1"])
    q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
    mask = jnp.tril(jnp.ones((t, t), bool))
    attn = jax.nn.softmax(jnp.where(mask, logits.astype(jnp.float32), -1e9), axis=-1).astype(x.dtype)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, t, d) @ p["proj"]
    h = layer_norm(x, p["ln2"])
    return x + jax.nn.gelu(h @ p["up"]) @ p["down"]


def gpt_loss(params, tokens, heads=GPT["heads"]):
    x = params["embed"][tokens[:, :-1]] + params["pos"][: tokens.shape[1] - 1]
    x, _ = jax.lax.scan(lambda h, p: (gpt_block(h, p, heads), None), x, params["layers"])
    logits = (layer_norm(x, params["ln_f"]) @ params["embed"].T).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


OPT = optax.adam(1e-3)


def gpt_step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(gpt_loss)(params, tokens)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), opt_state


def gpt_inputs(dtype):
    key = jax.random.PRNGKey(0)
    params = jsa.tree.astype(gpt_init(key, **GPT), dtype)
    tokens = jax.random.randint(key, (GPT["batch"], GPT["seq"] + 1), 0, GPT["vocab"])
    return params, OPT.init(params), tokens


def with_constant_scales(step, policy=None):
    """``step`` scalified with every floating input at scale 1 fixed at trace time (a NumPy scale).

    The scale arithmetic that depends only on input scales then folds in Python and emits
    nothing; the data path is the scalified one, and so is the scale arithmetic of loop
    carries and of traced scalars (e.g. Adam's bias corrections). Its compile time bounds
    what a cheaper scale arithmetic could reach. A diagnostic only: a real training step
    needs traced scales.
    """

    def constant_scaled_step(*args):
        fixed = jax.tree.map(
            lambda x: jsa.ScaledArray(x, np.float32(1)) if jnp.issubdtype(x.dtype, jnp.floating) else x, args
        )
        return jsa.scalify(step, policy=policy)(*fixed)

    return constant_scaled_step


def _sampled(data, per_axis=32):
    """A strided sample of ``data``: at most ``per_axis`` entries along each axis."""
    return data[tuple(slice(None, None, max(1, n // per_axis)) for n in data.shape)]


def with_state_statistics(step):
    """``step`` under the static policy, also returning the sampled mean square of each floating value it returns.

    The statistics are those the default policy reads for the values it rescales on
    return (a strided sample of at most 32 entries per axis, squared and averaged in
    float32), computed outside the scalified function and nothing done with them: no scale
    arithmetic, no data rescaled, and none of the gradients' or contractions' statistics.
    Its compile time is a floor under any policy that re-estimates the returned state's
    scales from its data, whatever form its scale arithmetic takes.
    """
    static_step = jsa.scalify(step, policy=jsa.RescalePolicy.static())

    def step_and_statistics(*args):
        out = static_step(*args)
        values = [
            leaf for leaf in jax.tree.leaves(out, is_leaf=jsa.is_scaled_leaf) if isinstance(leaf, jsa.ScaledArray)
        ]
        return out, [jnp.mean(jnp.square(_sampled(v.data).astype(jnp.float32))) for v in values]

    return step_and_statistics


# --- running ---------------------------------------------------------------------------------
def compare(name, step, inputs, rounds, compile_rounds, policy=None):
    """Runtime and compile time of ``step``, plain and scalified (with the rescale ``policy``)."""
    plain = jax.jit(step)
    scaled_step = jax.jit(jsa.scalify(step, policy=policy))
    scaled_inputs = jsa.as_scaled_array(inputs)
    times = interleaved_medians(
        {"plain": lambda: plain(*inputs), "scalify": lambda: scaled_step(*scaled_inputs)}, rounds
    )
    compiles = interleaved_compile_medians(
        {
            "plain": lambda: compile_times(step, *inputs),
            "scalify": lambda: compile_times(jsa.scalify(step, policy=policy), *scaled_inputs),
            "const": lambda: compile_times(with_constant_scales(step, policy), *inputs),
            "static": lambda: compile_times(jsa.scalify(step, policy=jsa.RescalePolicy.static()), *scaled_inputs),
            "floor": lambda: compile_times(with_state_statistics(step), *scaled_inputs),
        },
        compile_rounds,
    )
    row = {
        "benchmark": name,
        "plain_ms": 1e3 * times["plain"],
        "scalify_ms": 1e3 * times["scalify"],
        "runtime_ratio": times["scalify"] / times["plain"],
        "plain_compile_s": compiles["plain"][0],
        "scalify_compile_s": compiles["scalify"][0],
        "compile_ratio": compiles["scalify"][0] / compiles["plain"][0],
        "plain_compile_cpu_s": compiles["plain"][1],
        "scalify_compile_cpu_s": compiles["scalify"][1],
        "compile_cpu_ratio": compiles["scalify"][1] / compiles["plain"][1],
        "const_scales_compile_cpu_s": compiles["const"][1],
        "const_scales_compile_cpu_ratio": compiles["const"][1] / compiles["plain"][1],
        "static_compile_cpu_s": compiles["static"][1],
        "static_compile_cpu_ratio": compiles["static"][1] / compiles["plain"][1],
        "statistics_floor_compile_cpu_s": compiles["floor"][1],
        "statistics_floor_compile_cpu_ratio": compiles["floor"][1] / compiles["plain"][1],
    }
    print(
        f"{name:<16}{row['plain_ms']:>10.2f}{row['scalify_ms']:>12.2f}{row['runtime_ratio']:>9.3f}"
        f"{row['plain_compile_s']:>11.2f}{row['scalify_compile_s']:>13.2f}{row['compile_ratio']:>9.2f}"
        f"{row['plain_compile_cpu_s']:>10.2f}{row['scalify_compile_cpu_s']:>12.2f}{row['compile_cpu_ratio']:>9.2f}"
        f"{row['const_scales_compile_cpu_ratio']:>9.2f}{row['static_compile_cpu_ratio']:>9.2f}{row['statistics_floor_compile_cpu_ratio']:>9.2f}",
        flush=True,
    )
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--only", help="comma-separated subset of benchmark names")
    parser.add_argument(
        "--policy",
        choices=("default", "static"),
        default="default",
        help="rescale policy of the scalified step (jsa.RescalePolicy() or RescalePolicy.static())",
    )
    args = parser.parse_args(argv)
    policy = jsa.RescalePolicy.static() if args.policy == "static" else jsa.RescalePolicy()
    rounds, compile_rounds = (5, 2) if args.quick else (30, 5)
    benches = {
        "mlp_fp32": (mlp_step, lambda: mlp_inputs(jnp.float32)),
        "mlp_fp16": (mlp_step, lambda: mlp_inputs(jnp.float16)),
        "gpt_fp32": (gpt_step, lambda: gpt_inputs(jnp.float32)),
        "gpt_fp16": (gpt_step, lambda: gpt_inputs(jnp.float16)),
    }
    if args.only:
        benches = {k: v for k, v in benches.items() if k in args.only.split(",")}
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {rounds} interleaved rounds, {args.policy} policy")
    print(
        f"{'benchmark':<16}{'plain ms':>10}{'scalify ms':>12}{'ratio':>9}{'plain cmp':>11}{'scalify cmp':>13}"
        f"{'ratio':>9}{'plain cpu':>10}{'scalify cpu':>12}{'ratio':>9}{'const':>9}{'static':>9}{'floor':>9}"
    )
    rows = [compare(name, step, make(), rounds, compile_rounds, policy) for name, (step, make) in benches.items()]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
