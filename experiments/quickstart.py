"""Quickstart: train a small MLP with Optax's Adam in float32, in plain float16, and in scaled float16.

Run with ``python -m experiments.quickstart``. The task is synthetic (a random teacher
network labels Gaussian inputs) so nothing is downloaded. All runs start from the same
weights and use ``optax.adam(1e-3)`` with its default ``eps=1e-8``:

- plain float16 (no scales) fails: ``1e-8`` is 0 in float16, so Adam's
  ``m / (sqrt(v) + eps)`` is ``0 / 0`` wherever a gradient entry is 0 and the weights turn
  to NaN after the first step (loss scaling would not help: it is the optimizer's constant);
- the README's recipe (``jsa.optim.scale_state`` around the same Adam, float16 weights and
  inputs as ``ScaledArray``, the step wrapped with ``jsa.scalify``) follows float32.

The script ends with a sentence per run saying what the comparison shows (see
:func:`explain`).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

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


def make_step(tx):
    def step(params, opt_state, x, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, labels)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return step


def make_data(key, n, teacher):
    x = jax.random.normal(key, (n, SIZES[0]))
    return x, jnp.argmax(mlp(teacher, x), axis=-1)


def train(step, params, opt_state, batches, to_value=lambda loss: loss):
    losses = []
    for x, labels in batches:
        loss, params, opt_state = step(params, opt_state, x, labels)
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
            sentences.append(
                f"{name} diverged (the loss became {final}): a value left float16's range (here Adam's "
                "eps = 1e-8, which is 0 in float16, so m / (sqrt(v) + eps) is 0 / 0)."
            )
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
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)

    key = jax.random.PRNGKey(0)
    teacher = init_params(jax.random.PRNGKey(42))
    params = init_params(key)
    keys = jax.random.split(jax.random.PRNGKey(1), args.steps)
    batches = [make_data(k, args.batch, teacher) for k in keys]
    step = jax.jit(make_step(optax.adam(args.lr)))

    results = {}
    start = time.perf_counter()
    results["float32"] = train(step, params, optax.adam(args.lr).init(params), batches)
    params16 = jsa.tree.astype(params, jnp.float16)
    batches16 = [(x.astype(jnp.float16), y) for x, y in batches]
    results["float16 (plain)"] = train(step, params16, optax.adam(args.lr).init(params16), batches16)
    tx = jsa.optim.scale_state(optax.adam(args.lr), jnp.float16)
    scaled_params = jsa.tree.astype(jsa.as_scaled_array(params), jnp.float16)
    scaled_batches = [(jsa.as_scaled_array(x), y) for x, y in batches16]
    results["float16 (scalify)"] = train(
        jax.jit(jsa.scalify(make_step(tx))), scaled_params, tx.init(scaled_params), scaled_batches, float
    )
    elapsed = time.perf_counter() - start

    print(f"MLP {SIZES}, {args.steps} Adam steps of batch {args.batch}, lr {args.lr} ({elapsed:.1f} s)")
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
