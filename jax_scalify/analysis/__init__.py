"""Scale analysis: record the log2 RMS of every value of a scalified function, and chart it.

    report = jsa.analysis.record_scales(update, params, batch)
    print(report.to_table(max_rows=40))
    report.plot("scales.png", title="update step")

The chart shows, op by op, the RMS of the values and of the data against the FP16 and FP8
ranges: where the data drifts out of range is where a ``jsa.ops.dynamic_rescale`` helps.
Plotting needs matplotlib (``pip install 'jax_scalify[analysis]'``).
"""

from .hlo import GemmCall, entry_kernels, fp8_upcasts, gemm_calls
from .plot import DEFAULT_FORMATS, FormatRange, plot_report
from .recorder import (
    BACKWARD,
    FORWARD,
    PHASES,
    UPDATE,
    ScaleRecord,
    ScaleRecorder,
    ScaleReport,
    data_fractions,
    log2_rms,
    record_scales,
    scale_statistics,
)

__all__ = [
    "BACKWARD",
    "DEFAULT_FORMATS",
    "FORWARD",
    "FormatRange",
    "GemmCall",
    "PHASES",
    "UPDATE",
    "ScaleRecord",
    "ScaleRecorder",
    "ScaleReport",
    "data_fractions",
    "entry_kernels",
    "fp8_upcasts",
    "gemm_calls",
    "log2_rms",
    "plot_report",
    "record_scales",
    "scale_statistics",
]
