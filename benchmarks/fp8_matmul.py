"""FP8 under scalify: a scaled ``float8_e4m3fn`` matmul, and a GPT step with FP8 matmuls vs BF16.

Run: ``python -m benchmarks.fp8_matmul`` (``--size 4096``, ``--rounds 20``).

On a GPU (FP8 GEMMs need compute capability >= 8.9, e.g. H100):

1. matmul ``(M, K) x (K, N)``: the scalified dot_general of ``float8_e4m3fn`` data with a
   ``bfloat16`` (and a ``float32``) result, against the plain BF16 matmul; median times,
   TFLOP/s, and whether every GEMM of the compiled HLO reads the FP8 operands as they are (a
   cuBLASLt ``__cublas$lt$matmul$f8`` call or a Triton FP8 GEMM fusion, whichever XLA's
   autotuner picks; see :mod:`jax_scalify.analysis.hlo`) with no conversion before it;
2. the 4-layer GPT training step of :mod:`benchmarks.overhead` (BF16 weights), scalified,
   with the four linear layers of each block in FP8 (:func:`jax_scalify.nn.linear`: E4M3
   operands forward, E5M2 output cotangent backward, BF16 results) against the same step
   with BF16 matmuls.

Without a GPU it prints ``no GPU: timings skipped`` and runs tiny versions of both for
correctness only (the FP8 results against float32 references, within FP8 round-off).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_scalify as jsa
from jax_scalify.analysis import fp8_upcasts, gemm_calls

from .common import interleaved_medians
from .overhead import GPT, gpt_init

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
DOT_DIMS = (((1,), (0,)), ((), ()))


def has_fp8_gpu() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and float(getattr(device, "compute_capability", "0")) >= 8.9


# --- matmul -------------------------------------------------------------------------------------
def fp8_dot(out_dtype):
    def dot(a, b):
        return jax.lax.dot_general(a, b, DOT_DIMS, preferred_element_type=out_dtype)

    return dot


def fp8_operands(m: int, k: int, n: int, seed: int = 0):
    """Unit-RMS random operands: E4M3 ScaledArrays (power-of-two scales) and their BF16 values."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32) * 3.0
    b = rng.standard_normal((k, n)).astype(np.float32) / 5.0
    sa, sb = jsa.as_scaled_array(jnp.asarray(a)), jsa.as_scaled_array(jnp.asarray(b))
    a8, b8 = jsa.tree.astype(sa, E4M3), jsa.tree.astype(sb, E4M3)
    return (a8, b8), (jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16)), (a, b)


def fp8_gemm_in_hlo(hlo: str) -> tuple[bool, bool]:
    """(every GEMM of the compiled program reads FP8 operands, some FP8 value is converted to a wider type)."""
    calls = gemm_calls(hlo)
    return bool(calls) and all(call.is_fp8 for call in calls), bool(fp8_upcasts(hlo))


def matmul_benchmark(size: int, rounds: int) -> None:
    (a8, b8), (a16, b16), _ = fp8_operands(size, size, size)
    flops = 2.0 * size**3
    fns = {
        "bf16 plain": (jax.jit(lambda a, b: a @ b), (a16, b16)),
        "fp8->bf16 scalify": (jax.jit(jsa.scalify(fp8_dot(jnp.bfloat16))), (a8, b8)),
        "fp8->f32 scalify": (jax.jit(jsa.scalify(fp8_dot(jnp.float32))), (a8, b8)),
    }
    times = interleaved_medians({name: (lambda f=f, a=a: f(*a)) for name, (f, a) in fns.items()}, rounds, repeat=5)
    print(f"matmul {size}x{size}x{size}")
    print(f"{'variant':<20}{'ms':>10}{'TFLOP/s':>10}{'vs bf16':>9}  fp8 GEMM in HLO / FP8 operand upcast")
    for name, (fn, args) in fns.items():
        gemm, upcast = fp8_gemm_in_hlo(fn.lower(*args).compile().as_text())
        ms = 1e3 * times[name]
        print(
            f"{name:<20}{ms:>10.3f}{flops / times[name] / 1e12:>10.1f}{times['bf16 plain'] / times[name]:>9.2f}  {gemm} / {upcast}"
        )


# --- GPT step with FP8 matmuls --------------------------------------------------------------------
def make_matmul(fp8: bool):
    """``x @ w``; with ``fp8`` the FP8 recipe of :func:`jax_scalify.nn.linear`.

    Forward: both operands cast to E4M3; backward: the output cotangent cast to E5M2, so the
    two gradient matmuls are FP8 too (E5M2 x E4M3). All three accumulate into BF16.
    """

    def matmul(x, w):
        if not fp8:
            return x @ w
        return jsa.nn.linear(x, w, fwd_dtype=E4M3, bwd_dtype=E5M2, preferred_element_type=jnp.bfloat16)

    return matmul


def layer_norm(x, gain):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype) * gain


def make_gpt_step(fp8: bool, heads: int = GPT["heads"]):
    mm = make_matmul(fp8)
    opt = optax.adam(1e-3)

    def block(x, p):
        b, t, d = x.shape
        q, k, v = jnp.split(mm(layer_norm(x, p["ln1"]), p["qkv"]), 3, axis=-1)
        q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
        mask = jnp.tril(jnp.ones((t, t), bool))
        attn = jax.nn.softmax(jnp.where(mask, logits.astype(jnp.float32), -1e9), axis=-1).astype(x.dtype)
        x = x + mm(jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, t, d), p["proj"])
        return x + mm(jax.nn.gelu(mm(layer_norm(x, p["ln2"]), p["up"])), p["down"])

    def loss_fn(params, tokens):
        x = params["embed"][tokens[:, :-1]] + params["pos"][: tokens.shape[1] - 1]
        x, _ = jax.lax.scan(lambda h, p: (block(h, p), None), x, params["layers"])
        logits = (layer_norm(x, params["ln_f"]) @ params["embed"].T).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return step, opt


def gpt_inputs(config: dict, opt):
    key = jax.random.PRNGKey(0)
    params = jsa.tree.astype(gpt_init(key, **config), jnp.bfloat16)
    tokens = jax.random.randint(key, (config["batch"], config["seq"] + 1), 0, config["vocab"])
    return jsa.as_scaled_array((params, opt.init(params))) + (tokens,)


def gpt_benchmark(rounds: int) -> None:
    runs = {}
    for name, fp8 in (("bf16 matmuls", False), ("fp8 matmuls", True)):
        step, opt = make_gpt_step(fp8)
        runs[name] = (jax.jit(jsa.scalify(step)), gpt_inputs(GPT, opt))
    times = interleaved_medians({n: (lambda f=f, a=a: f(*a)) for n, (f, a) in runs.items()}, rounds)
    print(f"GPT step (scalified, BF16 weights, {GPT})")
    for name, (fn, args) in runs.items():
        hlo = fn.lower(*args).compile().as_text()
        calls = gemm_calls(hlo)
        print(
            f"{name:<20}{1e3 * times[name]:>10.2f} ms{times['bf16 matmuls'] / times[name]:>9.2f}x vs bf16"
            f"   {sum(c.is_fp8 for c in calls)} of {len(calls)} GEMMs FP8, {len(fp8_upcasts(hlo))} FP8 upcasts"
        )


# --- CPU: correctness only ------------------------------------------------------------------------
def cpu_correctness() -> None:
    (a8, b8), _, (a, b) = fp8_operands(32, 64, 16)
    expected = a @ b
    for out_dtype in (jnp.bfloat16, jnp.float32):
        out = jsa.scalify(fp8_dot(out_dtype))(a8, b8)
        err = float(np.max(np.abs(np.asarray(out.to_array(jnp.float32)) - expected)) / np.max(np.abs(expected)))
        print(f"fp8 matmul -> {np.dtype(out_dtype).name}: data {out.dtype}, max error / max |value| = {err:.4f}")
        assert err < 0.1, err
    small = dict(vocab=32, seq=16, width=32, heads=2, layers=2, batch=2)
    losses = {}
    for name, fp8 in (("bf16", False), ("fp8", True)):
        step, opt = make_gpt_step(fp8, heads=small["heads"])
        losses[name] = float(jax.jit(jsa.scalify(step))(*gpt_inputs(small, opt))[0].to_array(jnp.float32))
    print(f"tiny GPT step loss: bf16 matmuls {losses['bf16']:.4f}, fp8 matmuls {losses['fp8']:.4f}")
    assert abs(losses["bf16"] - losses["fp8"]) < 0.05 * abs(losses["bf16"]), losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="M = K = N of the matmul")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind} ({jax.devices()[0].platform})")
    if not has_fp8_gpu():
        print("no GPU: timings skipped (FP8 GEMMs need a GPU with compute capability >= 8.9); CPU correctness run:")
        cpu_correctness()
        return
    matmul_benchmark(args.size, args.rounds)
    gpt_benchmark(args.rounds)


if __name__ == "__main__":
    main()
