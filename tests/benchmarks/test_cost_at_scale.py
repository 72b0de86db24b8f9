"""Smoke test of ``benchmarks/cost_at_scale.py``: every column and exact counts, on the tiny GPT with no block.

With no transformer block the model is the tied embedding, the final LayerNorm and the
logits, and the step AdamW's: the script's code paths at a few seconds of compilation.
"""

from __future__ import annotations

import json

import jax
import pytest

from benchmarks import cost_at_scale

TINY = ["--tiny", "--layers", "0"]


def _header_and_rows(out: str) -> tuple[list[str], list[list[str]]]:
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    split = lambda line: [cell.strip() for cell in line.strip("|").split("|")]  # noqa: E731
    return split(lines[0]), [split(line) for line in lines[1:]]


def test_table_and_json(tmp_path, capsys):
    path = tmp_path / "cost.json"
    argv = TINY + ["--variants", "plain_fp32", "scalify_fp16", "--rounds", "1", "--json", str(path)]
    rows = cost_at_scale.main(argv)
    header, cells = _header_and_rows(capsys.readouterr().out)
    expected = [name for name, key, _ in cost_at_scale.COLUMNS if not key.startswith(("h100", "grads", "update"))]
    assert header == expected
    assert [r[1] for r in cells] == ["plain_fp32", "scalify_fp16"]
    assert json.loads(path.read_text())["rows"] == rows
    plain, scaled = rows
    for row in rows:
        for key in ("eqns", "gemms", "reductions", "fusions", "hlo_reduce"):
            assert isinstance(row[key], int) and row[key] > 0, (row["variant"], key, row[key])
        assert row["step_ms"] > 0 and row["compile_total_cpu_s"] > 0
    # The tied-embedding logits and their two gradients; scalify changes the data, not the contractions.
    assert plain["gemms"] == scaled["gemms"] == 3
    assert plain["statistics"] is None
    # The baseline of the FP16 recipe is plain FP16, traced (not run) because it was not selected.
    assert isinstance(scaled["statistics"], int) and scaled["statistics"] > 0
    assert scaled["baseline"] == "plain_fp16" and scaled["step_ratio"] is None
    assert plain["compile_ratio"] == 1.0 and plain["step_ratio"] == 1.0


def test_deviceless_columns_or_reason(capsys):
    rows = cost_at_scale.main(TINY + ["--variants", "plain_fp32", "--no-runtime", "--deviceless"])
    out = capsys.readouterr().out
    header, _ = _header_and_rows(out)
    assert "ms/step" not in header
    if "deviceless H100 compilation unavailable" in out:  # JAX's CUDA plugin is not installed
        assert "H100 kernels" not in header and "h100_kernels" not in rows[0]
    else:
        assert {"H100 kernels", "H100 GEMMs", "H100 FP8 GEMMs", "H100 temp MiB", "H100 compile s"} <= set(header)
        assert rows[0]["h100_kernels"] > 0 and rows[0]["h100_gemms"] == 3 and rows[0]["h100_temp_bytes"] > 0


@pytest.mark.slow  # for time: an option of the benchmark; tests/benchmarks/test_step_floor.py checks the floor's folding by default
def test_the_floor_variant_folds_the_scale_arithmetic_of_the_state():
    """Opt-in: the static step with the state's scales as trace-time constants has fewer equations
    and takes the state's data only."""
    assert "scalify_fp16_floor" not in cost_at_scale.DEFAULT_VARIANTS
    argv = TINY + ["--variants", "scalify_fp16_static", "scalify_fp16_floor", "--no-runtime"]
    static, floor = cost_at_scale.main(argv)
    assert floor["eqns"] < static["eqns"] and floor["gemms"] == static["gemms"] == 3
    step, (datas, *_) = cost_at_scale.build(
        "scalify_fp16_floor", cost_at_scale.TINY, 0, cost_at_scale.init_params(cost_at_scale.TINY, 0)
    )
    assert not any(isinstance(x, cost_at_scale.jsa.ScaledArray) for x in datas)


@pytest.mark.slow  # for time: an option of the benchmark, compiled twice
def test_split_into_the_gradient_step_and_the_update(capsys):
    """``--split``: the gradient step compiled alone; the update's share is the rest of the full step's."""
    argv = TINY + ["--variants", "plain_fp16", "scalify_fp16", "--no-runtime", "--split"]
    plain, scaled = cost_at_scale.main(argv)
    header, _ = _header_and_rows(capsys.readouterr().out)
    assert {"grads s", "update s"} <= set(header)
    for row in (plain, scaled):
        assert 0 < row["grads_eqns"] < row["eqns"] and 0 < row["grads_fusions"] < row["fusions"]
        total = row["grads_compile_total_cpu_s"] + row["update_compile_total_cpu_s"]
        assert total == pytest.approx(row["compile_total_cpu_s"])
    assert plain["grads_compile_ratio"] is None  # its baseline, plain_fp32, was not selected
    assert scaled["grads_compile_ratio"] > 0 and scaled["update_compile_ratio"] is not None
    step, _ = cost_at_scale.build("plain_fp16", cost_at_scale.TINY, 0, cost_at_scale.init_params(cost_at_scale.TINY, 0))
    assert step is cost_at_scale.gpt_linen.train_step


def test_policy_site_variants_switch_one_component_of_the_default_policy_off():
    """Opt-in: ``scalify_fp16_no_<site>`` is the README recipe with one component off (traced, not compiled)."""
    assert not any(name.startswith("scalify_fp16_no_") for name in cost_at_scale.DEFAULT_VARIANTS)
    for site in cost_at_scale.POLICY_SITES:
        variant = cost_at_scale.VARIANTS[f"scalify_fp16_no_{site}"]
        assert cost_at_scale._policy(variant) == {"policy": cost_at_scale.jsa.RescalePolicy(**{site: False})}
    params = cost_at_scale.init_params(cost_at_scale.TINY, 0)
    counts = {}
    for name in ("scalify_fp16", "scalify_fp16_no_outputs"):
        step, args = cost_at_scale.build(name, cost_at_scale.TINY, 0, params)
        counts[name] = cost_at_scale.jaxpr_counts(jax.make_jaxpr(step)(*args).jaxpr)
    assert counts["scalify_fp16_no_outputs"]["reductions"] < counts["scalify_fp16"]["reductions"]
