"""Which GEMMs a compiled GPU program runs, and on which element types.

FP8 training pays off only if XLA runs the matmuls as FP8 GEMMs: the FP8 operands must reach
the GEMM as they are, not converted to BF16 or F32 first. Two GPU backends can run them, and
XLA's autotuner picks one per matmul:

- a cuBLAS(Lt) custom call (``__cublas$lt$matmul$f8`` for FP8 operands);
- a Triton GEMM fusion (a ``kCustom`` fusion of kind ``__triton_gemm`` or
  ``__triton_nested_gemm_fusion``) whose ``dot`` takes FP8 operands.

    hlo = jax.jit(jsa.scalify(step)).lower(*args).compile().as_text()
    for call in jsa.analysis.gemm_calls(hlo):
        print(call.name, call.backend, call.operand_types, call.is_fp8)
    assert not jsa.analysis.fp8_upcasts(hlo)  # no FP8 operand dequantised before its GEMM

The functions read the text of the optimised HLO module (``Compiled.as_text()``); they find
nothing in a CPU program, whose matmuls are neither custom calls nor Triton fusions.
"""

from __future__ import annotations

import dataclasses
import re

CUBLAS_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
TRITON_GEMM_KINDS = ("__triton_gemm", "__triton_nested_gemm_fusion")

_DEFINITION = re.compile(r"(%[\w.\-]+) = (\w+)\[")
_NAME = re.compile(r"%[\w.\-]+")
_COMPUTATION_HEADER = re.compile(r"^(?:ENTRY )?(%[\w.\-]+) \(", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class GemmCall:
    """One GEMM of a compiled GPU program.

    Attributes:
      name: the HLO instruction (custom call or fusion).
      backend: ``"cublas"`` (a cuBLAS or cuBLASLt custom call) or ``"triton"`` (a Triton
        GEMM fusion).
      operand_types: HLO element types of the two matrix operands as the GEMM reads them,
        e.g. ``("f8e4m3fn", "f8e4m3fn")``.
    """

    name: str
    backend: str
    operand_types: tuple[str, str]

    @property
    def is_fp8(self) -> bool:
        """Both matrix operands are FP8 (any ``f8*`` HLO type) where the GEMM reads them."""
        return all(t.startswith("f8") for t in self.operand_types)


def _element_types(hlo: str) -> dict[str, str]:
    """Instruction or parameter name -> element type (tuple-shaped values are left out)."""
    return dict(_DEFINITION.findall(hlo))


def _computations(hlo: str) -> dict[str, str]:
    """Computation name -> its text (header to closing brace)."""
    bodies = {}
    for match in _COMPUTATION_HEADER.finditer(hlo):
        end = hlo.find("\n}", match.end())
        bodies[match.group(1)] = hlo[match.start() : len(hlo) if end < 0 else end]
    return bodies


def _operand_names(line: str, opcode: str) -> list[str]:
    operands = re.search(re.escape(opcode) + r"\(([^)]*)\)", line)
    return _NAME.findall(operands.group(1)) if operands else []


def _pair(types: dict[str, str], names: list[str]) -> tuple[str, str]:
    """Element types of the first two operands (the matrices); ``"?"`` where unknown."""
    lhs, rhs = (names + ["", ""])[:2]
    return types.get(lhs, "?"), types.get(rhs, "?")


def _dot_operands(computation: str, computations: dict[str, str], depth: int = 0) -> list[str]:
    """Operand names of the ``dot`` of a GEMM fusion (looking into nested fusions if needed)."""
    for line in computation.splitlines():
        if re.search(r"\sdot\(", line):
            return _operand_names(line, "dot")
    if depth < 4:
        for called in re.findall(r"calls=(%[\w.\-]+)", computation):
            if called in computations:
                found = _dot_operands(computations[called], computations, depth + 1)
                if found:
                    return found
    return []


def _line_name(line: str) -> str:
    match = re.search(r"(%[\w.\-]+) =", line)
    return match.group(1) if match else "?"


def gemm_calls(hlo: str) -> list[GemmCall]:
    """Every cuBLAS/cuBLASLt GEMM custom call and Triton GEMM fusion of a compiled GPU module.

    Args:
      hlo: the text of the optimised HLO module, ``jax.jit(f).lower(...).compile().as_text()``.

    Returns:
      One :class:`GemmCall` per GEMM, in the order of the text. Empty for a module with no
      GPU GEMM (e.g. compiled for CPU).
    """
    types = _element_types(hlo)
    computations = _computations(hlo)
    calls = []
    for line in hlo.splitlines():
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if " custom-call(" in line and target and target.group(1) in CUBLAS_GEMM_TARGETS:
            operands = _operand_names(line, "custom-call")
            calls.append(GemmCall(_line_name(line), "cublas", _pair(types, operands)))
            continue
        kind = re.search(r'"kind":"([^"]+)"', line)
        called = re.search(r"calls=(%[\w.\-]+)", line)
        if " fusion(" in line and kind and kind.group(1) in TRITON_GEMM_KINDS and called:
            operands = _dot_operands(computations.get(called.group(1), ""), computations)
            calls.append(GemmCall(_line_name(line), "triton", _pair(types, operands)))
    return calls


def entry_kernels(hlo: str) -> list[str]:
    """Result types of the fusions and custom calls of the entry computation, e.g. ``"f32[]"``.

    On a GPU each is one kernel launch or library call; a result of one element (``f32[]``,
    or ``f32[1]`` as XLA:GPU writes a scalar fusion's result) is a scalar kernel.
    """
    start = hlo.find("\nENTRY ")
    if start < 0:
        return []
    end = hlo.find("\n}", start)
    entry = hlo[start : len(hlo) if end < 0 else end]
    return re.findall(r"= (\([^)]*\)|\S+) (?:fusion|custom-call)\(", entry)


def fp8_upcasts(hlo: str) -> list[str]:
    """``convert`` instructions that turn an FP8 value into BF16, F16 or F32 (``"%src -> %dst"``).

    A scalified FP8 matmul should have none: its operands reach the GEMM as FP8.
    """
    types = _element_types(hlo)
    found = []
    for line in hlo.splitlines():
        match = re.search(r"(%[\w.\-]+) = (bf16|f16|f32)\[[^\]]*\]\S* convert\((%[\w.\-]+)\)", line)
        if match and types.get(match.group(3), "").startswith("f8"):
            found.append(f"{match.group(3)} -> {match.group(1)}")
    return found


__all__ = ["CUBLAS_GEMM_TARGETS", "GemmCall", "TRITON_GEMM_KINDS", "entry_kernels", "fp8_upcasts", "gemm_calls"]
