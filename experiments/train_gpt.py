"""Train the small GPT on a character corpus in FP32, FP16, BF16, FP8 — with and without scalify.

Reproduces the configurations of table 3 of "Scalify" (Balança et al., 2024) next to the
usual alternatives:

    python -m experiments.train_gpt --data ../shared/data/tinyshakespeare.txt \
        --configs main --steps 300 --eval-every 50 --out docs/experiments

For each configuration (``--configs`` takes ``all``, a group of ``GROUPS`` or a
comma-separated list of the names in ``CONFIGS``) it trains from the same initial weights
on the same batches, evaluates the validation loss on a fixed set of batches every
``--eval-every`` steps and at the end, and writes ``gpt_results.json`` (dtypes, losses,
curves, time per step, divergence) and ``gpt_loss_curves.png`` into ``--out``, then prints
a table. Scalified configurations run ``jax.jit(jsa.scalify(update, policy=...))``, the
others ``jax.jit(update)``.

Two recipes of scalify are compared:

- ``scalify_*`` (the README recipe): the default rescale policy and no rescale call
  anywhere in the model or the update; FP16 Adam moments are stored with
  ``jsa.optim.scale_state``;
- ``scalify_*_manual`` (the paper's placement): the static policy, a dynamic rescale of
  every LayerNorm input gradient, and for FP16 moments a hand-written wrapper that rescales
  the weight gradients and the moments (``stored_in``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_scalify as jsa

from . import data as data_lib
from .gpt import GPTConfig, Precision, init_params, loss_fn

try:
    from tqdm import tqdm
except ImportError:  # progress bars are optional (pip install -e ".[experiments]" has tqdm)
    tqdm = None

F32, F16, BF16 = jnp.float32, jnp.float16, jnp.bfloat16
LOSS_SCALE_INIT = 2.0**15
LOSS_SCALE_PERIOD = 200  # good steps before the loss scale doubles
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One training configuration: formats, and how the ranges are kept."""

    name: str
    label: str
    paper: str  # the row of the paper's table 3, or "" for a baseline
    precision: Precision
    master: Any = F32  # master weights
    opt_state: Any = F32  # Adam moments
    scalify: bool = False
    manual: bool = False  # scalify with the static policy and the paper's manual rescales
    loss_scale: bool = False  # dynamic loss scaling (unscaled configurations only)

    @property
    def policy(self) -> jsa.RescalePolicy | None:
        """The rescale policy of a scalified configuration (None: scalify's default)."""
        return jsa.RescalePolicy.static() if self.manual else None

    @property
    def uses_scale_state(self) -> bool:
        """Narrow Adam moments stored by ``jsa.optim.scale_state`` (the README recipe)."""
        return self.scalify and not self.manual and self.opt_state != F32

    @property
    def grad_rescale(self) -> bool:
        """Dynamic L2 rescale of the weight gradients before FP16 Adam (manual placement only)."""
        return self.manual and self.opt_state != F32

    def dtypes(self) -> dict[str, str]:
        """The formats of this configuration, for the results file."""
        p = self.precision
        return {
            "matmul_inputs": "e4m3 (block linears) / " + _name(p.compute) if p.fp8 else _name(p.compute),
            "matmul_grads": "e5m2 (block linears) / " + _name(p.compute) if p.fp8 else _name(p.compute),
            "activations": _name(p.compute),
            "master_weights": _name(self.master),
            "weight_grads": _name(self.master),
            "optimizer_state": _name(self.opt_state)
            + ("" if self.opt_state == F32 else " storage, float32 arithmetic"),
            "scales": "float32 power-of-two" if self.scalify else "none",
            "rescale_policy": ("static" if self.manual else "default") if self.scalify else "n/a",
            "dynamic_rescale": self._rescales(),
            "loss_scaling": "dynamic (2^15 start, x0.5 on overflow, x2 every 200 good steps)"
            if self.loss_scale
            else "none",
        }

    def _rescales(self) -> str:
        if not self.scalify:
            return "none"
        if not self.manual:
            where = "default policy (gradients leaving the backward pass, loop carries, returned state)"
            return where + ("; scale_state (Adam moments, gradients, updates)" if self.opt_state != F32 else "")
        manual = ["LayerNorm input grads"] + (["weight grads", "Adam moments"] if self.grad_rescale else [])
        return "manual: " + ", ".join(manual)


def _name(dtype) -> str:
    return np.dtype(dtype).name


def _configs() -> dict[str, RunConfig]:
    fp16 = Precision(compute=F16)
    fp8 = Precision(compute=F16, fp8=True)
    manual16 = Precision(compute=F16, ln_grad_rescale=True)
    manual8 = Precision(compute=F16, fp8=True, ln_grad_rescale=True)
    runs = [
        RunConfig("fp32", "FP32", "#0", Precision(compute=F32)),
        RunConfig("fp16", "FP16, no scaling", "", fp16),
        RunConfig("fp16_loss_scale", "FP16, dynamic loss scaling", "", fp16, loss_scale=True),
        RunConfig("bf16", "BF16, no scaling", "", Precision(compute=BF16)),
        # Unscaled counterparts of #2 and #3: the same formats without scalify.
        RunConfig("fp16_master", "FP16 + FP16 master, no scaling", "", fp16, master=F16),
        RunConfig("fp8", "FP8 matmuls + FP16 master, no scaling", "", fp8, master=F16),
        # The whole training state in 16 bits (weights and Adam moments), without scalify.
        RunConfig("fp16_state", "FP16 weights + FP16 Adam, no scaling", "", fp16, master=F16, opt_state=F16),
        RunConfig(
            "fp16_state_loss_scale",
            "FP16 weights + FP16 Adam, loss scaling",
            "",
            fp16,
            master=F16,
            opt_state=F16,
            loss_scale=True,
        ),
        RunConfig(
            "bf16_state",
            "BF16 weights + BF16 Adam, no scaling",
            "",
            Precision(compute=BF16),
            master=BF16,
            opt_state=BF16,
        ),
        # Scalify, README recipe: default rescale policy, no rescale call in the model or update.
        RunConfig("scalify_fp16", "scalify FP16", "#1", fp16, scalify=True),
        RunConfig("scalify_fp16_master", "scalify FP16 + FP16 master", "#2", fp16, master=F16, scalify=True),
        RunConfig("scalify_fp8", "scalify FP8 matmuls", "#3", fp8, master=F16, scalify=True),
        RunConfig(
            "scalify_fp8_fp16_adam", "scalify FP8 + FP16 Adam", "#4", fp8, master=F16, opt_state=F16, scalify=True
        ),
        RunConfig(
            "scalify_fp16_fp16_adam", "scalify FP16 + FP16 Adam", "", fp16, master=F16, opt_state=F16, scalify=True
        ),
        # Scalify, the paper's placement: static policy and manual rescales.
        RunConfig("scalify_fp16_manual", "scalify FP16, manual", "#1", manual16, scalify=True, manual=True),
        RunConfig(
            "scalify_fp16_master_manual",
            "scalify FP16 + FP16 master, manual",
            "#2",
            manual16,
            master=F16,
            scalify=True,
            manual=True,
        ),
        RunConfig(
            "scalify_fp8_manual", "scalify FP8 matmuls, manual", "#3", manual8, master=F16, scalify=True, manual=True
        ),
        RunConfig(
            "scalify_fp8_fp16_adam_manual",
            "scalify FP8 + FP16 Adam, manual",
            "#4",
            manual8,
            master=F16,
            opt_state=F16,
            scalify=True,
            manual=True,
        ),
    ]
    return {r.name: r for r in runs}


CONFIGS = _configs()
_PAPER = ("scalify_fp16", "scalify_fp16_master", "scalify_fp8", "scalify_fp8_fp16_adam")
GROUPS = {
    # The paper's table: the baselines, #1-#4 with the default policy and with manual placement.
    "main": ("fp32", "fp16", "fp16_loss_scale", "bf16") + _PAPER + tuple(n + "_manual" for n in _PAPER),
    # Weights and Adam moments in 16 bits too: where plain FP16 fails.
    "state16": (
        "fp32",
        "fp16_state",
        "fp16_state_loss_scale",
        "bf16_state",
        "scalify_fp16_fp16_adam",
        "scalify_fp8_fp16_adam",
    ),
    "unscaled_counterparts": ("fp32", "fp16_master", "fp8"),
}


def select_configs(spec: str) -> list[RunConfig]:
    """``"all"``, a name of ``GROUPS``, or a comma-separated list of names of ``CONFIGS``."""
    if spec == "all":
        return list(CONFIGS.values())
    if spec in GROUPS:
        return [CONFIGS[n] for n in GROUPS[spec]]
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(
            f"Unknown configuration(s) {unknown}; choose from {list(CONFIGS)}, a group {list(GROUPS)} or 'all'."
        )
    return [CONFIGS[n] for n in names]


# --- optimiser and update ---------------------------------------------------------------------
def make_optimizer(steps: int, lr: float, warmup: int, run: RunConfig) -> optax.GradientTransformation:
    """Adam with linear warmup then cosine decay to ``lr / 10``, moments stored as ``run`` says.

    Narrow moments are stored with ``jsa.optim.scale_state`` under the default policy, with
    the hand-written :func:`stored_in` under manual placement, and in the parameters' dtype
    (plain ``optax.adam`` on narrow parameters) without scalify.
    """
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr / 10)
    adam = optax.adam(schedule, b1=0.9, b2=0.99, eps=1e-8)
    if np.dtype(run.opt_state) == np.float32 or not run.scalify:
        return adam
    return stored_in(adam, run.opt_state) if run.manual else jsa.optim.scale_state(adam, run.opt_state)


def stored_in(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """``inner`` with its floating state stored in ``dtype`` and its arithmetic in float32.

    Adam's ``mu_hat / (sqrt(nu_hat) + eps)`` computed in FP16 gives 0/0 = NaN where a
    gradient entry is exactly 0 (eps = 1e-8 underflows in FP16, and under scalify it is
    rebalanced to the scale of ``sqrt(nu)`` and underflows too), so the moments are widened
    to float32 for the update and narrowed again to be stored. Before narrowing, each
    moment is dynamically rescaled (L2) under scalify: the propagated scale of
    ``b2 * nu + (1 - b2) * g**2`` does not follow the data, and FP16 moments then overflow
    or underflow (an underflowed ``nu`` next to a non-zero ``mu`` makes a huge step). With
    unit RMS, no entry of a tensor of N elements exceeds sqrt(N), far below FP16's maximum.
    """

    def init(params):
        return _astype(inner.init(_astype(params, F32)), dtype)

    def update(grads, state, params=None):
        updates, state = inner.update(_astype(grads, F32), _astype(state, F32), params)
        return updates, _astype(jsa.ops.dynamic_rescale_l2(state), dtype)

    return optax.GradientTransformation(init, update)


def _astype(tree, dtype):
    return jsa.tree.astype(tree, dtype, floating_only=True)


def make_update(run: RunConfig, cfg: GPTConfig, opt: optax.GradientTransformation) -> Callable:
    """The training step ``update(state, batch) -> (loss, state)`` of ``run`` (not jitted).

    ``state`` is a dict with ``params`` and ``opt``; with loss scaling also ``loss_scale``,
    ``good_steps`` (since the last change of the scale) and ``skipped_steps`` (in total).
    """
    prec = run.precision

    def grads_to_optimizer(grads):
        if run.grad_rescale:
            grads = jsa.ops.dynamic_rescale_l2(grads)
        return grads if run.uses_scale_state else _astype(grads, run.opt_state)

    def apply(params, opt_state, grads):
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def update(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch, cfg, prec)
        params, opt_state = apply(state["params"], state["opt"], grads_to_optimizer(grads))
        return loss, {"params": params, "opt": opt_state}

    def update_loss_scaled(state, batch):
        scale = state["loss_scale"]
        scaled_loss = lambda p: loss_fn(p, batch, cfg, prec) * scale
        loss, grads = jax.value_and_grad(scaled_loss)(state["params"])
        grads = jax.tree.map(lambda g: g / scale.astype(g.dtype), grads)
        finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        params, opt_state = apply(state["params"], state["opt"], grads_to_optimizer(grads))
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        good = jnp.where(finite, state["good_steps"] + 1, 0)
        grow = good >= LOSS_SCALE_PERIOD
        new_scale = jnp.where(finite, jnp.where(grow, scale * 2, scale), jnp.maximum(scale / 2, 1.0))
        return loss / scale, {
            "params": keep(params, state["params"]),
            "opt": keep(opt_state, state["opt"]),
            "loss_scale": new_scale,
            "good_steps": jnp.where(grow, 0, good),
            "skipped_steps": state["skipped_steps"] + jnp.where(finite, 0, 1),
        }

    return update_loss_scaled if run.loss_scale else update


def init_state(run: RunConfig, params32, opt: optax.GradientTransformation) -> dict:
    """The training state of ``run`` from float32 parameters (``ScaledArray`` leaves if scalified)."""
    params = _astype(params32, run.master)
    state = {"params": params, "opt": opt.init(_astype(params32, run.opt_state))}
    if run.loss_scale:
        state["loss_scale"] = jnp.asarray(LOSS_SCALE_INIT, F32)
        state["good_steps"] = jnp.asarray(0, jnp.int32)
        state["skipped_steps"] = jnp.asarray(0, jnp.int32)
    if run.scalify:
        state = _scaled_state(state, params32, run, opt)
    return state


def _scaled_state(state: dict, params32, run: RunConfig, opt: optax.GradientTransformation) -> dict:
    """Scaled state: scales chosen on the float32 values, then the data cast to its format.

    With ``jsa.optim.scale_state`` the moments come scaled from its ``init`` on the scaled
    parameters (the README recipe); otherwise Adam's state is made ``ScaledArray``s.
    """
    params = _astype(jsa.as_scaled_array(params32), run.master)
    opt_state = opt.init(params) if run.uses_scale_state else jsa.as_scaled_array(state["opt"])
    return {**state, "params": params, "opt": opt_state}


def compile_fns(run: RunConfig, cfg: GPTConfig, opt, compiler_options: dict | None = None) -> tuple[Callable, Callable]:
    """Jitted ``update(state, batch) -> (loss, state)`` and ``evaluate(params, batch) -> loss``,
    both returning plain float32 losses (``compiler_options`` go to ``jax.jit``; the smoke
    tests use them to compile faster)."""
    update = make_update(run, cfg, opt)
    evaluate = lambda params, batch: loss_fn(params, batch, cfg, run.precision)
    if run.scalify:
        update, evaluate = jsa.scalify(update, policy=run.policy), jsa.scalify(evaluate, policy=run.policy)
    to_plain = lambda x: jnp.asarray(jsa.asarray(x), F32)
    jit = lambda f: jax.jit(f, compiler_options=compiler_options)
    jit_update = jit(lambda s, b: (lambda loss, st: (to_plain(loss), st))(*update(s, b)))
    jit_eval = jit(lambda p, b: to_plain(evaluate(p, b)))
    return jit_update, jit_eval


# --- training loop ----------------------------------------------------------------------------
def mean_loss(evaluate: Callable, params, batches: list[np.ndarray]) -> float:
    """Mean loss over a fixed list of batches."""
    return float(np.mean([float(evaluate(params, b)) for b in batches]))


def train_one(run: RunConfig, cfg: GPTConfig, args, params32, train_batches, eval_sets, progress: bool = True) -> dict:
    """Train ``run`` for ``len(train_batches)`` steps; returns its entry of the results file."""
    steps = len(train_batches)
    opt = make_optimizer(steps, args.lr, args.warmup, run)
    update, evaluate = compile_fns(run, cfg, opt, FAST_COMPILE if args.fast_compile else None)
    state = init_state(run, params32, opt)
    losses, val_curve, step_times = [], [], []
    bad_streak, diverged_at = 0, None
    start = time.perf_counter()
    bar = _progress(steps, run.name, progress)
    for step in bar:
        t0 = time.perf_counter()
        loss, state = update(state, jnp.asarray(train_batches[step]))
        loss = float(loss)
        step_times.append(time.perf_counter() - t0)
        losses.append(loss)
        bad_streak = 0 if math.isfinite(loss) else bad_streak + 1
        if bad_streak >= args.nan_patience:
            diverged_at = step + 1 - bad_streak
            bar.write(f"{run.name}: loss not finite since step {diverged_at}; stopping this configuration.")
            break
        if (step + 1) % args.eval_every == 0 and step + 1 < steps:
            val_curve.append([step + 1, mean_loss(evaluate, state["params"], eval_sets["val"])])
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss:.3f}")
    bar.close()
    train_time = time.perf_counter() - start
    final_val = mean_loss(evaluate, state["params"], eval_sets["val"])
    final_train = mean_loss(evaluate, state["params"], eval_sets["train"])
    val_curve.append([len(losses), final_val])
    finite_tail = [x for x in losses[-args.eval_every :] if math.isfinite(x)]
    result = {
        "name": run.name,
        "label": run.label,
        "paper_config": run.paper,
        "scalify": run.scalify,
        "dtypes": run.dtypes(),
        "steps_run": len(losses),
        "final_train_loss": _finite_or_none(final_train),
        "final_val_loss": _finite_or_none(final_val),
        "train_loss_last_window": _finite_or_none(float(np.mean(finite_tail))) if finite_tail else None,
        "diverged": diverged_at is not None or not math.isfinite(final_val),
        "nan_steps": sum(not math.isfinite(x) for x in losses),
        "diverged_at_step": diverged_at,
        "first_step_s": step_times[0],
        "time_per_step_s": float(np.median(step_times[1:])) if len(step_times) > 1 else step_times[0],
        "train_time_s": train_time,
        "train_loss_curve": [_round(x) for x in losses],
        "val_loss_curve": [[s, _round(v)] for s, v in val_curve],
    }
    if run.loss_scale:
        result["final_loss_scale"] = float(state["loss_scale"])
        result["skipped_steps"] = int(state["skipped_steps"])
    return result


class _NoBar:
    """Stands in for a tqdm bar when tqdm is not installed or progress is off."""

    def __init__(self, steps: int):
        self._it = range(steps)

    def __iter__(self):
        return iter(self._it)

    def write(self, text: str) -> None:
        print(text, flush=True)

    def set_postfix(self, **_) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(steps: int, name: str, enabled: bool):
    if tqdm is None or not enabled:
        return _NoBar(steps)
    return tqdm(range(steps), desc=f"{name:<22}", mininterval=2.0)


def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def _round(x: float) -> float | None:
    return round(float(x), 4) if math.isfinite(x) else None


# --- outputs ----------------------------------------------------------------------------------
def add_comparisons(results: list[dict]) -> None:
    """Add the relative difference of each final loss to the FP32 run (in %), if FP32 ran."""
    ref = next((r for r in results if r["name"] == "fp32"), None)
    for r in results:
        for key in ("final_train_loss", "final_val_loss"):
            base = ref and ref[key]
            r[key.replace("final_", "delta_vs_fp32_pct_")] = (
                100.0 * (r[key] - base) / base if base and r[key] is not None else None
            )


def _fmt(x: float | None, width: int, spec: str) -> str:
    return format(format(x, spec) if x is not None else "n/a", f">{width}")


def results_table(results: list[dict]) -> str:
    """A plain-text table of the results."""
    head = f"{'config':<30}{'paper':>6}{'s/step':>8}{'train':>8}{'val':>8}{'val vs fp32':>13}{'NaN steps':>10}  status"
    lines = [head, "-" * len(head)]
    for r in results:
        delta = r.get("delta_vs_fp32_pct_val_loss")
        status = "ok"
        if r["diverged"]:
            status = f"diverged at step {r['diverged_at_step']}" if r["diverged_at_step"] else "diverged"
        lines.append(
            f"{r['name']:<30}{r['paper_config']:>6}{r['time_per_step_s']:>8.3f}{_fmt(r['final_train_loss'], 8, '.4f')}"
            f"{_fmt(r['final_val_loss'], 8, '.4f')}{_fmt(delta, 12, '+.2f')}{'%' if delta is not None else ' '}{r['nan_steps']:>10}  {status}"
        )
    return "\n".join(lines)


def _smooth(values: list, window: int) -> tuple[np.ndarray, np.ndarray]:
    y = np.array([np.nan if v is None else v for v in values], dtype=float)
    if len(y) < window:
        return np.arange(1, len(y) + 1), y
    kernel = np.ones(window) / window
    return np.arange(window, len(y) + 1), np.convolve(y, kernel, mode="valid")


def plot_curves(results: list[dict], path: Path, title: str) -> None:
    """Three panels: training loss (moving average), validation loss, and the validation
    loss relative to the FP32 run (in %, if FP32 ran)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val, ax_rel) = plt.subplots(1, 3, figsize=(16, 4.5))
    ref = next((dict(r["val_loss_curve"]) for r in results if r["name"] == "fp32"), {})
    bases = list(dict.fromkeys(r["name"].removesuffix("_manual") for r in results))
    palette = ["k", *plt.get_cmap("tab10").colors, "darkgoldenrod", "navy", "lime"]
    for r in results:
        # A default-policy configuration and its manual placement share a colour.
        line = {"color": palette[bases.index(r["name"].removesuffix("_manual")) % len(palette)], "linewidth": 1.2}
        style = (":" if r["name"].endswith("_manual") else "-") if r["scalify"] else "--"
        label = f"{r['paper_config']} {r['label']}".strip()
        if r.get("diverged_at_step") is not None:
            # Its moving average is not finite: the finite raw losses, and a legend entry.
            label += f" (non-finite from step {r['diverged_at_step'] + 1})"
            finite = [(i + 1, v) for i, v in enumerate(r["train_loss_curve"]) if v is not None]
            ax_train.plot(*zip(*finite), "x", markersize=6, **line)
            ax_val.plot([], [], style + "x", label=label, **line)
        x, y = _smooth(r["train_loss_curve"], 20)
        ax_train.plot(x, y, style, label=label, **line)
        vs = [(s, v) for s, v in r["val_loss_curve"] if v is not None]
        if vs:
            ax_val.plot(*zip(*vs), style + "o", label=label, markersize=3, **line)
        rel = [(s, 100 * (v - ref[s]) / ref[s]) for s, v in vs if ref.get(s)]
        if rel:
            ax_rel.plot(*zip(*rel), style + "o", label=label, markersize=3, **line)
    finals = [r["final_val_loss"] for r in results if r["final_val_loss"] is not None]
    for ax, name in ((ax_train, "training loss (20-step moving average)"), (ax_val, "validation loss")):
        ax.set_ylabel("cross-entropy (nats / char)")
        ax.set_title(name)
        if finals:
            ax.set_ylim(min(finals) - 0.1, max(3.0, max(finals) + 0.1))
    ax_rel.axhline(0, color="k", linewidth=0.8)
    for band in (-2, 2):
        ax_rel.axhline(band, color="grey", linewidth=0.8, linestyle=":")
    ax_rel.set_ylabel("validation loss vs FP32 (%)")
    ax_rel.set_title("difference to FP32 (dotted: +-2%)")
    for ax in (ax_train, ax_val, ax_rel):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax_val.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_all(results: list[dict], meta: dict, out: Path) -> None:
    """``gpt_loss_curves.png`` (every configuration), and ``gpt_loss_curves_<group>.png`` for
    each group of ``GROUPS`` whose configurations all ran."""
    plot_curves(results, out / "gpt_loss_curves.png", _plot_title(meta))
    ran = {r["name"] for r in results}
    for group, names in GROUPS.items():
        if set(names) <= ran and len(names) < len(ran):
            subset = [r for r in results if r["name"] in names]
            plot_curves(subset, out / f"gpt_loss_curves_{group}.png", f"{group}: {_plot_title(meta)}")


def replot(out: Path) -> None:
    """Redraw the loss curves from ``gpt_results.json`` in ``out``."""
    with open(out / "gpt_results.json") as f:
        saved = json.load(f)
    plot_all(saved["results"], saved["meta"], out)


def _plot_title(meta: dict) -> str:
    return (
        f"char GPT {meta['model']['layers']}x{meta['model']['width']} ({meta['num_params']:,} params), "
        f"{meta['steps']} steps x {meta['batch']}x{meta['model']['seq']} tokens; "
        "solid: scalify (default policy), dotted: scalify (manual placement), dashed: unscaled"
    )


def write_outputs(results: list[dict], meta: dict, out: Path) -> None:
    """``gpt_results.json`` and the loss curves (:func:`plot_all`) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    add_comparisons(results)
    with open(out / "gpt_results.json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    plot_all(results, meta, out)


# --- interleaved timing -------------------------------------------------------------------------
def time_configs(runs: list[RunConfig], cfg: GPTConfig, args, params32, batches, rounds: int, steps: int) -> dict:
    """Median seconds per step of each configuration, measured in interleaved rounds.

    Every configuration is compiled and warmed up first; then each round runs ``steps``
    steps of every configuration in turn, so a change in machine load affects all of them
    alike. Returns ``{name: {"median_s", "min_s", "compile_s"}}``.
    """
    states, updates, compile_s, times = {}, {}, {}, {r.name: [] for r in runs}
    for r in runs:
        opt = make_optimizer(args.steps, args.lr, args.warmup, r)
        updates[r.name], _ = compile_fns(r, cfg, opt)
        states[r.name] = init_state(r, params32, opt)
        t0 = time.perf_counter()
        loss, states[r.name] = updates[r.name](states[r.name], jnp.asarray(batches[0]))
        float(loss)
        compile_s[r.name] = time.perf_counter() - t0
    for k in range(rounds):
        for r in runs:
            for i in range(steps):
                t0 = time.perf_counter()
                loss, states[r.name] = updates[r.name](
                    states[r.name], jnp.asarray(batches[(k * steps + i) % len(batches)])
                )
                float(loss)
                times[r.name].append(time.perf_counter() - t0)
    return {
        n: {"median_s": float(np.median(t)), "min_s": float(np.min(t)), "compile_s": compile_s[n]}
        for n, t in times.items()
    }


# --- scale analysis of one step ----------------------------------------------------------------
def first_step_scales(run: RunConfig, cfg: GPTConfig, args, params32, batch) -> list[str]:
    """Lines describing the data of the first training step of a scalified ``run``
    (``jsa.analysis.record_scales``): the per-pass summary, then one line per FP8 cast
    (pass, dtype, shape, log2 RMS of the data and of the value, fraction of zero and of
    subnormal data entries)."""
    if not run.scalify:
        raise SystemExit(f"--record-scales: {run.name} is not a scalify configuration.")
    opt = make_optimizer(args.steps, args.lr, args.warmup, run)
    step = jsa.scalify(make_update(run, cfg, opt), policy=run.policy)
    report = jsa.analysis.record_scales(step, init_state(run, params32, opt), jnp.asarray(batch))
    lines = [f"== {run.name}: first step", report.summary()]
    for r in report.records:
        if "float8" in str(r.dtype):
            lines.append(
                f"{r.phase:<8} {str(r.dtype):<14} {str(r.shape):<16} data log2 RMS {r.log2_rms_data:7.2f}  "
                f"value log2 RMS {r.log2_rms_value:7.2f}  zero {r.frac_zero:.2f}  subnormal {r.frac_underflow:.2f}"
            )
    return lines


# --- CLI --------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", help="UTF-8 text file (e.g. ../shared/data/tinyshakespeare.txt)")
    p.add_argument(
        "--configs",
        default="main",
        help=f"'all', a group ({', '.join(GROUPS)}) or comma-separated among {','.join(CONFIGS)}",
    )
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 5%% of --steps)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the training batches")
    p.add_argument("--eval-seed", type=int, default=None, help="seed of the fixed evaluation batches (default: --seed)")
    p.add_argument(
        "--nan-patience", type=int, default=20, help="stop a configuration after this many non-finite losses in a row"
    )
    p.add_argument("--max-chars", type=int, default=None, help="use only the first characters of --data")
    p.add_argument("--out", default="results/gpt", help="output folder for gpt_results.json and the loss curves (png)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--timing",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="only time the step: ROUNDS interleaved rounds of 5 steps per configuration (writes gpt_timing.json)",
    )
    p.add_argument(
        "--fast-compile",
        action="store_true",
        help="fewer XLA optimisations: quicker to start, slower steps (smoke tests)",
    )
    p.add_argument(
        "--record-scales",
        action="store_true",
        help="instead of training: record the data of the first step of each (scalified) configuration "
        "with jsa.analysis.record_scales and print the FP8 casts",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="instead of training: merge results files of runs with the same settings into --out",
    )
    args = p.parse_args(argv)
    if args.data is None and not args.merge:
        p.error("--data is required (or --merge)")
    if args.warmup is None:
        args.warmup = max(1, args.steps // 20)
    if args.width % args.heads:
        p.error("--width must be a multiple of --heads")
    return args


def run(args: argparse.Namespace) -> list[dict]:
    """Train every selected configuration; write and return the results."""
    runs = select_configs(args.configs)
    try:
        dataset = data_lib.load_dataset(args.data, args.max_chars)
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None
    cfg = GPTConfig(vocab=dataset.vocab_size, seq=args.seq, width=args.width, heads=args.heads, layers=args.layers)
    params32 = init_params(jax.random.PRNGKey(args.seed), cfg)
    train_batches = data_lib.batch_stream(dataset.train, args.steps, args.batch, args.seq, args.seed + 1)
    eval_seed = args.seed if args.eval_seed is None else args.eval_seed
    eval_sets = {
        "val": data_lib.fixed_batches(dataset.val, args.eval_batches, args.batch, args.seq, eval_seed + 2),
        "train": data_lib.fixed_batches(dataset.train, args.eval_batches, args.batch, args.seq, eval_seed + 3),
    }
    meta = {
        "data": str(args.data),
        "chars": len(dataset.train) + len(dataset.val),
        "vocab": dataset.vocab_size,
        "model": dataclasses.asdict(cfg),
        "num_params": cfg.num_params(),
        "tied_embeddings": True,
        "steps": args.steps,
        "batch": args.batch,
        "tokens_seen": args.steps * args.batch * args.seq,
        "optimizer": f"Adam(b1=0.9, b2=0.99, eps=1e-8), warmup {args.warmup} steps to lr {args.lr}, cosine to lr/10",
        "eval": f"{args.eval_batches} fixed batches of {args.batch}x{args.seq} tokens",
        "seed": args.seed,
        "eval_seed": eval_seed,
        "jax": jax.__version__,
        "commit": _git_commit(),
        "backend": jax.default_backend(),
        "machine": f"{platform.processor() or platform.machine()}, {jax.local_device_count()} device(s)",
    }
    if args.timing:
        return _run_timing(runs, cfg, args, params32, train_batches, meta)
    if args.record_scales:
        for r in runs:
            print("\n".join(first_step_scales(r, cfg, args, params32, train_batches[0])), flush=True)
        return []
    print(f"{cfg} ({cfg.num_params():,} params), {args.steps} steps of {args.batch}x{args.seq} tokens", flush=True)
    results = []
    for r in runs:
        results.append(train_one(r, cfg, args, params32, train_batches, eval_sets, not args.no_progress))
        last = results[-1]
        print(
            f"{r.name}: train {last['final_train_loss']}, val {last['final_val_loss']}, "
            f"{last['time_per_step_s']:.3f} s/step, diverged={last['diverged']}",
            flush=True,
        )
        write_outputs(results, meta, Path(args.out))
    print(results_table(results), flush=True)
    return results


def _git_commit() -> str | None:
    """The commit of the checkout that runs this (None outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _run_timing(runs, cfg, args, params32, batches, meta) -> list[dict]:
    timing = time_configs(runs, cfg, args, params32, batches, args.timing, steps=5)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "gpt_timing.json", "w") as f:
        json.dump({"meta": {**meta, "rounds": args.timing, "steps_per_round": 5}, "timing": timing}, f, indent=1)
    print(f"{'config':<23}{'median s/step':>14}{'min s/step':>12}{'compile s':>11}")
    for name, t in timing.items():
        print(f"{name:<23}{t['median_s']:>14.3f}{t['min_s']:>12.3f}{t['compile_s']:>11.1f}")
    return [{"name": n, **t} for n, t in timing.items()]


SAME_SETTINGS = ("model", "steps", "batch", "optimizer", "eval", "seed", "eval_seed")


def _same_data(meta: dict, other: dict) -> bool:
    """The same text file: name and number of characters (the path depends on where a run started)."""
    same_name = Path(meta.get("data", "")).name == Path(other.get("data", "")).name
    return same_name and meta.get("chars") == other.get("chars")


def merge_results(paths: list[str], out: Path) -> list[dict]:
    """Merge the ``gpt_results.json`` of several runs of the same settings (configurations
    run in separate processes) into ``out``: a configuration is kept from the first file
    that has it, and the configurations are listed in the order of ``CONFIGS``."""
    saved = []
    for path in paths:
        with open(path) as f:
            saved.append(json.load(f))
    meta = saved[0]["meta"]
    for other, path in zip(saved[1:], paths[1:]):
        differ = [k for k in SAME_SETTINGS if other["meta"].get(k) != meta.get(k)]
        differ += [] if _same_data(meta, other["meta"]) else ["data"]
        if differ:
            raise SystemExit(f"error: {path} was run with other settings ({', '.join(differ)}) than {paths[0]}.")
    results = {}
    for part in saved:
        for r in part["results"]:
            results.setdefault(r["name"], r)
    order = list(CONFIGS)
    merged = sorted(results.values(), key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))
    commits = sorted({s["meta"].get("commit") or "unknown" for s in saved})
    write_outputs(merged, {**meta, "commit": ", ".join(commits), "merged_from": list(map(str, paths))}, out)
    return merged


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.merge:
        print(results_table(merge_results(args.merge, Path(args.out))))
    else:
        run(args)


if __name__ == "__main__":
    main()
