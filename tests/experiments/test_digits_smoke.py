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
    out = capsys.readouterr().out
    assert "FP8 scalify" in out
    assert any(line.startswith("FP8 scalify ") and "accuracy points" in line for line in out.splitlines())
    assert "compile (s)" in out and "step (ms)" in out
    for r in results.values():  # compilation is timed apart from the steps
        assert r["compile_seconds"] > 0 and r["step_ms"] > 0
        assert r["step_ms"] / 1e3 < r["compile_seconds"]


def _result(accuracy, loss):
    return {"test_accuracy": accuracy, "final_loss": loss, "losses": [loss], "compile_seconds": 1.0, "step_ms": 1.0}


def test_explain_says_when_fp8_without_scales_matches_and_when_it_falls_behind():
    same = digits.explain(
        {"FP32": _result(0.98, 0.05), "FP8 scalify": _result(0.98, 0.05), "FP8 plain": _result(0.975, 0.06)}
    )
    assert same[0].startswith("FP8 scalify matches FP32 in test accuracy: +0.00 accuracy points")
    assert "final training loss 0.0500 against FP32's 0.0500 (+0.0%), which the verdict does not judge" in same[0]
    assert "costs no accuracy, not that it is needed" in same[-1]
    behind = digits.explain({"FP32": _result(0.98, 0.05), "FP8 plain": _result(0.80, 0.6)})
    assert behind[0].startswith("FP8 plain falls behind FP32 in test accuracy: -18.00 accuracy points")
    assert "leave the E4M3/E5M2 ranges" in behind[-1]
    assert digits.explain({"FP8 plain": _result(0.8, 0.6)}) == []
