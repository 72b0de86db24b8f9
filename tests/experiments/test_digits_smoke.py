"""Smoke test of the digits demo: a short run in FP32 and in scaled FP8."""
from __future__ import annotations

import math

import pytest

pytest.importorskip("sklearn")

from experiments import digits  # noqa: E402


def test_digits_fp32_and_scaled_fp8(capsys):
    results = digits.main(["--epochs", "1", "--runs", "FP32,FP8 scalify"])
    assert set(results) == {"FP32", "FP8 scalify"}
    for r in results.values():
        assert all(math.isfinite(x) for x in r["losses"])
        assert r["losses"][-1] < r["losses"][0]
        assert r["test_accuracy"] > 0.5
    assert "FP8 scalify" in capsys.readouterr().out
