"""``jax_scalify.analysis.gemm_calls`` / ``fp8_upcasts`` on GPU programs compiled by XLA.

The fixtures in ``data/`` are optimised HLO modules that XLA compiled for an H100 without a
device (``benchmarks/fp8_deviceless.py``; source tables, metadata and sharding attributes
removed): a scalified E4M3 matmul with a BF16 result as a Triton GEMM fusion and as a
cuBLASLt FP8 custom call (Triton GEMMs disabled), and a BF16 x E4M3 matmul whose FP8
operand XLA converts to BF16 before a cuBLASLt BF16 GEMM.
"""

import pathlib

import jax
import jax.numpy as jnp
import pytest

import jax_scalify as jsa

DATA = pathlib.Path(__file__).parent / "data"


def hlo(name: str) -> str:
    return (DATA / f"{name}.hlo").read_text()


def test_triton_fp8_gemm_fusion_is_found_with_its_fp8_operands():
    (call,) = jsa.analysis.gemm_calls(hlo("fp8_dot_triton"))
    assert call == jsa.analysis.GemmCall("%gemm_fusion_dot_general.1", "triton", ("f8e4m3fn", "f8e4m3fn"))
    assert call.is_fp8
    assert jsa.analysis.fp8_upcasts(hlo("fp8_dot_triton")) == []


def test_cublaslt_fp8_custom_call_is_found_with_its_fp8_operands():
    (call,) = jsa.analysis.gemm_calls(hlo("fp8_dot_cublaslt"))
    assert call.backend == "cublas" and call.operand_types == ("f8e4m3fn", "f8e4m3fn")
    assert call.is_fp8
    assert jsa.analysis.fp8_upcasts(hlo("fp8_dot_cublaslt")) == []


def test_dequantised_operand_shows_as_a_bf16_gemm_and_an_upcast():
    text = hlo("bf16_times_fp8_dot_cublas")
    (call,) = jsa.analysis.gemm_calls(text)
    assert call.operand_types == ("bf16", "bf16") and not call.is_fp8
    assert jsa.analysis.fp8_upcasts(text) == ["%param_0 -> %convert_element_type.1.1"]


def test_cpu_program_has_no_gpu_gemm():
    x = jnp.ones((8, 16), jnp.float32)
    text = jax.jit(lambda a: a @ a.T).lower(x).compile().as_text()
    assert jsa.analysis.gemm_calls(text) == []


@pytest.mark.parametrize(
    "text", ["", "HloModule empty\n\nENTRY %main () -> f32[] {\n  ROOT %c = f32[] constant(1)\n}\n"]
)
def test_module_without_gemm_gives_empty_lists(text):
    assert jsa.analysis.gemm_calls(text) == [] and jsa.analysis.fp8_upcasts(text) == []


def test_entry_kernels_lists_the_result_types_of_fusions_and_custom_calls():
    assert jsa.analysis.entry_kernels(hlo("fp8_dot_triton")) == ["f32[]", "bf16[64,32]{1,0}"]
    assert jsa.analysis.entry_kernels(hlo("fp8_dot_cublaslt"))[-1] == "f32[]"
    assert jsa.analysis.entry_kernels("") == []
