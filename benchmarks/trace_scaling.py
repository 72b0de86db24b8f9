"""Scalify trace time against depth: a GPT-style block in an unrolled Python loop of L layers.

Run: ``python -m benchmarks.trace_scaling`` (``--layers 2,4,8,16``, ``--repeat 3``).

For each depth it times ``jax.jit(step).trace(...)`` (tracing only: no lowering, no XLA) of
the plain training step and of ``jsa.scalify(step)``, with JAX's caches cleared before every
trace, and counts the equations of both jaxprs. It then fits ``seconds = a + b * layers`` by
least squares and prints the slope (seconds per layer), the intercept and R^2: a linear trace
time (R^2 close to 1, no growth of the per-layer cost with depth) means that the interpreter
and the rules do a constant amount of work per equation.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_scalify as jsa

WIDTH, HEADS, SEQ, BATCH, VOCAB = 64, 4, 32, 4, 64


def init(key, layers: int) -> dict:
    normal = lambda k, shape, fan_in: jax.random.normal(k, shape) / np.sqrt(fan_in)  # noqa: E731
    keys = jax.random.split(key, 4 * layers + 1)
    blocks = []
    for i in range(layers):
        k = keys[4 * i : 4 * i + 4]
        blocks.append(
            {
                "ln1": jnp.ones((WIDTH,)),
                "qkv": normal(k[0], (WIDTH, 3 * WIDTH), WIDTH),
                "proj": normal(k[1], (WIDTH, WIDTH), WIDTH),
                "ln2": jnp.ones((WIDTH,)),
                "up": normal(k[2], (WIDTH, 4 * WIDTH), WIDTH),
                "down": normal(k[3], (4 * WIDTH, WIDTH), 4 * WIDTH),
            }
        )
    return {"embed": normal(keys[-1], (VOCAB, WIDTH), 1.0) * 0.02, "blocks": blocks}


def layer_norm(x, gain):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * gain


def block(x, p):
    b, t, d = x.shape
    q, k, v = jnp.split(layer_norm(x, p["ln1"]) @ p["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, HEADS, d // HEADS) for a in (q, k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // HEADS)
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v).reshape(b, t, d) @ p["proj"]
    return x + jax.nn.gelu(layer_norm(x, p["ln2"]) @ p["up"]) @ p["down"]


def loss_fn(params, tokens):
    x = params["embed"][tokens[:, :-1]]
    for p in params["blocks"]:  # unrolled: every layer is traced again
        x = block(x, p)
    logp = jax.nn.log_softmax(x @ params["embed"].T)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def step(params, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    return loss, jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)


def count_eqns(jaxpr) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += count_eqns(getattr(sub, "jaxpr", sub))
    return n


def trace_seconds(fn, *args) -> tuple[float, int]:
    jax.clear_caches()
    start = time.perf_counter()
    traced = jax.jit(fn).trace(*args)
    return time.perf_counter() - start, count_eqns(traced.jaxpr.jaxpr)


def linear_fit(xs, ys) -> tuple[float, float, float]:
    """Least-squares ``y = a + b x``: returns ``(a, b, r2)``."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    b, a = np.polyfit(xs, ys, 1)
    residual = ys - (a + b * xs)
    total = ys - ys.mean()
    r2 = 1.0 - float(residual @ residual) / float(total @ total) if float(total @ total) > 0 else 1.0
    return float(a), float(b), r2


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2,4,8,16", help="comma-separated depths")
    parser.add_argument("--repeat", type=int, default=3, help="traces per depth (median)")
    args = parser.parse_args(argv)
    depths = [int(n) for n in args.layers.split(",")]
    key = jax.random.PRNGKey(0)
    tokens = jax.random.randint(key, (BATCH, SEQ + 1), 0, VOCAB)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; width {WIDTH}, {args.repeat} traces per depth (median)")
    print(
        f"{'layers':>6}{'plain s':>10}{'scalify s':>11}{'ratio':>8}{'s/layer':>10}{'plain eqns':>12}{'scalify eqns':>14}"
    )
    rows = []
    for layers in depths:
        params = init(key, layers)
        scaled = jsa.as_scaled_array(params)
        plain, scal = [], []
        for _ in range(args.repeat):
            plain.append(trace_seconds(step, params, tokens))
            scal.append(trace_seconds(jsa.scalify(step), scaled, tokens))
        p = statistics.median(t for t, _ in plain)
        s = statistics.median(t for t, _ in scal)
        rows.append((layers, p, s))
        print(
            f"{layers:>6}{p:>10.3f}{s:>11.3f}{s / p:>8.2f}{s / layers:>10.4f}{plain[0][1]:>12}{scal[0][1]:>14}",
            flush=True,
        )
    for name, column in (("plain", 1), ("scalify", 2)):
        a, b, r2 = linear_fit([r[0] for r in rows], [r[column] for r in rows])
        print(f"fit {name:<8} seconds = {a:.4f} + {b:.4f} * layers   (R^2 = {r2:.4f})")


if __name__ == "__main__":
    main()
