"""Optax optimizers with FP16 and FP8 state (``jsa.optim.scale_state``) against FP32, on digits.

Run with ``python -m experiments.optim_state``. The MLP of :mod:`experiments.digits`
(smaller by default) is trained on scikit-learn's digits with Adam, AdamW, AdaBelief, SGD
with momentum and Lion, each with its default ``eps`` and a warmup-cosine schedule, in
these configurations (same initial weights, same batches):

- ``fp32``: plain JAX, float32 weights and optimizer state;
- ``fp16 plain``: float16 weights, gradients and optimizer state, no scalify (the inner
  optimizer's own state, as ``optax`` makes it for float16 parameters);
- ``fp16 scalify``: float16 weights and gradients with power-of-two scales, the state
  stored by ``scale_state(opt, jnp.float16)``;
- FP8 variants (``--fp8``, Adam-family only): the state or one moment stored in
  E4M3/E5M2 through ``scale_state(..., field_dtypes=...)``, with the RMS (``l2``) or the
  maximum (``max``) moved into the scale;
- with ``--storage`` instead: float32 weights and gradients, no scalify, only the state
  narrowed by ``scale_state`` (FP16, bfloat16, FP8 moments): the storage error alone.

It prints the final training loss (mean of the last 10 steps), its difference from FP32,
and the test accuracy. ``--ema`` instead measures how an exponential moving average stored
in each dtype drifts from the float32 one (:func:`ema_storage_error`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_scalify as jsa

from .digits import Run, batches, fit, init_params, load_split, loss_fn

E4M3, E5M2, F16, F32 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float16, jnp.float32
SIZES = (64, 128, 128, 10)
LEARNING_RATES = {"adam": 3e-3, "adamw": 3e-3, "adabelief": 3e-3, "sgd_momentum": 3e-2, "lion": 3e-4}


def make_optimizer(name: str, lr: Any) -> optax.GradientTransformation:
    """The optimizer ``name`` with Optax's default hyperparameters and learning rate ``lr``."""
    return {
        "adam": lambda: optax.adam(lr),
        "adamw": lambda: optax.adamw(lr),
        "adabelief": lambda: optax.adabelief(lr),
        "sgd_momentum": lambda: optax.sgd(lr, momentum=0.9),
        "lion": lambda: optax.lion(lr),
    }[name]()


@dataclasses.dataclass(frozen=True)
class Config:
    """How weights, gradients and the optimizer state are stored."""

    name: str
    dtype: Any = F32  # weights, activations, gradients
    scalify: bool = False
    state: Any = None  # storage dtype for scale_state; None: the inner optimizer's own state
    field_dtypes: tuple = ()  # ((field, dtype), ...)
    rescale: str = "l2"


CONFIGS = (
    Config("fp32"),
    Config("fp16 plain", F16),
    Config("fp16 scalify", F16, True, F16),
)
FIRST_E4M3 = (("mu", E4M3), ("trace", E4M3))  # Adam/AdaBelief/Lion's mu, SGD's momentum
FP8_CONFIGS = (
    Config("fp16 scalify, fp32 state", F16, True, F32),
    Config("1st moment e4m3", F16, True, F16, FIRST_E4M3),
    Config("1st moment e4m3 (max)", F16, True, F16, FIRST_E4M3, "max"),
    Config("1st moment e5m2", F16, True, F16, (("mu", E5M2), ("trace", E5M2))),
    Config("nu e5m2", F16, True, F16, (("nu", E5M2),)),
    Config("nu e4m3", F16, True, F16, (("nu", E4M3),)),
    Config("mu e4m3, nu e5m2", F16, True, F16, (("mu", E4M3), ("nu", E5M2))),
    Config("all e4m3 (max)", F16, True, E4M3, (), "max"),
)

# FP32 compute, only the state narrowed (scale_state outside scalify): the storage error alone.
STORAGE_CONFIGS = (
    Config("fp32, fp16 state", F32, False, F16),
    Config("fp32, bf16 state", F32, False, jnp.bfloat16),
    Config("fp32, 1st moment e4m3", F32, False, F16, FIRST_E4M3),
    Config("fp32, 1st moment e5m2", F32, False, F16, (("mu", E5M2), ("trace", E5M2))),
    Config("fp32, nu e5m2", F32, False, F16, (("nu", E5M2),)),
    Config("fp32, mu e4m3, nu e5m2", F32, False, F16, (("mu", E4M3), ("nu", E5M2))),
)


def train(cfg: Config, opt: optax.GradientTransformation, data: tuple, params32, steps: list) -> dict:
    """Train one configuration; returns the final loss, first non-finite loss and test accuracy."""
    run = Run(cfg.name, cfg.dtype, scalify=cfg.scalify)
    if cfg.state is not None:
        opt = jsa.optim.scale_state(opt, cfg.state, field_dtypes=dict(cfg.field_dtypes), rescale=cfg.rescale)

    def step(params, opt_state, x, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, labels, run)
        updates, opt_state = opt.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    params = jsa.as_scaled_array(params32) if cfg.scalify else params32
    params = jsa.tree.astype(params, cfg.dtype)
    opt_state = opt.init(params)
    result = fit(run, step, params, opt_state, data, steps)
    result["first_nan_step"] = next((i for i, v in enumerate(result["losses"]) if not math.isfinite(v)), None)
    return result


def run_all(args: argparse.Namespace) -> dict[tuple[str, str, str], dict]:
    data = load_split(args.seed)
    params32 = init_params(jax.random.PRNGKey(args.seed), SIZES)
    steps = batches(len(data[0]), args.batch, args.epochs, args.seed)
    configs = CONFIGS + (FP8_CONFIGS if args.fp8 else ())
    if args.storage:
        configs = (CONFIGS[0],) + STORAGE_CONFIGS
    results = {}
    for name in args.optimizers.split(","):
        lr = LEARNING_RATES[name]
        warmup_cosine = optax.warmup_cosine_decay_schedule(0.0, lr, len(steps) // 10, len(steps), lr / 10)
        schedules = {"constant": lr, "warmup-cosine": warmup_cosine}
        for sched_name, sched in ((k, schedules[k]) for k in args.schedules.split(",")):
            for cfg in configs:
                r = train(cfg, make_optimizer(name, sched), data, params32, steps)
                results[(name, sched_name, cfg.name)] = r
                ref = results[(name, sched_name, "fp32")]["final_loss"]
                rel = (r["final_loss"] - ref) / ref
                print(
                    f"{name:<13}{sched_name:<14}{cfg.name:<26}loss {r['final_loss']:<10.4g} "
                    f"vs fp32 {rel:+8.1%}  acc {r['test_accuracy']:.2%}  "
                    f"nan@{r['first_nan_step']}  {r['seconds']:.1f}s",
                    flush=True,
                )
    return results


def ema_storage_error(steps: int = 3000, size: int = 4096, seed: int = 0) -> dict[tuple[float, str], dict]:
    """How far an EMA stored by ``scale_state`` drifts from the float32 one, per storage dtype.

    ``optax.ema(b, debias=False)`` is fed ``g`` (first moment, ``b = 0.9``) or ``g**2``
    (second moment, ``b = 0.999``), ``g`` Gaussian with per-entry magnitudes spread over
    ``2**-4 .. 2**4``. Returns, per ``(b, dtype)``, the median and 90th percentile of the
    relative error after ``steps`` steps, the fraction of entries stored as 0, and the mean
    ratio to the float32 EMA minus 1 (its bias).
    """
    rng = np.random.default_rng(seed)
    magnitude = (2.0 ** rng.uniform(-4, 4, size)).astype(np.float32)
    noise = np.random.default_rng(seed + 1).standard_normal((steps, size)).astype(np.float32)
    results = {}
    for decay, squared in ((0.9, False), (0.999, True)):
        inputs = jnp.asarray(np.square(noise * magnitude) if squared else noise * magnitude)
        ref = optax.ema(decay, debias=False)
        ref_state = jax.lax.scan(lambda s, x, ref=ref: (ref.update(x, s)[1], None), ref.init(inputs[0]), inputs)[0]
        for dtype in (F16, jnp.bfloat16, E4M3, E5M2):
            tx = jsa.optim.scale_state(ref, dtype)
            update = jax.jit(tx.update)
            state = tx.init(inputs[0])
            for x in inputs:
                state = update(x, state)[1]
            got = np.asarray(state.ema.to_array(jnp.float32))
            want = np.asarray(ref_state.ema)
            rel = np.abs(got - want) / np.abs(want)
            results[(decay, np.dtype(dtype).name)] = {
                "median_rel_error": float(np.median(rel)),
                "p90_rel_error": float(np.quantile(rel, 0.9)),
                "zero_fraction": float(np.mean(got == 0)),
                "bias": float(np.mean(got / want) - 1),
            }
            r = results[(decay, np.dtype(dtype).name)]
            print(
                f"EMA b={decay:<6} {'g**2' if squared else 'g':<5}{np.dtype(dtype).name:<15}"
                f"median rel err {r['median_rel_error']:<9.3g} p90 {r['p90_rel_error']:<9.3g}"
                f"zeros {r['zero_fraction']:<8.2%} bias {r['bias']:+.3g}",
                flush=True,
            )
    return results


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = ",".join(LEARNING_RATES)
    p.add_argument("--optimizers", default=names, help="comma-separated: " + names)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedules", default="constant,warmup-cosine", help="comma-separated: constant,warmup-cosine")
    p.add_argument("--fp8", action="store_true", help="add the FP8 state variants")
    p.add_argument("--storage", action="store_true", help="only FP32 compute with the state narrowed (no scalify)")
    p.add_argument("--ema", action="store_true", help="only measure the storage error of an EMA per dtype")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.ema:
        ema_storage_error(seed=args.seed)
    else:
        run_all(args)


if __name__ == "__main__":
    main()
