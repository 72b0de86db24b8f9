"""FP8 matmuls compiled for an H100 without a GPU: which GEMMs XLA emits, on which types.

Run (needs the CUDA plugin of JAX, which installs without a GPU)::

    pip install "jax[cuda12]"
    python -m benchmarks.fp8_deviceless

XLA compiles ahead of time for a described GPU (compute capability 9.0, an H100 SXM) with no
device attached ("deviceless" compilation). Without a device there is no autotuning, so XLA
takes its default GEMM backend for each matmul; with a device the autotuner may pick another
one (cuBLASLt or Triton), which is why the second pass compiles with Triton GEMMs disabled:
between them the two passes cover both backends the autotuner can choose from. Nothing is
run: the script reports, for each program, its GEMMs (backend, element types of the matrix
operands where the GEMM reads them), the FP8-to-wider ``convert`` instructions (a
dequantised copy would show there), and the number of kernels in the entry computation.

``--overhead`` also compiles the steps of :mod:`benchmarks.overhead` (MLP and 4-layer GPT,
float32 and float16), plain and scalified, for the H100: kernels of the entry computation
and of the whole module (loop bodies included), and the trace+lower+compile CPU time
(interleaved, median; cold caches). A deviceless compile skips autotuning, which a real
device adds to both sides.
"""

from __future__ import annotations

import functools
import os

# Before JAX is imported: no device is needed, and none should be initialised.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_scalify as jsa  # noqa: E402
from jax_scalify.analysis import entry_kernels, fp8_upcasts, gemm_calls  # noqa: E402

from . import overhead  # noqa: E402
from .common import abstract  # noqa: E402
from .fp8_matmul import DOT_DIMS, E4M3, GPT, gpt_inputs, make_gpt_step  # noqa: E402
from .h100 import H100_TARGET, h100_sharding  # noqa: E402


def programs(sharding, size: int) -> dict:
    """name -> (function, abstract arguments)."""

    def dot(out_dtype):
        return lambda a, b: jax.lax.dot_general(a, b, DOT_DIMS, preferred_element_type=out_dtype)

    fp8 = jax.ShapeDtypeStruct((size, size), E4M3, sharding=sharding)
    bf16 = jax.ShapeDtypeStruct((size, size), jnp.bfloat16, sharding=sharding)
    scale = jax.ShapeDtypeStruct((), jnp.float32, sharding=sharding)
    scaled = jsa.ScaledArray(fp8, scale)
    out = {
        "bf16 matmul, plain": (lambda a, b: a @ b, (bf16, bf16)),
        "fp8 matmul -> bf16, plain": (dot(jnp.bfloat16), (fp8, fp8)),
        "fp8 matmul -> bf16, scalify": (jsa.scalify(dot(jnp.bfloat16)), (scaled, scaled)),
        "fp8 matmul -> f32, scalify": (jsa.scalify(dot(jnp.float32)), (scaled, scaled)),
    }
    for name, use_fp8 in (("GPT step, bf16 matmuls, scalify", False), ("GPT step, fp8 matmuls, scalify", True)):
        step, opt = make_gpt_step(use_fp8)
        out[name] = (jsa.scalify(step), abstract(jax.eval_shape(functools.partial(gpt_inputs, GPT, opt)), sharding))
    return out


def kernel_count(hlo: str) -> int:
    """Fusions and custom calls of the entry computation (each one GPU kernel or library call)."""
    return len(entry_kernels(hlo))


def report(name: str, hlo: str) -> None:
    calls = gemm_calls(hlo)
    kinds = sorted({f"{c.backend}:{c.operand_types[0]}x{c.operand_types[1]}" for c in calls})
    fp8 = sum(c.is_fp8 for c in calls)
    print(
        f"  {name:<34}{len(calls):>6}{fp8:>6}{len(fp8_upcasts(hlo)):>9}{kernel_count(hlo):>9}  {', '.join(kinds)}",
        flush=True,
    )


def overhead_report(sharding, rounds: int) -> None:
    steps = {
        "mlp_fp32": (overhead.mlp_step, lambda: overhead.mlp_inputs(jnp.float32)),
        "mlp_fp16": (overhead.mlp_step, lambda: overhead.mlp_inputs(jnp.float16)),
        "gpt_fp32": (overhead.gpt_step, lambda: overhead.gpt_inputs(jnp.float32)),
        "gpt_fp16": (overhead.gpt_step, lambda: overhead.gpt_inputs(jnp.float16)),
    }
    print(f"overhead benchmarks compiled for the H100 (compile CPU s: median of {rounds}, interleaved)")
    print(f"  {'step':<10}{'kernels plain':>15}{'scalify':>9}{'compile plain':>15}{'scalify':>9}{'ratio':>7}")
    for name, (step, make) in steps.items():
        inputs = make()
        variants = {"plain": (step, inputs), "scalify": (jsa.scalify(step), jsa.as_scaled_array(inputs))}
        variants = {k: (fn, abstract(jax.eval_shape(lambda a=a: a), sharding)) for k, (fn, a) in variants.items()}
        seconds = {k: [] for k in variants}
        kernels = {}
        for _ in range(rounds):
            for k, (fn, fn_args) in variants.items():
                jax.clear_caches()
                start = time.process_time()
                hlo = jax.jit(fn).trace(*fn_args).lower(lowering_platforms=("cuda",)).compile().as_text()
                seconds[k].append(time.process_time() - start)
                kernels[k] = kernel_count(hlo)
        plain_s, scaled_s = (statistics.median(seconds[k]) for k in ("plain", "scalify"))
        print(
            f"  {name:<10}{kernels['plain']:>15}{kernels['scalify']:>9}{plain_s:>15.2f}{scaled_s:>9.2f}{scaled_s / plain_s:>7.2f}",
            flush=True,
        )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="M = K = N of the single matmuls")
    parser.add_argument("--overhead", action="store_true", help="also compile the overhead benchmarks' steps")
    parser.add_argument("--rounds", type=int, default=3, help="compile rounds for --overhead")
    args = parser.parse_args(argv)
    try:
        sharding = h100_sharding()
    except (NotImplementedError, RuntimeError) as error:
        raise SystemExit(
            f"deviceless CUDA compilation is not available ({error}); install it with: pip install 'jax[cuda12]'"
        ) from error
    print(f"jax {jax.__version__}, compiled for {H100_TARGET.split('device_description_str: ')[1].strip()} (no device)")
    for title, options in (
        ("XLA defaults (no autotuning)", {}),
        ("Triton GEMMs disabled", {"xla_gpu_enable_triton_gemm": False}),
    ):
        print(f"{title}:")
        print(f"  {'program':<34}{'GEMMs':>6}{'FP8':>6}{'upcasts':>9}{'kernels':>9}  GEMM backends: operand types")
        for name, (fn, fn_args) in programs(sharding, args.size).items():
            lowered = jax.jit(fn).trace(*fn_args).lower(lowering_platforms=("cuda",))
            report(name, lowered.compile(compiler_options=options).as_text())
    if args.overhead:
        overhead_report(sharding, args.rounds)


if __name__ == "__main__":
    main()
