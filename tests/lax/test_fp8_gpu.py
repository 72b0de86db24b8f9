"""FP8 matmuls on a GPU: the scalified FP8 ``dot_general`` compiles to a cuBLASLt FP8 GEMM.

Marked ``gpu`` (deselected by default: run with ``pytest -m gpu``) and skipped without a GPU
with FP8 GEMMs (compute capability >= 8.9: Ada, Hopper and later). Design section 8: a scaled
``dot_general`` on FP8 data emits ``lax.dot_general`` on FP8 operands with a BF16 or F32 result,
which XLA lowers to ``__cublas$lt$matmul$f8``; the FP8 operands must reach the GEMM as they
are (no conversion to BF16/F32 before it).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_scalify as jsa

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU"),
]

E4M3 = jnp.float8_e4m3fn
FP8_GEMM = "__cublas$lt$matmul$f8"


def _require_fp8_gemms():
    capability = float(getattr(jax.devices()[0], "compute_capability", "0"))
    if capability < 8.9:
        pytest.skip(f"FP8 GEMMs need compute capability >= 8.9, this GPU has {capability}")


def _types(hlo: str) -> dict:
    """Instruction name -> element type, from compiled HLO text (operands are printed by name)."""
    return dict(re.findall(r"(%[\w.\-]+) = (\w+)\[", hlo))


def fp8_gemm_operand_types(hlo: str) -> list[tuple[str, str]]:
    """Element types of the two matrix operands of every cuBLASLt FP8 GEMM call."""
    types = _types(hlo)
    calls = re.findall(r"custom-call\(([^)]*)\)[^\n]*custom_call_target=\"__cublas\$lt\$matmul\$f8\"", hlo)
    out = []
    for operands in calls:
        names = re.findall(r"%[\w.\-]+", operands)
        out.append((types.get(names[0], "?"), types.get(names[1], "?")))
    return out


def fp8_upcasts(hlo: str) -> list[str]:
    """``convert`` instructions that turn an FP8 value into bf16 or f32."""
    types = _types(hlo)
    return [
        f"{src} -> {out}"
        for out, src in re.findall(r"= (\w+)\[[^\]]*\]\S* convert\((%[\w.\-]+)\)", hlo)
        if out in ("bf16", "f32") and types.get(src, "").startswith("f8")
    ]


def scaled(x, scale, dtype):
    return jsa.ScaledArray(jnp.asarray(np.asarray(x) / scale, dtype), jnp.float32(scale))


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", [(64, 128, 32), (256, 512, 128)])
def test_scalified_fp8_dot_general_is_a_cublaslt_fp8_gemm(out_dtype, shape):
    _require_fp8_gemms()
    m, k, n = shape
    rng = np.random.default_rng(0)
    a = scaled(rng.standard_normal((m, k)), 2.0**-4, E4M3)
    b = scaled(rng.standard_normal((k, n)), 2.0**3, E4M3)

    def f(a, b):
        return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=out_dtype)

    hlo = jax.jit(jsa.scalify(f)).lower(a, b).compile().as_text()
    assert FP8_GEMM in hlo
    operand_types = fp8_gemm_operand_types(hlo)
    assert operand_types and all(t.startswith("f8e4m3") for pair in operand_types for t in pair), operand_types
    assert not fp8_upcasts(hlo), fp8_upcasts(hlo)

    out = jax.jit(jsa.scalify(f))(a, b)
    assert out.dtype == out_dtype
    expected = np.asarray(a.to_array(jnp.float32)) @ np.asarray(b.to_array(jnp.float32))
    np.testing.assert_allclose(np.asarray(out.to_array(jnp.float32)), expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())


def test_fp8_linear_layer_grad_uses_fp8_gemm():
    """A linear layer casting its operands to E4M3 (cast_on_forward): the forward GEMM is FP8."""
    _require_fp8_gemms()
    rng = np.random.default_rng(1)
    x = jsa.as_scaled_array(jnp.asarray(rng.standard_normal((128, 256)), jnp.bfloat16))
    w = jsa.as_scaled_array(jnp.asarray(rng.standard_normal((256, 64)), jnp.bfloat16))

    def loss(w, x):
        y = jnp.matmul(
            jsa.ops.cast_on_forward(x, E4M3), jsa.ops.cast_on_forward(w, E4M3), preferred_element_type=jnp.bfloat16
        )
        return jnp.sum(y.astype(jnp.float32) ** 2)

    hlo = jax.jit(jsa.scalify(jax.value_and_grad(loss))).lower(w, x).compile().as_text()
    assert FP8_GEMM in hlo
