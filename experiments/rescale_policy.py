"""A small CNN with BatchNorm trained by SGD with momentum in FP16, under each rescale policy.

Run with ``python -m experiments.rescale_policy --out docs/images``. The model (two 3x3
convolutions, each followed by batch normalisation, ReLU and 2x2 max pooling, then a dense
classifier) and its training step (``jax.value_and_grad`` of the softmax cross-entropy, then
``optax.sgd(0.1, momentum=0.9)``) are plain JAX, written without scalify in mind. The step
is trained for a few steps plainly in FP16, and under ``jsa.scalify`` with the static
policy (the paper's pure static propagation) and with the default policy; the losses and
the largest parameter scale are printed per step. With ``--out``, the scales of every value
of the step after ``--chart-step`` steps are charted for both policies
(``jsa.analysis.record_scales``), into ``rescale_policy_static.png`` and
``rescale_policy_default.png``.
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_scalify as jsa

LEARNING_RATE, MOMENTUM = 0.1, 0.9
OPTIMIZER = optax.sgd(LEARNING_RATE, momentum=MOMENTUM)
POLICIES = {"static": jsa.RescalePolicy.static(), "default": jsa.RescalePolicy()}


def init_params(key: jax.Array, channels: tuple[int, int] = (8, 16), classes: int = 10, size: int = 16) -> dict:
    k1, k2, k3 = jax.random.split(key, 3)
    c1, c2 = channels
    flat = c2 * (size // 4) ** 2
    return {
        "conv1": jax.random.normal(k1, (3, 3, 1, c1)) / 3.0,
        "bn1_gain": jnp.ones(c1),
        "bn1_bias": jnp.zeros(c1),
        "conv2": jax.random.normal(k2, (3, 3, c1, c2)) / np.sqrt(9 * c1),
        "bn2_gain": jnp.ones(c2),
        "bn2_bias": jnp.zeros(c2),
        "dense": jax.random.normal(k3, (flat, classes)) / np.sqrt(flat),
        "dense_bias": jnp.zeros(classes),
    }


def batch_norm(x, gain, bias, eps: float = 1e-5):
    """Training-mode batch normalisation over batch and spatial axes (NHWC)."""
    mean = jnp.mean(x, axis=(0, 1, 2))
    var = jnp.var(x, axis=(0, 1, 2))
    return (x - mean) * jax.lax.rsqrt(var + eps) * gain + bias


def conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def max_pool(x):
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def loss_fn(params, images, labels):
    h = max_pool(jax.nn.relu(batch_norm(conv(images, params["conv1"]), params["bn1_gain"], params["bn1_bias"])))
    h = max_pool(jax.nn.relu(batch_norm(conv(h, params["conv2"]), params["bn2_gain"], params["bn2_bias"])))
    logits = h.reshape(h.shape[0], -1) @ params["dense"] + params["dense_bias"]
    return optax.softmax_cross_entropy(logits.astype(jnp.float32), labels).mean()


def train_step(params, opt_state, images, labels):
    loss, grads = jax.value_and_grad(loss_fn)(params, images, labels)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), opt_state


def make_problem(dtype=jnp.float16, batch: int = 32, size: int = 16, classes: int = 10):
    """Parameters, optimizer state and one fixed batch (the loss must fall on it)."""
    key = jax.random.PRNGKey(0)
    params = jsa.tree.astype(init_params(key, classes=classes, size=size), dtype)
    images = jax.random.normal(jax.random.fold_in(key, 1), (batch, size, size, 1)).astype(dtype)
    labels = jax.nn.one_hot(jax.random.randint(jax.random.fold_in(key, 2), (batch,), 0, classes), classes)
    return params, OPTIMIZER.init(params), images, labels


def _value(x) -> float:
    return float(x.to_array() if isinstance(x, jsa.ScaledArray) else x)


def _max_log2_scale(tree) -> float:
    scales = [
        float(np.log2(x.scale))
        for x in jax.tree.leaves(tree, is_leaf=jsa.is_scaled_leaf)
        if isinstance(x, jsa.ScaledArray)
    ]
    return max(scales) if scales else 0.0


def train(mode: str, steps: int, dtype=jnp.float16):
    """``(losses, max log2 parameter scale per step, final state)`` for mode ``plain``, ``static`` or ``default``."""
    params, opt_state, images, labels = make_problem(dtype)
    if mode == "plain":
        step = jax.jit(train_step)
    else:
        step = jax.jit(jsa.scalify(train_step, policy=POLICIES[mode]))
        params, opt_state = jsa.as_scaled_array((params, opt_state))
    losses, scales = [], []
    for _ in range(steps):
        loss, params, opt_state = step(params, opt_state, images, labels)
        losses.append(_value(loss))
        scales.append(_max_log2_scale(params))
    return losses, scales, (params, opt_state, images, labels)


def chart(mode: str, chart_step: int, out: pathlib.Path) -> jsa.analysis.ScaleReport:
    """Record and chart the scales of step ``chart_step + 1`` under the policy ``mode``."""
    _, _, state = train(mode, chart_step)
    report = jsa.analysis.record_scales(jsa.scalify(train_step, policy=POLICIES[mode]), *state)
    title = f"FP16 CNN + BatchNorm, SGD momentum, step {chart_step + 1}: {mode} policy"
    report.plot(out / f"rescale_policy_{mode}.png", title=title)
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=pathlib.Path, help="write the scale charts to this folder")
    parser.add_argument("--chart-step", type=int, default=3, help="chart the step after this many steps")
    args = parser.parse_args(argv)
    for mode in ("plain", "static", "default"):
        losses, scales = train(mode, args.steps)[:2]
        print(f"{mode:>8}: loss " + " ".join(f"{x:.4f}" for x in losses))
        if mode != "plain":
            print(f"{'':>8}  max log2 parameter scale " + " ".join(f"{s:.0f}" for s in scales))
    if args.out:
        for mode in POLICIES:
            report = chart(mode, args.chart_step, args.out)
            print(f"{mode}: {len(report)} values charted in {args.out}/rescale_policy_{mode}.png")


if __name__ == "__main__":
    main()
