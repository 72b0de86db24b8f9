"""Cost of scalify at model size: a GPT-2-shaped Flax Linen training step, plain and scalified.

Run from the repository root: ``python -m benchmarks.cost_at_scale`` (2 and 12 layers, every
variant; ``--quick`` for fewer runtime rounds, ``--no-runtime`` for the counts and compile
times only, ``--deviceless`` for the H100 columns, ``--split`` for the model's and the
update's shares of the compile time, ``--json PATH``; ``--tiny`` for a toy size).

The model is the Linen GPT of :mod:`tests.programs.gpt_linen` (``nn.Dense`` layers, layers
unrolled in Python, embeddings tied through ``nn.Embed.attend``, AdamW with a warmup-cosine
schedule after global-norm clipping, a ``flax.training.train_state.TrainState`` step) at
GPT-2 small's width: d_model 768, 12 heads, sequence 256, batch 4, vocabulary 32768 (no
dropout, and no bias on the attention's input projection). The variants,
all in one process, on the same initial parameters and batch of integer tokens:

- ``plain_fp32``: ``jax.jit(train_step)`` on float32 state;
- ``plain_fp16``: the same code on float16 state (every floating leaf cast; no scalify);
- ``scalify_fp32``: ``jax.jit(jsa.scalify(train_step))`` on the float32 state as
  ``ScaledArray`` leaves with float32 data (the same optimizer): scalify's cost alone;
- ``scalify_fp16``: the README recipe (:mod:`tests.programs.recipe`): ``jsa.optim.scale_state``
  around the Optax transformation, state as ``ScaledArray`` leaves with float16 data, the step
  under ``jsa.scalify`` with its default rescale policy;
- ``scalify_fp16_static``: the same under ``jsa.RescalePolicy.static()``;
- ``scalify_fp8``: the FP16 recipe with every ``nn.Dense`` taking ``jsa.nn.cast_dot_general``
  (E4M3 forward, E5M2 gradients), the repository's FP8 recipe. Its ``statistics`` include
  those of the rescales the default policy places before each cast into FP8;
- ``scalify_fp16_floor`` (only when named in ``--variants``): ``scalify_fp16_static`` with
  every scale of the state a trace-time constant (the step closes over the scales and takes
  the data): the scale arithmetic that depends on the state's scales folds in Python. A
  diagnostic of what cheaper scale arithmetic could reach at best, not a step that trains
  (its scales never change);
- ``scalify_fp16_no_<component>`` (only when named; ``<component>`` one of
  :data:`POLICY_SITES`): the README recipe with that component of the default policy
  switched off: one site family's share of the recipe's cost.

Columns (counts are exact; times and ratios compare only within one run):

- ``eqns``: equations of the step's jaxpr (``jax.jit(f).trace(...).jaxpr``), counting the
  equations of nested jaxprs (``pjit``, custom-derivative calls) once per equation holding them;
- ``GEMMs``: ``dot_general`` equations of that jaxpr;
- ``reductions``: reduction equations of that jaxpr (:data:`REDUCTIONS`);
- ``statistics``: the reductions scalify inserted: ``reductions`` of the scalified step minus
  those of its baseline, the plain step of the same data type (``plain_fp32`` for
  ``scalify_fp32``, ``plain_fp16`` for the FP16 and FP8 variants);
- ``fusions``, ``HLO reduce``: ``fusion`` and ``reduce`` instructions of the optimised HLO
  module XLA compiled for this machine (every computation, fused ones included);
- ``temp MiB``: XLA's temporary buffers (``Compiled.memory_analysis().temp_size_in_bytes``);
- ``trace``, ``lower``, ``compile``: CPU seconds of each stage (cold caches, one compile);
  ``x base``: their sum against the baseline's (the baseline of ``plain_fp16`` is ``plain_fp32``);
- ``ms/step``, ``x base``: median runtime of a step over interleaved rounds, and its ratio;
- ``grads s``, ``x base``, ``update s``, ``x base`` (``--split``): the CPU seconds of trace,
  lowering and compilation of the variant's *gradient step* (the loss and the parameters'
  gradients, ``gpt_linen.loss_and_grads``, under the same ``jax.jit`` and ``jsa.scalify``:
  the model's part), the rest of the full step's (``compile_total_cpu_s`` minus it: the
  optimizer's update and ``apply_gradients``), each against the same split of the baseline
  (measured only when the baseline is a selected variant);
- ``H100 kernels``, ``H100 GEMMs``, ``H100 FP8 GEMMs``, ``H100 temp MiB``, ``H100 compile s``
  (``--deviceless``): fusions and custom calls of the entry computation, cuBLAS/Triton GEMMs
  (all, and those reading FP8 operands) of the step compiled for an H100 without a device,
  XLA's defaults (no autotuning), its temporary buffers, and the CPU seconds of trace,
  lowering and compilation for it. Needs JAX's CUDA
  plugin, which installs without a GPU (``pip install jax-cuda12-plugin jax-cuda12-pjrt``,
  about 180 MB, is enough; ``jax[cuda12]`` also brings the CUDA libraries); see
  :mod:`benchmarks.h100`.
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
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax import lax  # noqa: E402

import jax_scalify as jsa  # noqa: E402
from jax_scalify.analysis import entry_kernels, gemm_calls  # noqa: E402
from tests.programs import gpt_linen, recipe  # noqa: E402

from .common import (  # noqa: E402
    abstract,
    hlo_opcode_count,
    interleaved_medians,
    markdown_table,
    primitive_counts,
    stage_times,
    write_json,
)

REDUCTIONS = frozenset(
    {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor", "reduce"}
    | {"argmax", "argmin"}
)


@dataclasses.dataclass(frozen=True)
class Shape:
    vocab: int = 32768
    width: int = 768
    heads: int = 12
    seq: int = 256
    batch: int = 4


GPT2 = Shape()
TINY = Shape(vocab=256, width=64, heads=4, seq=32, batch=2)


@dataclasses.dataclass(frozen=True)
class Variant:
    """How a variant builds its step: data type of the state, scalify and its policy, FP8 linears."""

    dtype: Any
    scalify: bool
    baseline: str
    static: bool = False
    fp8: bool = False
    constant_scales: bool = False
    without: str | None = None  # a component of the default rescale policy switched off


POLICY_SITES = ("gradients", "outputs", "contractions", "self_products")
VARIANTS = {
    "plain_fp32": Variant(jnp.float32, False, "plain_fp32"),
    "plain_fp16": Variant(jnp.float16, False, "plain_fp32"),
    "scalify_fp32": Variant(jnp.float32, True, "plain_fp32"),
    "scalify_fp16": Variant(jnp.float16, True, "plain_fp16"),
    "scalify_fp16_static": Variant(jnp.float16, True, "plain_fp16", static=True),
    "scalify_fp8": Variant(jnp.float16, True, "plain_fp16", fp8=True),
    "scalify_fp16_floor": Variant(jnp.float16, True, "plain_fp16", static=True, constant_scales=True),
    **{f"scalify_fp16_no_{site}": Variant(jnp.float16, True, "plain_fp16", without=site) for site in POLICY_SITES},
}
DEFAULT_VARIANTS = [name for name, v in VARIANTS.items() if not v.constant_scales and v.without is None]


def model(shape: Shape, layers: int, fp8: bool = False) -> gpt_linen.GPT:
    dot_general = recipe.fp8_dot_general if fp8 else lax.dot_general
    return gpt_linen.GPT(shape.vocab, shape.width, layers, shape.heads, shape.seq, dot_general)


def init_params(shape: Shape, layers: int, seed: int = 0) -> Any:
    """Float32 parameters (the FP8 model has the same: its ``dot_general`` holds none)."""
    return model(shape, layers).init(jax.random.PRNGKey(seed), jnp.zeros((1, shape.seq), jnp.int32))["params"]


def batch(shape: Shape, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    tokens = jax.random.randint(jax.random.PRNGKey(seed), (shape.batch, shape.seq + 1), 0, shape.vocab)
    return tokens[:, :-1], tokens[:, 1:]


def build(name: str, shape: Shape, layers: int, params: Any, gradients: bool = False) -> tuple[Callable, tuple]:
    """The variant's step before ``jax.jit`` and its arguments ``(state, tokens, targets)``.

    ``gradients``: the gradient step instead (loss and gradients, no update).
    """
    variant = VARIANTS[name]
    fn = gpt_linen.loss_and_grads if gradients else gpt_linen.train_step
    tx = gpt_linen.make_optimizer()
    if variant.scalify and variant.dtype != jnp.float32:
        tx = recipe.optimizer(tx, variant.dtype)
    state = train_state.TrainState.create(apply_fn=model(shape, layers, variant.fp8).apply, params=params, tx=tx)
    if variant.scalify:
        state = recipe.scale_state(state, variant.dtype)
        step = jsa.scalify(fn, **_policy(variant))
        if variant.constant_scales:
            return _with_constant_scales(step, state, shape)
    else:
        state = jax.tree.map(lambda x: x.astype(variant.dtype) if recipe.is_floating_array(x) else x, state)
        step = fn
    return step, (state, *batch(shape))


def _policy(variant: Variant) -> dict:
    """``jsa.scalify``'s policy argument for ``variant``: none (what users get) unless it says otherwise."""
    if variant.static:
        return {"policy": jsa.RescalePolicy.static()}
    if variant.without is not None:
        return {"policy": jsa.RescalePolicy(**{variant.without: False})}
    return {}


def _with_constant_scales(step: Callable, state: Any, shape: Shape) -> tuple[Callable, tuple]:
    """``step`` closed over the scales of ``state`` as NumPy constants; it takes the state's data."""
    is_scaled = lambda x: isinstance(x, jsa.ScaledArray)  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten(state, is_leaf=is_scaled)
    scales = [np.asarray(x.scale) if is_scaled(x) else None for x in leaves]

    def constant_scaled_step(datas, tokens, targets):
        fixed = [d if s is None else jsa.ScaledArray(d, s) for d, s in zip(datas, scales)]
        return step(jax.tree_util.tree_unflatten(treedef, fixed), tokens, targets)

    datas = [x.data if is_scaled(x) else x for x in leaves]
    return constant_scaled_step, (datas, *batch(shape))


def jaxpr_counts(jaxpr: Any) -> dict[str, int]:
    counts = primitive_counts(jaxpr)
    return {
        "eqns": sum(counts.values()),
        "gemms": counts["dot_general"],
        "reductions": sum(n for p, n in counts.items() if p in REDUCTIONS),
    }


def measure(name: str, step: Callable, args: tuple) -> tuple[dict, Any]:
    """Counts, memory and stage times of one variant compiled for this machine; and its executable."""
    stages = stage_times(step, *args)
    hlo = stages.compiled.as_text()
    memory = stages.compiled.memory_analysis()
    row = {
        "variant": name,
        **jaxpr_counts(stages.traced.jaxpr),
        "fusions": hlo_opcode_count(hlo, "fusion"),
        "hlo_reduce": hlo_opcode_count(hlo, "reduce"),
        "temp_bytes": int(memory.temp_size_in_bytes) if memory is not None else None,
        **{f"{stage}_cpu_s": s for stage, s in stages.cpu.items()},
        "compile_total_cpu_s": sum(stages.cpu.values()),
    }
    return row, stages.compiled


def h100_sharding_or_reason() -> tuple[Any, str | None]:
    """A compile-only H100 sharding, or None and why there is none."""
    try:
        from .h100 import h100_sharding

        return h100_sharding(), None
    except (ImportError, NotImplementedError, RuntimeError) as error:
        return None, f"{type(error).__name__}: {error}"


def deviceless(step: Callable, args: tuple, sharding: Any) -> dict:
    """Kernels and GEMMs of the step compiled for an H100 without a device."""
    stages = stage_times(step, *abstract(jax.eval_shape(lambda: args), sharding), lowering_platforms=("cuda",))
    hlo = stages.compiled.as_text()
    calls = gemm_calls(hlo)
    return {
        "h100_kernels": len(entry_kernels(hlo)),
        "h100_gemms": len(calls),
        "h100_fp8_gemms": sum(c.is_fp8 for c in calls),
        "h100_temp_bytes": int(stages.compiled.memory_analysis().temp_size_in_bytes),
        "h100_compile_total_cpu_s": sum(stages.cpu.values()),
    }


def run(
    shape: Shape,
    layers: int,
    names: list[str],
    rounds: int,
    sharding: Any = None,
    log: Callable[[str], None] = print,
    split: bool = False,
) -> list[dict]:
    """One row per variant of the ``layers``-layer model (see the module docstring for the fields)."""
    params = init_params(shape, layers)
    log(f"{layers} layers: {sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)) / 1e6:.1f}M parameters")
    built = {name: build(name, shape, layers, params) for name in names}
    rows, executables = {}, {}
    for name, (step, args) in built.items():
        rows[name], executables[name] = measure(name, step, args)
        rows[name]["layers"] = layers
        if sharding is not None:
            rows[name].update(deviceless(step, args, sharding))
        if split:
            rows[name].update(_split(name, shape, layers, params, rows[name]))
        log(f"  {name}: compiled")
    for base in {VARIANTS[name].baseline for name in names} - set(names):  # counts only: trace the baseline
        step, args = build(base, shape, layers, params)
        rows[base] = jaxpr_counts(jax.jit(step).trace(*args).jaxpr)
    for name in names:
        row, base = rows[name], VARIANTS[name].baseline
        row["baseline"] = base
        row["statistics"] = row["reductions"] - rows[base]["reductions"] if VARIANTS[name].scalify else None
        for key in ("compile", "grads_compile", "update_compile") if split else ("compile",):
            total = rows[base].get(f"{key}_total_cpu_s")
            row[f"{key}_ratio"] = row[f"{key}_total_cpu_s"] / total if total else None
    if rounds:
        thunks = {name: (lambda f=executables[name], a=built[name][1]: f(*a)) for name in names}
        medians = interleaved_medians(thunks, rounds)
        for name in names:
            rows[name]["step_ms"] = 1e3 * medians[name]
            base = rows[name]["baseline"]
            rows[name]["step_ratio"] = medians[name] / medians[base] if base in medians else None
    return [rows[name] for name in names]


def _split(name: str, shape: Shape, layers: int, params: Any, row: dict) -> dict:
    """The gradient step's compile CPU time and counts, and the rest of the full step's (the update)."""
    grads, _ = measure(name, *build(name, shape, layers, params, gradients=True))
    return {
        "grads_eqns": grads["eqns"],
        "grads_fusions": grads["fusions"],
        "grads_compile_total_cpu_s": grads["compile_total_cpu_s"],
        "update_compile_total_cpu_s": row["compile_total_cpu_s"] - grads["compile_total_cpu_s"],
    }


COLUMNS = (
    ("layers", "layers", "d"),
    ("variant", "variant", "s"),
    ("eqns", "eqns", "d"),
    ("GEMMs", "gemms", "d"),
    ("reductions", "reductions", "d"),
    ("statistics", "statistics", "d"),
    ("fusions", "fusions", "d"),
    ("HLO reduce", "hlo_reduce", "d"),
    ("temp MiB", "temp_mib", ".1f"),
    ("trace s", "trace_cpu_s", ".2f"),
    ("lower s", "lower_cpu_s", ".2f"),
    ("compile s", "compile_cpu_s", ".2f"),
    ("x base", "compile_ratio", ".2f"),
    ("grads s", "grads_compile_total_cpu_s", ".2f"),
    ("x base", "grads_compile_ratio", ".2f"),
    ("update s", "update_compile_total_cpu_s", ".2f"),
    ("x base", "update_compile_ratio", ".2f"),
    ("ms/step", "step_ms", ".1f"),
    ("x base", "step_ratio", ".2f"),
    ("H100 kernels", "h100_kernels", "d"),
    ("H100 GEMMs", "h100_gemms", "d"),
    ("H100 FP8 GEMMs", "h100_fp8_gemms", "d"),
    ("H100 temp MiB", "h100_temp_mib", ".1f"),
    ("H100 compile s", "h100_compile_total_cpu_s", ".2f"),
)


def table(rows: list[dict], runtime: bool, h100: bool, split: bool = False) -> str:
    """The rows as a markdown table (runtime, H100 and split columns only where measured)."""
    skip = set() if runtime else {"step_ms", "step_ratio"}
    skip |= set() if split else {key for _, key, _ in COLUMNS if key.startswith(("grads", "update"))}
    skip |= set() if h100 else {key for _, key, _ in COLUMNS if key.startswith("h100")}
    columns = [c for c in COLUMNS if c[1] not in skip]
    return markdown_table([{**row, **mib_columns(row)} for row in rows], columns)


def mib_columns(row: dict) -> dict:
    """The row's byte counts (``temp_bytes``, ``h100_temp_bytes``) in MiB, where measured."""
    keys = ("temp", "h100_temp")
    return {f"{k}_mib": row[f"{k}_bytes"] / 2**20 for k in keys if row.get(f"{k}_bytes") is not None}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 12], help="model depths (default: 2 12)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=DEFAULT_VARIANTS)
    parser.add_argument("--quick", action="store_true", help="2 runtime rounds instead of 5")
    parser.add_argument("--rounds", type=int, help="interleaved runtime rounds (overrides --quick)")
    parser.add_argument("--no-runtime", action="store_true", help="counts and compile times only")
    parser.add_argument("--deviceless", action="store_true", help="also compile each step for an H100 (no GPU)")
    parser.add_argument("--split", action="store_true", help="also compile the gradient step alone (model vs update)")
    parser.add_argument("--tiny", action="store_true", help=f"a tiny model: {TINY}")
    for field in dataclasses.fields(Shape):
        parser.add_argument(f"--{field.name}", type=int, help=f"override the model's {field.name}")
    parser.add_argument("--json", help="write the configuration and the rows to this file")
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    shape = TINY if args.tiny else GPT2
    shape = dataclasses.replace(
        shape, **{f.name: getattr(args, f.name) for f in dataclasses.fields(Shape) if getattr(args, f.name) is not None}
    )
    rounds = 0 if args.no_runtime else args.rounds if args.rounds is not None else 2 if args.quick else 5
    sharding, reason = h100_sharding_or_reason() if args.deviceless else (None, None)
    if args.deviceless and sharding is None:
        print(f"deviceless H100 compilation unavailable, H100 columns skipped ({reason});")
        print(
            "  it needs JAX's CUDA plugin, which installs without a GPU: pip install jax-cuda12-plugin jax-cuda12-pjrt"
        )
    device = jax.devices()[0]
    print(f"jax {jax.__version__}, {device.platform} ({device.device_kind}), {shape}, runtime rounds {rounds}")
    rows = []
    for layers in args.layers:
        rows += run(
            shape, layers, args.variants, rounds, sharding, log=lambda s: print(s, flush=True), split=args.split
        )
    print(table(rows, runtime=rounds > 0, h100=sharding is not None, split=args.split))
    if args.json:
        write_json(args.json, rows, device=device.device_kind, **dataclasses.asdict(shape), runtime_rounds=rounds)
    return rows


if __name__ == "__main__":
    main()
