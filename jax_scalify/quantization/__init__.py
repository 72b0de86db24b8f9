"""Quantization helpers: power-of-two truncation and the OCP MX E8M0 scale encoding."""

from .scale import as_e8m0, from_e8m0, pow2_truncate

__all__ = ["as_e8m0", "from_e8m0", "pow2_truncate"]
