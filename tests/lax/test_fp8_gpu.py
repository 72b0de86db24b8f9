"""FP8 matmuls on a GPU: a scalified FP8 ``dot_general`` is an FP8 GEMM with no dequantised copy.

Marked ``gpu`` (deselected by default: run with ``pytest -m gpu``). Design section 8: a scaled
``dot_general`` on FP8 data emits ``lax.dot_general`` on the FP8 data with a BF16 or F32
result; XLA must run it as an FP8 GEMM whose operands are the FP8 arrays themselves (no
conversion to BF16/F32 first), and the unit-scaling ``1/r`` must not cost a pass of its own.

The compiled-HLO tests compile for the local GPU if it has FP8 GEMMs (compute capability
>= 8.9), otherwise ahead of time for an H100 with no device when JAX's CUDA plugin is
installed (``pip install "jax[cuda12]"``, and ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` on a
machine without a GPU), otherwise they skip. Each compiles twice: with XLA's defaults and with
Triton GEMMs disabled, which covers both backends XLA's autotuner chooses from (a Triton
GEMM fusion, a cuBLASLt ``__cublas$lt$matmul$f8`` custom call). The value test needs the GPU.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_scalify as jsa
from jax_scalify.analysis import entry_kernels, fp8_upcasts, gemm_calls

pytestmark = pytest.mark.gpu

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
DOT_DIMS = (((1,), (0,)), ((), ()))
BACKENDS = {"xla-default": {}, "cublaslt": {"xla_gpu_enable_triton_gemm": False}}


def _local_fp8_gpu() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and float(getattr(device, "compute_capability", "0")) >= 8.9


@pytest.fixture(scope="module")
def target():
    """``(sharding or None, lowering platforms)``: the local FP8 GPU, or a compile-only H100."""
    if _local_fp8_gpu():
        return None, None
    try:
        from benchmarks.h100 import h100_sharding

        return h100_sharding(), ("cuda",)
    except (ImportError, NotImplementedError, RuntimeError) as error:
        pytest.skip(
            f"no GPU with FP8 GEMMs, and no deviceless CUDA compilation ({error}); to compile for an "
            "H100 without a GPU: pip install 'jax[cuda12]' and set JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1"
        )


def compiled_hlo(target, fn, *args, options=None) -> str:
    """Optimised HLO of ``jax.jit(fn)`` for ``args``, built by ``arg(spec)`` callables.

    ``spec(shape, dtype)`` gives an abstract array placed on the target.
    """
    sharding, platforms = target

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    lowered = jax.jit(fn).trace(*(arg(spec) for arg in args)).lower(lowering_platforms=platforms)
    return lowered.compile(compiler_options=options or {}).as_text()


def plain(shape, dtype):
    return lambda spec: spec(shape, dtype)


def scaled(shape, dtype):
    return lambda spec: jsa.ScaledArray(spec(shape, dtype), spec((), jnp.float32))


def array_kernels(hlo: str) -> int:
    """Kernels of the entry computation that produce an array of more than one element.

    XLA:GPU writes a scalar fusion's result as ``f32[1]`` (then bitcast to ``f32[]``).
    """

    def elements(dims: str) -> int:
        return int(np.prod([int(d) for d in dims.split(",") if d.strip()], dtype=np.int64))

    return sum(any(elements(d) > 1 for d in re.findall(r"\[([^\]]*)\]", k)) for k in entry_kernels(hlo))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", [(64, 128, 32), (1024, 2048, 512)])
def test_scalified_fp8_dot_general_is_one_fp8_gemm(target, backend, out_dtype, shape):
    """The scale rule alone (static policy): the default policy's statistic of the result is
    a cost of its own, counted by ``benchmarks/cost_at_scale.py``."""
    m, k, n = shape

    def dot(a, b):
        return lax.dot_general(a, b, DOT_DIMS, preferred_element_type=out_dtype)

    options = BACKENDS[backend]
    scaled_hlo = compiled_hlo(
        target,
        jsa.scalify(dot, policy=jsa.RescalePolicy.static()),
        scaled((m, k), E4M3),
        scaled((k, n), E4M3),
        options=options,
    )
    plain_hlo = compiled_hlo(target, dot, plain((m, k), E4M3), plain((k, n), E4M3), options=options)
    (call,) = gemm_calls(scaled_hlo)
    assert call.is_fp8, call
    if backend == "cublaslt":
        assert call.backend == "cublas", call
    assert fp8_upcasts(scaled_hlo) == []
    # The 1/r is applied inside the GEMM (epilogue or alpha): no extra pass over the output.
    assert array_kernels(scaled_hlo) == array_kernels(plain_hlo), (array_kernels(scaled_hlo), array_kernels(plain_hlo))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_linear_layer_runs_its_three_matmuls_as_fp8_gemms(target, backend):
    """``jsa.nn.linear`` with E4M3 forward and E5M2 backward: forward and both gradients are FP8."""

    def loss(w, x):
        y = jsa.nn.linear(x, w, fwd_dtype=E4M3, bwd_dtype=E5M2, preferred_element_type=jnp.bfloat16)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    step = jsa.scalify(jax.value_and_grad(loss, argnums=(0, 1)))
    hlo = compiled_hlo(
        target, step, scaled((256, 64), jnp.bfloat16), scaled((128, 256), jnp.bfloat16), options=BACKENDS[backend]
    )
    calls = gemm_calls(hlo)
    assert len(calls) == 3 and all(call.is_fp8 for call in calls), calls
    assert fp8_upcasts(hlo) == []


def test_scalified_fp8_matmul_values_on_the_gpu():
    if not _local_fp8_gpu():
        pytest.skip("needs a GPU with FP8 GEMMs (compute capability >= 8.9)")
    rng = np.random.default_rng(0)
    a = jsa.ScaledArray(jnp.asarray(rng.standard_normal((256, 512)), E4M3), jnp.float32(2.0**-4))
    b = jsa.ScaledArray(jnp.asarray(rng.standard_normal((512, 128)), E4M3), jnp.float32(2.0**3))

    def dot(a, b):
        return lax.dot_general(a, b, DOT_DIMS, preferred_element_type=jnp.bfloat16)

    out = jax.jit(jsa.scalify(dot))(a, b)
    assert out.dtype == jnp.bfloat16
    expected = np.asarray(a.to_array(jnp.float32)) @ np.asarray(b.to_array(jnp.float32))
    got = np.asarray(out.to_array(jnp.float32))
    np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())
