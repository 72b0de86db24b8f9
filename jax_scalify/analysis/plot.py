"""A chart of a :class:`~jax_scalify.analysis.ScaleReport`: log2 RMS per op against format ranges.

One row per recorded value, in execution order from top to bottom (forward, then backward,
then update, separated by horizontal rules), labelled with its index, op name and source
line; rows of the same user function are grouped by alternating shading and named on the
right. The horizontal axis is log2 RMS, with two series: the value (``data * scale``) and
the data (what the hardware stores). Vertical bands mark the normal range of FP16, E5M2
and E4M3 (darker) and their subnormal range (lighter); a strip on top shows each range
separately.

Ops run down the vertical axis so that 100-300 rows keep readable labels at 1400 pixels
wide (the figure grows in height instead).

matplotlib is imported when a chart is made (``pip install 'jax_scalify[analysis]'``); it
is used through its object API and the Agg canvas, so the global pyplot backend of the
caller is left alone.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from .recorder import ScaleRecord, ScaleReport


@dataclasses.dataclass(frozen=True)
class FormatRange:
    """The log2 range of a floating-point format: subnormal from ``log2_subnormal`` to
    ``log2_normal``, normal from ``log2_normal`` to ``log2_max``."""

    name: str
    color: str
    log2_subnormal: float
    log2_normal: float
    log2_max: float

    @classmethod
    def of(cls, name: str, dtype: Any, color: str) -> FormatRange:
        """The range of a NumPy / ml_dtypes floating dtype."""
        info = ml_dtypes.finfo(np.dtype(dtype))
        bounds = (info.smallest_subnormal, info.tiny, info.max)
        return cls(name, color, *(math.log2(float(b)) for b in bounds))


DEFAULT_FORMATS: tuple[FormatRange, ...] = (
    FormatRange.of("FP16", np.float16, "#1f77b4"),
    FormatRange.of("E5M2", ml_dtypes.float8_e5m2, "#2ca02c"),
    FormatRange.of("E4M3", ml_dtypes.float8_e4m3fn, "#ff7f0e"),
)

_VALUE_COLOR, _DATA_COLOR, _ZERO_COLOR = "#222222", "#d62728", "#7f7f7f"
_ROW_IN = 0.14  # inches per row
_LEFT_IN, _RIGHT_IN = 2.7, 1.3  # margins for the row labels and the group names
_STRIP_ROW_IN = 0.22


def _require_matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            "Plotting a ScaleReport needs matplotlib, which is not installed. Install it with "
            "`pip install 'jax_scalify[analysis]'` (or `pip install matplotlib`); "
            "report.to_table() and report.to_json() work without it."
        ) from err
    return Figure, FigureCanvasAgg


def _row_label(r: ScaleRecord) -> str:
    return f"{r.index} {r.op}  {r.location}"


def _runs(keys: Sequence[Any]) -> list[tuple[int, int, Any]]:
    """Maximal runs ``(start, stop, key)`` of equal consecutive keys."""
    runs: list[tuple[int, int, Any]] = []
    for i, key in enumerate(keys):
        if runs and runs[-1][2] == key:
            runs[-1] = (runs[-1][0], i + 1, key)
        else:
            runs.append((i, i + 1, key))
    return runs


def _x_limits(records: Sequence[ScaleRecord], formats: Sequence[FormatRange]) -> tuple[float, float]:
    finite = [v for r in records for v in (r.log2_rms_value, r.log2_rms_data) if math.isfinite(v)]
    bounds = [f.log2_subnormal for f in formats] + [f.log2_max for f in formats] + finite
    return math.floor(min(bounds)) - 2.0, math.ceil(max(bounds)) + 2.0


def _draw_bands(ax, formats: Sequence[FormatRange]) -> None:
    """Full-height bands (subnormal lighter) with their edges drawn in the format's colour."""
    for f in formats:
        ax.axvspan(f.log2_subnormal, f.log2_normal, color=f.color, alpha=0.05, lw=0, zorder=0)
        ax.axvspan(f.log2_normal, f.log2_max, color=f.color, alpha=0.06, lw=0, zorder=0)
        for x, style in ((f.log2_subnormal, ":"), (f.log2_normal, "-"), (f.log2_max, "-")):
            ax.axvline(x, color=f.color, ls=style, lw=0.9, alpha=0.8, zorder=1)


def _draw_strip(ax, formats: Sequence[FormatRange]) -> None:
    """One bar per format: subnormal range light, normal range dark, with its bounds."""
    for k, f in enumerate(formats):
        ax.barh(k, f.log2_normal - f.log2_subnormal, left=f.log2_subnormal, height=0.7, color=f.color, alpha=0.3, lw=0)
        ax.barh(k, f.log2_max - f.log2_normal, left=f.log2_normal, height=0.7, color=f.color, alpha=0.55, lw=0)
        text = f"normal 2^{f.log2_normal:g} .. 2^{f.log2_max:.1f}   (subnormal from 2^{f.log2_subnormal:g})"
        ax.text((f.log2_normal + f.log2_max) / 2, k, text, va="center", ha="center", fontsize=7, color="black")
    ax.set_yticks(range(len(formats)), [f.name for f in formats], fontsize=8)
    ax.set_ylim(len(formats) - 0.4, -0.6)
    ax.tick_params(axis="x", labelbottom=False)
    ax.grid(axis="x", alpha=0.3)


def _draw_groups(ax, records: Sequence[ScaleRecord]) -> None:
    """Alternate shading of consecutive rows of one user function, named on the right."""
    transform = ax.get_yaxis_transform()  # x in axes coordinates, y in data coordinates
    for k, (start, stop, (_, function)) in enumerate(_runs([(r.phase, r.function) for r in records])):
        if k % 2:
            ax.axhspan(start - 0.5, stop - 0.5, color="#000000", alpha=0.045, lw=0, zorder=0)
        y = (start + stop - 1) / 2
        ax.text(1.005, y, function, transform=transform, fontsize=6.5, va="center", ha="left", clip_on=False)


def _draw_phases(ax, records: Sequence[ScaleRecord], x_right: float) -> None:
    """A rule between passes and the name of each pass at its top right."""
    for start, _stop, phase in _runs([r.phase for r in records]):
        if start > 0:
            ax.axhline(start - 0.5, color="black", lw=1.4, zorder=3)
        ax.text(
            x_right - 0.3, start - 0.35, f"{phase} pass", ha="right", va="top", fontsize=9, fontweight="bold", zorder=4
        )


def _draw_series(ax, records: Sequence[ScaleRecord], x_left: float, x_right: float) -> None:
    """The value and data points; all-zero data at the left edge, no finite element at the right."""
    rows = np.arange(len(records))
    for field, color, marker, label in (
        ("log2_rms_value", _VALUE_COLOR, "o", "value: log2 RMS(data * scale)"),
        ("log2_rms_data", _DATA_COLOR, "D", "data: log2 RMS(data)"),
    ):
        xs = np.array([getattr(r, field) for r in records], dtype=np.float64)
        xs[~np.isfinite(xs)] = np.nan  # drawn by the edge markers below
        filled = marker == "D"
        ax.scatter(
            xs,
            rows,
            s=13 if filled else 22,
            marker=marker,
            zorder=5,
            label=label,
            linewidths=0.9,
            facecolors=color if filled else "none",
            edgecolors=color,
        )
    edges = (
        ([i for i, r in enumerate(records) if r.log2_rms_data == -math.inf], x_left + 0.6, "<", "all zeros"),
        ([i for i, r in enumerate(records) if math.isnan(r.log2_rms_data)], x_right - 0.6, ">", "no finite element"),
    )
    for where, x, marker, label in edges:
        if where:
            ax.scatter([x] * len(where), where, marker=marker, s=18, color=_ZERO_COLOR, zorder=5, label=label)


def _save_png(fig, path: pathlib.Path, dpi: int) -> None:
    """Save as a palette PNG: a chart has few colours, so this keeps the file small."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    buffer.seek(0)
    try:
        from PIL import Image
    except ImportError:  # matplotlib depends on Pillow, but keep the plain PNG if it is missing
        path.write_bytes(buffer.getvalue())
        return
    with Image.open(buffer) as image:
        palette = image.convert("RGB").quantize(colors=128, method=Image.Quantize.FASTOCTREE)
        palette.save(path, format="PNG", optimize=True)


def plot_report(
    report: ScaleReport,
    path: str | os.PathLike,
    title: str | None = None,
    *,
    formats: Sequence[FormatRange] = DEFAULT_FORMATS,
    width_px: int = 1400,
    dpi: int = 100,
    max_rows: int = 3000,
) -> pathlib.Path:
    """Chart the log2 RMS of every recorded value and save it as a PNG at ``path``.

    Args:
        report: a :class:`ScaleReport` (from :func:`record_scales`).
        path: where to write the PNG (parent folders are created).
        title: a title above the chart.
        formats: the format ranges drawn as bands (default FP16, E5M2, E4M3); build others
            with ``FormatRange.of(name, dtype, color)``.
        width_px, dpi: the image width in pixels and the resolution; the height follows
            the number of rows (14 pixels each at 100 dpi).
        max_rows: refuse larger reports (the image would be too tall to read); chart a
            subset instead, e.g. ``ScaleReport(report.select("backward"))``.

    Returns:
        The path written.
    """
    records = list(report.records)
    if not records:
        raise ValueError("Nothing to plot: the report has no records (did the function compute any floating array?).")
    if len(records) > max_rows:
        raise ValueError(
            f"The report has {len(records)} records, more than max_rows={max_rows}: chart a subset, e.g. "
            "ScaleReport(report.select('backward')) or ScaleReport(report.records[:500]), or raise max_rows."
        )
    Figure, FigureCanvasAgg = _require_matplotlib()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    width_in = width_px / dpi
    strip_in = _STRIP_ROW_IN * len(formats) + 0.1
    main_in = _ROW_IN * len(records) + 0.3
    head_in, gap_in, foot_in = 0.7, 0.4, 0.55
    height_in = head_in + strip_in + gap_in + main_in + foot_in
    fig = Figure(figsize=(width_in, height_in), dpi=dpi)
    FigureCanvasAgg(fig)  # the Agg canvas, whatever pyplot's backend is
    left, right = _LEFT_IN / width_in, 1 - _RIGHT_IN / width_in

    def axes_at(top_in: float, h_in: float, **kwargs):
        return fig.add_axes((left, 1 - (top_in + h_in) / height_in, right - left, h_in / height_in), **kwargs)

    ax = axes_at(head_in + strip_in + gap_in, main_in)
    strip = axes_at(head_in, strip_in, sharex=ax)
    x_left, x_right = _x_limits(records, formats)
    ax.set_xlim(x_left, x_right)
    ax.set_ylim(len(records) - 0.5, -0.5)

    _draw_bands(ax, formats)
    _draw_groups(ax, records)
    _draw_series(ax, records, x_left, x_right)
    _draw_phases(ax, records, x_right)
    _draw_strip(strip, formats)

    ax.set_yticks(range(len(records)), [_row_label(r) for r in records], fontsize=6.5, family="monospace")
    ax.tick_params(axis="y", length=0, pad=3)
    ax.tick_params(axis="x", labeltop=True, top=True, labelsize=8)
    ax.xaxis.set_major_locator(_integer_locator())
    ax.grid(axis="x", alpha=0.25, lw=0.6)
    ax.set_xlabel("log2 RMS", fontsize=9)
    if title:
        fig.suptitle(title, x=left, ha="left", y=1 - 0.1 / height_in, va="top", fontsize=12)
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(
        handles,
        labels,
        loc="upper left",
        bbox_to_anchor=(left, 1 - 0.38 / height_in),
        ncols=len(handles),
        fontsize=8,
        frameon=False,
        borderaxespad=0,
        handletextpad=0.3,
        columnspacing=2.0,
    )
    _save_png(fig, path, dpi)
    return path


def _integer_locator():
    """Ticks on integer exponents, steps of 1, 2, 4, 5 or 10 (about 2 apart for the default range)."""
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(nbins=24, integer=True, steps=[1, 2, 4, 5, 10])


__all__ = ["DEFAULT_FORMATS", "FormatRange", "plot_report"]
