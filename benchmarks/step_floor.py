"""The whole training step's floor at model size, beside plain float16 and the README recipe.

Run from the repository root: ``python -m benchmarks.step_floor`` (2 layers of
:mod:`benchmarks.cost_at_scale`'s GPT-2-shaped model; ``--layers N``, ``--tiny``,
``--rounds R``, ``--no-runtime``, ``--deviceless``, ``--json PATH``).

Variants, each one jitted step (loss, gradients, global-norm clipping, AdamW with a
warmup-cosine schedule, the new parameters and optimizer state):

- ``plain_fp16``: the step on float16 parameters and Optax state, no scalify (the baseline);
- ``scalify_fp16`` and ``scalify_fp16_static``: the README recipe (float16 ``ScaledArray``
  state, ``jsa.optim.scale_state``, the step under ``jsa.scalify``) with the default and the
  static rescale policy, as in :mod:`benchmarks.cost_at_scale`;
- ``floor``: what storing the state scaled costs with no scale arithmetic at run time. Its
  gradient step is the recipe's under the static policy with every parameter's scale a
  trace-time constant (the scale rules fold in Python; what remains is the data side: the
  unit-scaling factors, the narrowing casts, the statistics the rules take of values they
  compute, such as the softmax's ``exp``); its update is
  :func:`benchmarks.update_floor.floor_update`, written by hand (one statistic per stored
  moment and per update, the parameter updated on its own fixed grid with a float16
  residual). Parameters keep their scales there, so constants stand for them exactly from
  step to step; a zero-initialised parameter gets scale 1 (a scale of 0 would fold its
  sums away). It does less than the recipe (no scale moves with its parameter, nothing is
  checked): what this design costs with no run-time arithmetic on the parameters' scales.
  It is not below the recipe in every column: it reduces each stored tensor on its own
  (more statistics and H100 kernels than the library, which batches small tensors of one
  shape).
- ``floor_default``: the floor with its gradient step under the default rescale policy (whose
  sites then measure at run time, and scale arithmetic follows each measurement), and no
  ``outputs`` site (the returned parameters keep their scales): the same for the README
  recipe's policy.

Columns (x plain: against ``plain_fp16`` in the same run): jaxpr equations, statistics
(reductions beyond plain's), XLA:CPU fusions, XLA's temporary buffers, trace + lower +
compile CPU seconds (cold caches), milliseconds per step (interleaved medians) and, with
``--deviceless`` and ``jax[cuda12]`` installed, the kernels and temporary buffers of the step
compiled for an H100.
Counts and bytes are exact; times compare only within one run.
"""

from __future__ import annotations

import os

# Before JAX is imported: lets JAX's CUDA plugin, where installed, register without a GPU (for --deviceless).
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jax_scalify as jsa  # noqa: E402
from tests.programs import gpt_linen, recipe  # noqa: E402

from . import cost_at_scale, update_floor  # noqa: E402
from .common import interleaved_medians, markdown_table, write_json  # noqa: E402

F16 = np.dtype(np.float16)
STATIC = jsa.RescalePolicy.static()
VARIANTS = ("plain_fp16", "scalify_fp16", "scalify_fp16_static", "floor", "floor_default")


def _fixed_scale(x: jsa.ScaledArray) -> np.ndarray:
    """The parameter's scale as a NumPy constant; 1 where it is 0 (a zero-initialised parameter)."""
    scale = np.asarray(x.scale)
    return np.where(scale == 0, np.ones_like(scale), scale)


def build_floor(
    shape: cost_at_scale.Shape, layers: int, params32: Any, policy: jsa.RescalePolicy = STATIC
) -> tuple[Callable, tuple]:
    """The floor's step ``(datas, state, tokens, targets) -> (loss, datas, state)`` and its arguments.

    ``policy``: the rescale policy of the gradient step (the static one for ``floor``).
    """
    tx = gpt_linen.make_optimizer()
    leaves, treedef = jax.tree.flatten(recipe.scale_state(params32, F16), is_leaf=jsa.is_scaled_leaf)
    scales = [_fixed_scale(x) for x in leaves]
    apply = cost_at_scale.model(shape, layers).apply

    def loss_fn(params, tokens, targets):
        logits = apply({"params": params}, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    grads_fn = jsa.scalify(jax.value_and_grad(loss_fn), policy=policy)
    update = update_floor.floor_update(tx)

    def step(datas, state, tokens, targets):
        params = treedef.unflatten([jsa.ScaledArray(d, s) for d, s in zip(datas, scales)])
        loss, grads = grads_fn(params, tokens, targets)
        stored = lambda tree: jax.tree.map(  # noqa: E731
            lambda x: update_floor.Stored(x.data, x.scale), tree, is_leaf=jsa.is_scaled_leaf
        )
        new_params, state = update(stored(grads), state, stored(params))
        return loss, [p.data for p in jax.tree.leaves(new_params, is_leaf=update_floor._is_stored)], state

    datas = [x.data for x in leaves]
    initial = treedef.unflatten([update_floor.Stored(d, s) for d, s in zip(datas, scales)])
    return step, (datas, update_floor.floor_init(tx, initial), *cost_at_scale.batch(shape))


def build(name: str, shape: cost_at_scale.Shape, layers: int, params32: Any) -> tuple[Callable, tuple]:
    if name == "floor":
        return build_floor(shape, layers, params32)
    if name == "floor_default":
        return build_floor(shape, layers, params32, jsa.RescalePolicy())
    return cost_at_scale.build(name, shape, layers, params32)


def run(
    shape: cost_at_scale.Shape,
    layers: int,
    names: list[str],
    rounds: int,
    sharding: Any = None,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """One row per variant (module docstring); ratios against ``plain_fp16``, which is always measured."""
    names = ["plain_fp16", *(n for n in names if n != "plain_fp16")]
    params32 = cost_at_scale.init_params(shape, layers)
    built = {name: build(name, shape, layers, params32) for name in names}
    rows, executables = {}, {}
    for name, (step, args) in built.items():
        rows[name], executables[name] = cost_at_scale.measure(name, step, args)
        rows[name]["layers"] = layers
        if sharding is not None:
            rows[name].update(cost_at_scale.deviceless(step, args, sharding))
        log(f"  {name}: compiled")
    if rounds:
        thunks = {name: (lambda f=executables[name], a=built[name][1]: f(*a)) for name in names}
        for name, seconds in interleaved_medians(thunks, rounds).items():
            rows[name]["step_ms"] = 1e3 * seconds
    base = rows["plain_fp16"]
    for row in rows.values():
        row["statistics"] = row["reductions"] - base["reductions"]
        row.update(cost_at_scale.mib_columns(row))
        for key in (
            "eqns",
            "fusions",
            "temp_bytes",
            "compile_total_cpu_s",
            "step_ms",
            "h100_kernels",
            "h100_temp_bytes",
        ):
            if row.get(key) is not None and base.get(key):
                row[f"{key}_ratio"] = row[key] / base[key]
    return [rows[name] for name in names]


COLUMNS = (
    ("layers", "layers", "d"),
    ("variant", "variant", "s"),
    ("eqns", "eqns", "d"),
    ("x plain", "eqns_ratio", ".2f"),
    ("GEMMs", "gemms", "d"),
    ("statistics", "statistics", "d"),
    ("fusions", "fusions", "d"),
    ("x plain", "fusions_ratio", ".2f"),
    ("temp MiB", "temp_mib", ".1f"),
    ("x plain", "temp_bytes_ratio", ".2f"),
    ("first step s", "compile_total_cpu_s", ".2f"),
    ("x plain", "compile_total_cpu_s_ratio", ".2f"),
    ("ms/step", "step_ms", ".1f"),
    ("x plain", "step_ms_ratio", ".2f"),
    ("H100 kernels", "h100_kernels", "d"),
    ("x plain", "h100_kernels_ratio", ".2f"),
    ("H100 temp MiB", "h100_temp_mib", ".1f"),
    ("x plain", "h100_temp_bytes_ratio", ".2f"),
)


def table(rows: list[dict]) -> str:
    """The rows as a markdown table; the runtime and H100 columns only where measured."""
    measured = lambda key: any(row.get(key) is not None for row in rows)  # noqa: E731
    columns = [c for c in COLUMNS if measured(c[1])]
    return markdown_table(rows, columns)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2], help="model depths (default: 2)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=5, help="interleaved runtime rounds (default: 5)")
    parser.add_argument("--no-runtime", action="store_true", help="counts, bytes and compile times only")
    parser.add_argument("--deviceless", action="store_true", help="also compile each step for an H100 (no GPU)")
    parser.add_argument("--tiny", action="store_true", help=f"a tiny model: {cost_at_scale.TINY}")
    parser.add_argument("--json", help="write the configuration and the rows to this file")
    args = parser.parse_args(argv)
    shape = cost_at_scale.TINY if args.tiny else cost_at_scale.GPT2
    sharding = None
    if args.deviceless:
        sharding, reason = cost_at_scale.h100_sharding_or_reason()
        if sharding is None:
            print(f"no deviceless H100 ({reason}): install jax[cuda12] and set JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1")
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {shape}")
    rounds = 0 if args.no_runtime else args.rounds
    rows = [
        row
        for layers in args.layers
        for row in run(shape, layers, args.variants, rounds, sharding, lambda s: print(s, flush=True))
    ]
    print(table(rows))
    if args.json:
        write_json(args.json, rows, **dataclasses.asdict(shape))
    return rows


if __name__ == "__main__":
    main()
