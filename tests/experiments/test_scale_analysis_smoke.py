"""The scale-analysis example of docs/scale_analysis.md: what its charts show, as numbers."""

import numpy as np
import pytest

import jax_scalify as jsa
from experiments import scale_analysis


def _log2_data(report: jsa.analysis.ScaleReport, phase: str, dtype=None) -> np.ndarray:
    records = [r for r in report.select(phase) if dtype is None or r.dtype == dtype]
    values = np.array([r.log2_rms_data for r in records])
    return values[np.isfinite(values)]  # all-zero values have no log2


@pytest.mark.slow  # 15 s: traces and records the example twice; the recorder has its own tests
def test_static_scales_leave_the_backward_data_small_and_the_default_policy_keeps_it_near_unit_size():
    static = scale_analysis.analyse(rescale_grad=False, policy=jsa.RescalePolicy.static())
    default = scale_analysis.analyse(rescale_grad=False, policy=jsa.RescalePolicy())
    loss = float(jsa.asarray(static.outputs[0]))
    np.testing.assert_allclose(float(jsa.asarray(default.outputs[0])), loss, rtol=1e-6)  # values never change
    assert np.sum(_log2_data(static, "backward") < -10) > 100  # the docs' table: 132 of 153
    assert _log2_data(default, "backward", "float16").min() > -10  # the docs: -8.4
    assert np.all(np.abs(_log2_data(default, "update")) <= 2)  # the docs: -0.3 .. 1.0
