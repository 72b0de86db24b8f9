"""Record the scale statistics of every intermediate value of a scalified function.

:func:`record_scales` runs ``jax.jit(jsa.scalify(fun))``, the program a training loop runs,
and, through :func:`jax_scalify.extend.observe_equations`, puts a host callback
(``jax.debug.callback``) on every floating array output of every equation the interpreter
evaluates. The callbacks run with the values the compiled program computes and record one
:class:`ScaleRecord` each: the primitive, the user source line, the pass (forward,
backward, update), and the log2 RMS of the value, of the data and the log2 scale, with the
fractions of data elements that are zero, non-finite, subnormal (underflow) or above the
dtype's maximum (overflow).

Recording inside the compiled program (rather than evaluating ``scalify`` eagerly under
``jax.disable_jit()``) matters in two ways: eager evaluation sees
every value as a trace-time constant, and ``scalify`` treats constants differently (it
splits them exactly into a power-of-two scale), so the scales of an eager run may differ
from those of the jitted step; and a body traced and then discarded (a loop body retraced
until its carry structure is stable) puts no callback in the program, so only what the
program computes is recorded.

What is left out:

- scalars (0-d outputs), integer and boolean outputs, empty arrays;
- the outputs of equations that hold sub-jaxprs (``scan``, ``cond``, a ``jit`` evaluated
  from a cached trace ...) when the equations inside them were observed. A ``scan`` or
  ``while`` body is recorded once per iteration it runs, a ``cond`` branch only when it is
  taken;
- plain (unscaled) outputs of jax_scalify's own code, e.g. the statistics that
  ``dynamic_rescale`` computes on the data (``include_internal=True`` keeps them); the
  rescaled values (``rebalance``) are kept.

Records are in the order the host receives the callbacks (execution order on one device).

Passes: an equation whose JAX name stack contains ``transpose`` is in the ``"backward"``
pass (``jax.grad`` transposes the linearised forward); any other equation is
``"forward"``, unless it follows a backward equation and is not under ``jvp``, which makes
it ``"update"`` (e.g. the optimizer step after ``jax.value_and_grad``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.extend import source_info_util
from jax.extend.core import JaxprEqn, jaxprs_in_params

from ..core.array import ScaledArray, is_floating_dtype
from ..core.interpreter import observe_equations, scalify

FORWARD, BACKWARD, UPDATE = "forward", "backward", "update"
PHASES = (FORWARD, BACKWARD, UPDATE)

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MAX_FRAMES = 16
_FRAME_RE = re.compile(r"^(?P<file>.*?):(?P<line>\d+)(?::\d+)? \((?P<function>.*)\)$")


@dataclasses.dataclass(frozen=True)
class ScaleRecord:
    """Scale statistics of one floating array output of one equation.

    Log2 values are ``-inf`` for an all-zero array and ``nan`` when no element is finite;
    RMS statistics are computed in float64 on the finite elements only (the fractions say
    how many are not).

    Attributes:
        index: position in execution order (0-based, among the records).
        op: the primitive name (``dot_general``, ``add`` ...).
        phase: ``"forward"``, ``"backward"`` or ``"update"`` (see the module docstring).
        source: the user source line, ``"path:line (function)"``, or ``"unknown"``.
        function: the user function of that line (used to group ops into layers).
        name_stack: JAX's name stack of the equation (e.g. ``"transpose(jvp())"``).
        shape, dtype: those of the data.
        scaled: whether the output is a ``ScaledArray`` (otherwise data is the value, scale 1).
        log2_rms_value: log2 of the RMS of ``data * scale``.
        log2_rms_data: log2 of the RMS of ``data``.
        log2_scale: log2 of the scale (for a non-scalar scale: the effective scale,
            ``log2_rms_value - log2_rms_data``).
        frac_zero: fraction of data elements equal to 0.
        frac_nonfinite: fraction of data elements that are inf or nan.
        frac_underflow: fraction of data elements that are non-zero but below the smallest
            normal number of the data dtype (subnormal: precision is being lost).
        frac_overflow: fraction of data elements above the largest finite number of the
            data dtype in magnitude (for data that was produced in that dtype: the infinities).
    """

    index: int
    op: str
    phase: str
    source: str
    function: str
    name_stack: str
    shape: tuple[int, ...]
    dtype: str
    scaled: bool
    log2_rms_value: float
    log2_rms_data: float
    log2_scale: float
    frac_zero: float
    frac_nonfinite: float
    frac_underflow: float
    frac_overflow: float

    @property
    def location(self) -> str:
        """The source line shortened to ``file.py:line``."""
        match = _FRAME_RE.match(self.source)
        return f"{os.path.basename(match['file'])}:{match['line']}" if match else self.source

    def as_dict(self) -> dict[str, Any]:
        """The record as a JSON-ready dict (non-finite numbers become ``None``)."""
        out = dataclasses.asdict(self)
        out["shape"] = list(self.shape)
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}


# --- statistics --------------------------------------------------------------------------------
def log2_rms(x: Any) -> float:
    """log2 of the root mean square of the finite elements of ``x``, in float64 without overflow.

    ``-inf`` when they are all zero, ``nan`` when none is finite.
    """
    flat = np.asarray(x).astype(np.float64).ravel()
    flat = flat[np.isfinite(flat)]
    if flat.size == 0:
        return math.nan
    peak = float(np.max(np.abs(flat)))
    if peak == 0.0:
        return -math.inf
    return math.log2(peak) + 0.5 * math.log2(float(np.mean(np.square(flat / peak))))


def _finfo(dtype: Any):
    return ml_dtypes.finfo(np.dtype(dtype))


def data_fractions(data: Any) -> dict[str, float]:
    """Fractions of the elements of ``data`` that are zero, non-finite, subnormal, above max."""
    info = _finfo(data.dtype)
    mag = np.abs(np.asarray(data).astype(np.float64))
    n = max(mag.size, 1)
    with np.errstate(invalid="ignore"):
        return {
            "frac_zero": float(np.count_nonzero(mag == 0)) / n,
            "frac_nonfinite": float(np.count_nonzero(~np.isfinite(mag))) / n,
            "frac_underflow": float(np.count_nonzero((mag > 0) & (mag < float(info.tiny)))) / n,
            "frac_overflow": float(np.count_nonzero(mag > float(info.max))) / n,
        }


def scale_statistics(data: Any, scale: Any) -> dict[str, float]:
    """The log2 RMS of value and data, and the log2 scale, of the pair ``(data, scale)``."""
    data = np.asarray(data)
    scale = np.asarray(scale).astype(np.float64)
    log2_data = log2_rms(data)
    if scale.size == 1:
        s = abs(float(scale.reshape(())))
        log2_scale = math.log2(s) if s > 0 else (-math.inf if s == 0 else math.nan)
        log2_value = log2_data + log2_scale  # float arithmetic: -inf stays -inf, nan stays nan
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            log2_value = log2_rms(data.astype(np.float64) * scale)
        both = math.isfinite(log2_value) and math.isfinite(log2_data)
        log2_scale = log2_value - log2_data if both else math.nan
    return {"log2_rms_value": log2_value, "log2_rms_data": log2_data, "log2_scale": log2_scale}


# --- source and pass ----------------------------------------------------------------------------
def _frame_file(frame: str) -> str:
    match = _FRAME_RE.match(frame)
    return match["file"] if match else ""


def _is_library_file(path: str) -> bool:
    return bool(path) and os.path.abspath(path).startswith(_PACKAGE_DIR + os.sep)


def user_source(eqn: JaxprEqn) -> tuple[str, bool]:
    """``(source line, is_internal)`` of an equation.

    The source line is the innermost user frame outside jax_scalify (so a rescale is
    attributed to the model code that asked for it); ``is_internal`` says whether the
    innermost user frame is jax_scalify's own code. When every frame is jax_scalify's (JAX
    reuses the trace of a jitted helper such as ``dynamic_rescale``'s from an earlier call,
    and that trace's frames stop at the helper), the outermost one is given.
    """
    summary = source_info_util.summarize(eqn.source_info, num_frames=_MAX_FRAMES)
    frames = [f for f in reversed(summary.splitlines()) if f and f != "unknown"]  # innermost first
    if not frames:
        return "unknown", False
    internal = _is_library_file(_frame_file(frames[0]))
    outside = [f for f in frames if not _is_library_file(_frame_file(f))]
    return (outside[0] if outside else frames[-1]), internal


def _function_of(source: str) -> str:
    """The function name of a source line, without ``<locals>`` and anonymous parts.

    ``make_step.<locals>.step`` gives ``step``; ``attention.<locals>.<genexpr>`` gives
    ``attention``.
    """
    match = _FRAME_RE.match(source)
    if not match:
        return "?"
    parts = [p for p in match["function"].split(".") if p != "<locals>"]
    named = [p for p in parts if not p.startswith("<")]
    return named[-1] if named else parts[-1]


def full_name_stack(eqn: JaxprEqn) -> str:
    """The equation's name stack including that of the enclosing equations (sub-jaxprs)."""
    return str(source_info_util.current_name_stack() + eqn.source_info.name_stack)


def is_backward(name_stack: str) -> bool:
    """True for equations of a transposed (backward) computation."""
    return "transpose" in name_stack


# --- recording ----------------------------------------------------------------------------------
def _is_recordable(x: Any) -> bool:
    """Floating arrays with at least one dimension and one element."""
    data = x.data if isinstance(x, ScaledArray) else x
    if not (hasattr(data, "dtype") and hasattr(data, "shape")) or not is_floating_dtype(data.dtype):
        return False
    return len(data.shape) > 0 and math.prod(data.shape) > 0


@dataclasses.dataclass
class _Site:
    """What is known of a recorded value at trace time; the callback adds the statistics.

    ``name_stack`` may still grow after the site is made: JAX traces a loop body or a
    branch under a fresh name stack, so the stack of the equation that holds the body is
    prefixed once that equation is observed (``top``: the outermost equation seen so far
    whose sub-jaxprs contain this value's equation).
    """

    op: str
    source: str
    name_stack: str
    scaled: bool
    top: int


class ScaleRecorder:
    """Context manager recording the scales of every value ``scalify`` computes inside it.

    Every scalified function called inside it gets a host callback on each recorded value
    (see the module docstring): a jitted one records what its compiled program computes, an
    eager one what the eager evaluation computes::

        with ScaleRecorder() as recorder:
            update(params, batch)                  # a @jsa.scalify function (jitted or not)
        print(recorder.report().to_table())

    JAX's caches are cleared on entry and on exit, so a function compiled before is traced
    again with the callbacks, and the traces with callbacks are not reused afterwards.

    Args:
        include_internal: also record the plain (unscaled) intermediate values of
            jax_scalify's own code, e.g. the statistics of ``dynamic_rescale``.
    """

    def __init__(self, include_internal: bool = False):
        self.include_internal = include_internal
        self.records: list[ScaleRecord] = []
        self._observed: dict[int, JaxprEqn] = {}  # eqns observed (kept alive: ids stay unique)
        self._sites: list[_Site] = []
        self._seen_backward = False
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> ScaleRecorder:
        if self._stack is not None:
            raise RuntimeError("This ScaleRecorder is already active; use a new one for a nested recording.")
        jax.clear_caches()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(observe_equations(self._observe))
        return self

    def __exit__(self, *exc_info) -> None:
        stack, self._stack = self._stack, None
        stack.close()
        jax.effects_barrier()  # every callback of the recorded calls has run
        jax.clear_caches()

    def report(self, outputs: Any = None) -> ScaleReport:
        """The records so far as a :class:`ScaleReport`."""
        return ScaleReport(list(self.records), outputs)

    def _observe(self, eqn: JaxprEqn, inputs: list, outputs: list) -> None:
        self._observed[id(eqn)] = eqn
        name_stack = full_name_stack(eqn)
        if self._inner_equations_observed(eqn):
            self._prefix_inner_sites(eqn, name_stack)
            return
        source, internal = user_source(eqn)
        for out in outputs:
            if not _is_recordable(out):
                continue
            scaled = isinstance(out, ScaledArray)
            if internal and not self.include_internal and not scaled:
                continue
            site = _Site(eqn.primitive.name, source, name_stack, scaled, id(eqn))
            self._sites.append(site)
            data, scale = (out.data, out.scale) if scaled else (out, np.float32(1.0))
            jax.debug.callback(functools.partial(self._receive, site), data, scale, ordered=True)

    def _prefix_inner_sites(self, eqn: JaxprEqn, name_stack: str) -> None:
        """Give the sites of the equations inside ``eqn``'s sub-jaxprs ``eqn``'s name stack."""
        inner = {id(e) for sub in jaxprs_in_params(eqn.params) for e in getattr(sub, "jaxpr", sub).eqns}
        for site in self._sites:
            if site.top in inner:
                if not site.name_stack.startswith(name_stack):
                    site.name_stack = f"{name_stack}/{site.name_stack}" if site.name_stack else name_stack
                site.top = id(eqn)

    def _phase(self, name_stack: str) -> str:
        if is_backward(name_stack):
            self._seen_backward = True
            return BACKWARD
        if self._seen_backward and "jvp" not in name_stack:
            return UPDATE
        return FORWARD

    def _inner_equations_observed(self, eqn: JaxprEqn) -> bool:
        for sub in jaxprs_in_params(eqn.params):
            sub = getattr(sub, "jaxpr", sub)
            if any(id(inner) in self._observed for inner in sub.eqns):
                return True
        return False

    def _receive(self, site: _Site, data: Any, scale: Any) -> None:
        data, scale = np.asarray(data), np.asarray(scale)
        self.records.append(
            ScaleRecord(
                index=len(self.records),
                op=site.op,
                phase=self._phase(site.name_stack),
                source=site.source,
                function=_function_of(site.source),
                name_stack=site.name_stack,
                shape=tuple(int(d) for d in data.shape),
                dtype=str(data.dtype),
                scaled=site.scaled,
                **scale_statistics(data, scale),
                **data_fractions(data),
            )
        )


def _jit_on_arrays(fun: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``jax.jit(fun)(*args, **kwargs)`` with the array leaves traced and the other leaves static."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    traced = [isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves]

    def call(arrays):
        it = iter(arrays)
        full = [next(it) if t else x for x, t in zip(leaves, traced)]
        call_args, call_kwargs = jax.tree.unflatten(treedef, full)
        return fun(*call_args, **call_kwargs)

    return jax.jit(call)([x for x, t in zip(leaves, traced) if t])


def record_scales(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> ScaleReport:
    """Run ``jax.jit(jsa.scalify(fun))(*args, **kwargs)`` and record the scale of every value.

    ``fun`` may be a plain function or one already wrapped with ``jsa.scalify`` (and
    ``jax.jit``). Array arguments are traced, other arguments (Python numbers, functions)
    are static. With unscaled inputs, values stay plain until they meet a scaled one, so
    data equals value and the log2 scale is 0. The outputs of the call are in
    ``report.outputs``. Use :class:`ScaleRecorder` for options (or to record an eager call).
    """
    with ScaleRecorder() as recorder:
        outputs = jax.block_until_ready(_jit_on_arrays(scalify(fun), args, kwargs))
    return recorder.report(outputs)


# --- the report ---------------------------------------------------------------------------------
_COLUMNS = (
    ("#", 4, "index"),
    ("pass", 8, "phase"),
    ("op", 20, "op"),
    ("shape", 14, "shape"),
    ("dtype", 9, "dtype"),
    ("log2 value", 10, "log2_rms_value"),
    ("log2 data", 9, "log2_rms_data"),
    ("log2 scale", 10, "log2_scale"),
    ("%uflow", 6, "frac_underflow"),
    ("%nonfin", 7, "frac_nonfinite"),
)
_SOURCE_WIDTH = 36


def _cell(record: ScaleRecord, field: str) -> str:
    value = getattr(record, field)
    if field == "shape":
        return "x".join(str(d) for d in value) or "()"
    if field.startswith("frac_"):
        return f"{100 * value:.1f}"
    if field.startswith("log2_"):
        return f"{value:.2f}" if math.isfinite(value) else str(value)
    return str(value)


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "~"


def _short_source(record: ScaleRecord) -> str:
    return f"{record.location} ({record.function})" if _FRAME_RE.match(record.source) else record.source


@dataclasses.dataclass
class ScaleReport:
    """The records of one run (see :class:`ScaleRecord`), with text, JSON and chart views.

    Attributes:
        records: one :class:`ScaleRecord` per recorded value, in execution order.
        outputs: what the recorded function returned (``None`` if not kept).
    """

    records: list[ScaleRecord]
    outputs: Any = None

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self):
        return iter(self.records)

    def select(self, phase: str | None = None, op: str | None = None) -> list[ScaleRecord]:
        """The records of one pass and/or one primitive."""
        if phase is not None and phase not in PHASES:
            raise ValueError(f"Unknown phase {phase!r}: use one of {PHASES}.")
        return [r for r in self.records if (phase is None or r.phase == phase) and (op is None or r.op == op)]

    def to_table(self, max_rows: int | None = None) -> str:
        """A fixed-width text table, one row per record (the first ``max_rows`` if given)."""
        header = " ".join(f"{name:>{w}}" if i > 2 else f"{name:<{w}}" for i, (name, w, _) in enumerate(_COLUMNS))
        lines = [header + "  source", "-" * (len(header) + 2 + _SOURCE_WIDTH)]
        shown = self.records if max_rows is None else self.records[: max(max_rows, 0)]
        for r in shown:
            cells = []
            for i, (_, width, field) in enumerate(_COLUMNS):
                text = _shorten(_cell(r, field), width)
                cells.append(f"{text:>{width}}" if i > 2 else f"{text:<{width}}")
            lines.append(" ".join(cells) + "  " + _shorten(_short_source(r), _SOURCE_WIDTH))
        if len(shown) < len(self.records):
            lines.append(f"... {len(self.records) - len(shown)} more rows")
        return "\n".join(lines)

    def summary(self, low: float = -10.0, high: float = 10.0) -> str:
        """One line per pass: how many values, how many have a data RMS below ``2**low`` or
        above ``2**high`` (all-zero values counted apart), how many have subnormal
        (underflowing) or non-finite data elements, and the range of the log2 data RMS."""
        lines = []
        for phase in PHASES:
            records = self.select(phase)
            if not records:
                continue
            n = self.counts(phase, low, high)
            finite = [r.log2_rms_data for r in records if math.isfinite(r.log2_rms_data)]
            span = f"[{min(finite):.1f}, {max(finite):.1f}]" if finite else "[]"
            lines.append(
                f"{phase:<8} {n['values']:4d} values: data RMS < 2^{low:g}: {n['low']:3d},"
                f" > 2^{high:g}: {n['high']:3d},"
                f" all zero: {n['zero']:3d}; with subnormal data: {n['underflow']:3d}, with non-finite data:"
                f" {n['nonfinite']:3d}; log2 data RMS in {span}"
            )
        return "\n".join(lines)

    def counts(self, phase: str | None = None, low: float = -10.0, high: float = 10.0) -> dict[str, int]:
        """The numbers behind :meth:`summary` for one pass (or all with ``phase=None``)."""
        records = self.select(phase)
        return {
            "values": len(records),
            "low": sum(-math.inf < r.log2_rms_data < low for r in records),
            "high": sum(r.log2_rms_data > high for r in records),
            "zero": sum(r.log2_rms_data == -math.inf for r in records),
            "underflow": sum(r.frac_underflow > 0 for r in records),
            "nonfinite": sum(r.frac_nonfinite > 0 for r in records),
        }

    def to_json(self, indent: int | None = None) -> str:
        """The records as JSON: ``{"records": [...]}``; non-finite numbers become ``null``."""
        return json.dumps({"records": [r.as_dict() for r in self.records]}, indent=indent, allow_nan=False)

    def plot(self, path: str | os.PathLike, title: str | None = None, **kwargs: Any):
        """Save a chart of the log2 RMS of every value against the FP16/FP8 ranges to ``path`` (PNG).

        Needs matplotlib (``pip install 'jax_scalify[analysis]'``). Keyword arguments go to
        :func:`jax_scalify.analysis.plot_report`; returns the path written.
        """
        from .plot import plot_report

        return plot_report(self, path, title=title, **kwargs)
