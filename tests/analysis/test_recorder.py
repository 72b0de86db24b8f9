"""jsa.analysis: recording scale statistics, the text/JSON views and the chart."""

import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa
from jax_scalify.analysis import ScaleRecorder, ScaleReport, log2_rms, record_scales, scale_statistics


def _scaled(data, scale, dtype=jnp.float16):
    return jsa.ScaledArray(jnp.asarray(data, dtype), np.float32(scale))


def _only(report, op):
    records = report.select(op=op)
    assert len(records) == 1, [r.op for r in report]
    return records[0]


# --- statistics on hand-computable examples ---------------------------------------------------
def test_log2_values_of_a_scaled_float16_product():
    # value 2 * 2^-3 = 2^-2; times 2^-10: the constant's exponent folds into the scale.
    x = _scaled(np.full((4, 4), 2.0), 2.0**-3)
    record = _only(record_scales(lambda a: a * 2.0**-10, x), "mul")
    assert record.phase == "forward" and record.scaled
    assert record.shape == (4, 4) and record.dtype == "float16"
    assert record.log2_rms_data == pytest.approx(1.0)
    assert record.log2_scale == pytest.approx(-13.0)
    assert record.log2_rms_value == pytest.approx(-12.0)
    assert record.frac_zero == record.frac_underflow == record.frac_nonfinite == record.frac_overflow == 0.0


def test_data_fractions_of_a_plain_float16_value():
    # 2^-20 is subnormal in float16 (smallest normal 2^-14); inf is above max.
    x = jnp.asarray([2.0**-21, 0.0, 0.5, np.inf], jnp.float16)
    record = _only(record_scales(lambda a: a * 2.0, x), "mul")
    assert not record.scaled and record.log2_scale == 0.0
    assert record.log2_rms_value == record.log2_rms_data
    assert record.log2_rms_data == pytest.approx(math.log2(math.sqrt((2.0**-40 + 1.0) / 3)))
    fractions = (record.frac_zero, record.frac_nonfinite, record.frac_underflow, record.frac_overflow)
    assert fractions == (0.25, 0.25, 0.25, 0.25)


def test_log2_rms_is_exact_and_never_overflows():
    assert log2_rms(np.full((8,), 2.0**-5, np.float16)) == pytest.approx(-5.0)
    assert log2_rms(np.full((3,), 1e300)) == pytest.approx(math.log2(1e300))
    assert log2_rms(np.zeros(4)) == -math.inf
    assert math.isnan(log2_rms(np.array([np.nan, np.inf])))


def test_scale_statistics_of_a_zero_or_broadcast_scale():
    stats = scale_statistics(np.ones((2, 2), np.float16), np.float32(0.0))
    assert stats["log2_scale"] == -math.inf and stats["log2_rms_value"] == -math.inf
    stats = scale_statistics(np.ones((2, 2), np.float16), np.full((2, 1), 4.0, np.float32))
    assert stats["log2_rms_value"] == pytest.approx(2.0) and stats["log2_scale"] == pytest.approx(2.0)


# --- what is recorded -----------------------------------------------------------------------------
def test_plain_function_records_expected_ops_and_skips_scalars_and_integers():
    def f(x):
        y = jnp.tanh(x) @ jnp.ones((4, 3), jnp.float32)
        return jnp.sum(y), jnp.argmax(y, axis=-1)

    report = record_scales(f, jnp.ones((2, 4), jnp.float32))
    assert [r.op for r in report] == ["tanh", "broadcast_in_dim", "dot_general"]
    assert all(r.phase == "forward" and not r.scaled for r in report)
    assert [r.index for r in report] == [0, 1, 2]
    total, _ = report.outputs
    assert float(total) == pytest.approx(6 * 4 * np.tanh(1.0), rel=1e-6)


def test_backward_and_update_passes_under_grad():
    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.sum(jnp.sin(x @ w)))(w)
        return loss, w - 0.5 * g

    report = record_scales(step, _scaled(np.full((4, 4), 0.5), 1.0), _scaled(np.ones((4, 4)), 1.0))
    phases = [r.phase for r in report]
    assert {"forward", "backward", "update"} == set(phases)
    # execution order: forward, then backward, then the update after it
    assert phases == sorted(phases, key=["forward", "backward", "update"].index)
    backward = report.select("backward")
    assert all("transpose" in r.name_stack for r in backward)
    assert "dot_general" in [r.op for r in backward] and "cos" in [r.op for r in report.select("forward")]
    assert [r.op for r in report.select("update")] == ["mul", "sub"]


def test_source_lines_point_at_user_code():
    report = record_scales(lambda a: jnp.exp(a) * 3.0, jnp.ones((2, 2)))
    assert all(r.source.startswith(__file__) for r in report)
    assert all(r.location.startswith("test_recorder.py:") for r in report)
    assert report.records[0].function == "test_source_lines_point_at_user_code"  # <locals>.<lambda> dropped


def test_dynamic_rescale_grad_keeps_the_rescaled_value_and_hides_its_statistics():
    def grad(x):
        return jax.grad(lambda a: jnp.sum(jsa.ops.dynamic_rescale_l2_grad(a * 3.0) ** 2))(x)

    x = jsa.as_scaled_array(jnp.ones((4, 4), jnp.float16))
    report = record_scales(grad, x)
    ops = [r.op for r in report]
    assert "dynamic_rescale" in ops and "abs" not in ops  # the statistic is computed inside the rule
    rescale = _only(report, "dynamic_rescale")
    assert rescale.phase == "backward" and rescale.function == "grad"
    assert 0.0 <= rescale.log2_rms_data < 1.0  # RMS in [1, 2) after the rescale (rounded down)


def test_recorder_context_records_jitted_scalified_functions_compiled_before():
    update = jax.jit(jsa.scalify(lambda a: jax.jit(lambda b: b * 4.0)(a) + 1.0))
    x = jsa.as_scaled_array(jnp.ones((2, 3), jnp.float16))
    update(x)  # compiled without the recorder: the recorder traces it again
    with ScaleRecorder() as recorder:
        out = update(x)
    assert [r.op for r in recorder.records] == ["mul", "add"]
    np.testing.assert_allclose(out.to_array(jnp.float32), 5.0)
    assert record_scales(update, x).records[0].op == "mul"  # an already scalified function works too


def test_scan_records_every_iteration():
    def f(x):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c * 2.0), None), x, None, length=3)[0]

    report = record_scales(f, jsa.as_scaled_array(jnp.ones((2, 2))))
    assert [r.op for r in report] == ["mul", "tanh"] * 3


def _growing_carry_scan(h, w, seen=None):
    """A residual scan whose carry data grows; ``seen`` collects the body's carry data as the program has it."""

    def body(c, _):
        if seen is not None:
            data, _ = jsa.lax.get_data_scale(c)
            jax.debug.callback(lambda d: seen.append(np.asarray(d)), data, ordered=True)
        return c + jnp.tanh((c * 2.0) @ w), None  # `c * 2.0` keeps c's data: only its scale doubles

    return jax.lax.scan(body, h, None, length=4)[0]


def test_records_the_data_of_the_jitted_program():
    # The default policy rescales the carry at every iteration of the compiled scan; the
    # recorder sees the carry data that the compiled program's own callback sees.
    h = jsa.as_scaled_array(jax.random.normal(jax.random.PRNGKey(0), (4, 8))).astype(jnp.float16)
    w = jsa.as_scaled_array(jax.random.normal(jax.random.PRNGKey(1), (8, 8)) / 3).astype(jnp.float16)
    seen = []
    jax.block_until_ready(jax.jit(jsa.scalify(lambda h, w: _growing_carry_scan(h, w, seen)))(h, w))
    jax.effects_barrier()
    recorded = [r.log2_rms_data for r in record_scales(_growing_carry_scan, h, w).select(op="mul")]
    assert len(seen) == len(recorded) == 4
    assert recorded == pytest.approx([log2_rms(d) for d in seen], abs=1e-9)
    assert max(recorded) < 1.0  # every carry rescaled to a data RMS below 2 (rounded down)


def test_backward_of_a_scan_body_is_recorded_as_backward():
    def step(h, w):
        return jax.grad(lambda w: jnp.mean(_growing_carry_scan(h, w) ** 2))(w)

    h = jsa.as_scaled_array(jnp.ones((4, 8), jnp.float16))
    w = jsa.as_scaled_array(jnp.full((8, 8), 0.1, jnp.float16))
    report = record_scales(step, h, w)
    assert len(report.select("backward", op="dot_general")) == 8  # two per iteration, none outside the scan
    assert all("transpose" in r.name_stack for r in report.select("backward"))
    assert not report.select("update")


def test_cond_records_the_taken_branch_only():
    def f(x, pred):
        return jax.lax.cond(pred, lambda a: jnp.tanh(a), lambda a: jnp.sin(a) * 2.0, x)

    x = jsa.as_scaled_array(jnp.ones((2, 2), jnp.float16))
    assert [r.op for r in record_scales(f, x, jnp.asarray(True))] == ["tanh"]
    assert [r.op for r in record_scales(f, x, jnp.asarray(False))] == ["sin", "mul"]


# --- views ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_report() -> ScaleReport:
    def step(w):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(w * 2.0**-10) * 0.0))(w)

    return record_scales(step, _scaled(np.full((4, 4), 2.0), 1.0))


def test_table_format(small_report):
    report = small_report
    table = report.to_table()
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["#", "pass", "op", "shape"] and "source" in lines[0]
    assert len(lines) == 2 + len(report)
    assert "forward" in lines[2] and "4x4" in lines[2] and "float16" in lines[2] and "test_recorder.py:" in lines[2]
    short = report.to_table(max_rows=1).splitlines()
    assert len(short) == 4 and short[-1] == f"... {len(report) - 1} more rows"
    assert "backward" in report.summary() and "forward" in report.summary()


def test_table_shows_non_finite_data_apart_from_zeros():
    """The log2 columns are RMS of the finite entries, so a tensor of zeros and infs read
    ``-inf`` there like an all-zero one; the ``%nonfin`` column tells them apart."""
    report = record_scales(lambda x: 1 / x, _scaled(np.array([0.0, 1.0, 2.0, 4.0]), 1.0))
    header, _, *rows = report.to_table().splitlines()
    end = header.index("%nonfin") + len("%nonfin")
    assert rows[-1][end - 7 : end].strip() == "25.0"


def test_json_format_is_strict_json(small_report):
    report = small_report
    data = json.loads(report.to_json())  # -inf (all zero) becomes null, so strict parsers accept it
    assert len(data["records"]) == len(report)
    first = data["records"][0]
    assert first["op"] == report.records[0].op and first["shape"] == [4, 4] and first["phase"] == "forward"
    zeros = [r for r in data["records"] if r["frac_zero"] == 1.0]
    assert zeros and all(r["log2_rms_data"] is None for r in zeros)


def test_counts_and_select(small_report):
    report = small_report
    counts = report.counts("backward", low=-5.0)
    assert counts["values"] == len(report.select("backward")) > 0
    assert counts["zero"] >= 1
    with pytest.raises(ValueError, match="Unknown phase"):
        report.select("sideways")


def test_plot_writes_a_png(tmp_path, small_report):
    pytest.importorskip("matplotlib")
    path = small_report.plot(tmp_path / "sub" / "scales.png", title="small")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(path) as image:
        assert image.size[0] == 1400


def test_plot_errors(tmp_path, monkeypatch, small_report):
    with pytest.raises(ValueError, match="no records"):
        ScaleReport([]).plot(tmp_path / "empty.png")
    with pytest.raises(ValueError, match="more than max_rows=1"):
        small_report.plot(tmp_path / "tall.png", max_rows=1)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if matplotlib were missing
    with pytest.raises(ImportError, match=r"jax_scalify\[analysis\]"):
        small_report.plot(tmp_path / "x.png")
