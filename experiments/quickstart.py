"""Quickstart: train a small MLP in float32, then in scaled float16 with jsa.scalify.

Run with ``python -m experiments.quickstart``. The task is synthetic (a random teacher
network labels Gaussian inputs) so nothing is downloaded. Both runs start from the same
weights; the scaled float16 run keeps weights, activations and gradients in float16 with
power-of-two scales and no loss scaling. A third run in plain float16 (no scales) shows
how far float16 alone gets on the same task; the script ends with a sentence per run saying
what the comparison shows (see :func:`explain`). On this task plain float16 trains too: its
values stay within float16's range, so the demo shows that scalify follows float32, not a
failure of float16 (the FP8 GPT experiment of docs/experiments.md shows one).
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_scalify as jsa

SIZES = (32, 128, 128, 10)


def init_params(key, sizes=SIZES):
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        key, sub = jax.random.split(key)
        w = jax.random.normal(sub, (fan_in, fan_out)) / np.sqrt(fan_in)
        params.append({"w": w, "b": jnp.full((fan_out,), 0.01)})
    return params


def mlp(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, labels):
    logp = jax.nn.log_softmax(mlp(params, x).astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def make_step(lr):
    def step(params, x, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, labels)
        # Unit-scaling rules predict the size of gradients from their shapes; a dynamic
        # rescale corrects that prediction with the measured RMS (a no-op outside scalify).
        grads = jsa.ops.dynamic_rescale_l2(grads)
        return loss, jax.tree.map(lambda p, g: p - lr * g, params, grads)

    return step


def make_data(key, n, teacher):
    x = jax.random.normal(key, (n, SIZES[0]))
    return x, jnp.argmax(mlp(teacher, x), axis=-1)


def train(step, params, batches, to_value=lambda loss: loss):
    losses = []
    for x, labels in batches:
        loss, params = step(params, x, labels)
        losses.append(float(to_value(loss)))
    return losses


def explain(results: dict[str, list[float]], tolerance: float = 0.01) -> list[str]:
    """One sentence per run on how its final loss compares with float32's (computed from ``results``).

    Final losses within ``tolerance`` (1% by default) of float32's count as "the same".
    """
    ref = float(np.mean(results["float32"][-10:]))
    sentences = []
    for name, losses in results.items():
        if name == "float32":
            continue
        final = float(np.mean(losses[-10:]))
        if not np.isfinite(final):
            sentences.append(f"{name} diverged (the loss became {final}): values left float16's range.")
            continue
        gap = (final - ref) / ref
        if abs(gap) <= tolerance:
            why = (
                "the scales keep weights, activations and gradients near unit size in float16"
                if "scalify" in name
                else "this task's values stay inside float16's range (about 6e-8 to 65504), so scales are not needed here"
            )
            sentences.append(f"{name} ends within {abs(gap):.2%} of float32: {why}.")
        else:
            sentences.append(f"{name} ends {gap:+.2%} from float32: float16 rounding or range changed the training.")
    return sentences


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args(argv)

    key = jax.random.PRNGKey(0)
    teacher = init_params(jax.random.PRNGKey(42))
    params = init_params(key)
    keys = jax.random.split(jax.random.PRNGKey(1), args.steps)
    batches = [make_data(k, args.batch, teacher) for k in keys]
    step = make_step(args.lr)

    results = {}
    start = time.perf_counter()
    results["float32"] = train(jax.jit(step), params, batches)
    results["float16 (plain)"] = train(jax.jit(step), jsa.tree.astype(params, jnp.float16), [(x.astype(jnp.float16), y) for x, y in batches])
    scaled_params = jsa.tree.astype(jsa.as_scaled_array(params), jnp.float16)
    scaled_batches = [(jsa.as_scaled_array(x.astype(jnp.float16)), y) for x, y in batches]
    results["float16 (scalify)"] = train(
        jax.jit(jsa.scalify(step)), scaled_params, scaled_batches, lambda loss: loss.to_array(jnp.float32)
    )
    elapsed = time.perf_counter() - start

    print(f"MLP {SIZES}, {args.steps} SGD steps of batch {args.batch}, lr {args.lr} ({elapsed:.1f} s)")
    print(f"{'run':<20}{'first loss':>12}{'final loss':>12}{'vs float32':>12}")
    ref = np.mean(results["float32"][-10:])
    for name, losses in results.items():
        final = np.mean(losses[-10:])
        print(f"{name:<20}{losses[0]:>12.4f}{final:>12.4f}{(final - ref) / ref:>+12.2%}")
    for sentence in explain(results):
        print(sentence)
    return results


if __name__ == "__main__":
    main()
