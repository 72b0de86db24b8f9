"""Timing helpers for the benchmarks: interleaved A/B runs, medians, compile times; program counts."""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import jaxprs_in_params


def block(tree: Any) -> Any:
    return jax.block_until_ready(tree)


def compile_seconds(fn: Callable, *args) -> float:
    """Trace + lower + compile time of ``jax.jit(fn)`` for ``args`` (no execution), cold caches."""
    return compile_times(fn, *args)[0]


def compile_times(fn: Callable, *args) -> tuple[float, float]:
    """``(wall, cpu)`` seconds of trace + lower + compile of ``jax.jit(fn)``, cold caches.

    The CPU time (all threads of this process) is less sensitive than the wall time to other
    processes competing for the cores.
    """
    jax.clear_caches()
    start, start_cpu = time.perf_counter(), time.process_time()
    jax.jit(fn).trace(*args).lower().compile()
    return time.perf_counter() - start, time.process_time() - start_cpu


def interleaved_medians(fns: dict[str, Callable[[], Any]], rounds: int, repeat: int = 1) -> dict[str, float]:
    """Median seconds per call of each thunk, timed in alternation so drift hits all equally."""
    for fn in fns.values():  # warm up: compile and first run
        block(fn())
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(repeat):
                out = fn()
            block(out)
            samples[name].append((time.perf_counter() - start) / repeat)
    return {name: statistics.median(s) for name, s in samples.items()}


def interleaved_compile_medians(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, Any]:
    """Median of each thunk's result (a number, or a tuple of numbers taken elementwise), in alternation."""
    samples: dict[str, list] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(fn())
    out = {}
    for name, values in samples.items():
        if isinstance(values[0], tuple):
            out[name] = tuple(statistics.median(v[i] for v in values) for i in range(len(values[0])))
        else:
            out[name] = statistics.median(values)
    return out


@dataclasses.dataclass(frozen=True)
class Stages:
    """A program traced, lowered and compiled once, and the seconds each stage took.

    Attributes:
      traced: ``jax.jit(fn).trace(*args)``.
      compiled: its compiled executable (callable on arguments like ``args``).
      cpu: ``{"trace", "lower", "compile"}`` -> CPU seconds (all threads of this process).
      wall: the same stages in wall-clock seconds.
    """

    traced: Any
    compiled: Any
    cpu: dict[str, float]
    wall: dict[str, float]


def stage_times(fn: Callable, *args, lowering_platforms: tuple[str, ...] | None = None) -> Stages:
    """Trace, lower and compile ``jax.jit(fn)`` for ``args`` (arrays or ``ShapeDtypeStruct``s), cold caches.

    ``lowering_platforms`` lowers for other platforms than the default device's (e.g.
    ``("cuda",)`` with ``args`` placed on a compile-only device, see :mod:`benchmarks.h100`).
    """
    jax.clear_caches()
    clocks = [(time.perf_counter(), time.process_time())]
    traced = jax.jit(fn).trace(*args)
    clocks.append((time.perf_counter(), time.process_time()))
    lowered = traced.lower() if lowering_platforms is None else traced.lower(lowering_platforms=lowering_platforms)
    clocks.append((time.perf_counter(), time.process_time()))
    compiled = lowered.compile()
    clocks.append((time.perf_counter(), time.process_time()))
    names = ("trace", "lower", "compile")
    wall = {n: clocks[i + 1][0] - clocks[i][0] for i, n in enumerate(names)}
    cpu = {n: clocks[i + 1][1] - clocks[i][1] for i, n in enumerate(names)}
    return Stages(traced, compiled, cpu, wall)


def primitive_counts(jaxpr: Any) -> collections.Counter:
    """Primitive name -> number of equations, over ``jaxpr`` and every jaxpr nested in its equations' params.

    An equation that holds a sub-jaxpr (``pjit``, ``cond``, ``custom_vjp_call`` ...) counts
    itself and the equations of each sub-jaxpr, once per equation that holds it.
    """
    counts: collections.Counter = collections.Counter()
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        counts[eqn.primitive.name] += 1
        for sub in jaxprs_in_params(eqn.params):
            counts.update(primitive_counts(sub))
    return counts


def hlo_opcode_count(hlo: str, opcode: str) -> int:
    """Instructions with ``opcode`` (e.g. ``"fusion"``, ``"reduce"``) in the text of an HLO module, every computation."""
    return len(re.findall(r"\s" + re.escape(opcode) + r"\(", hlo))


def abstract(tree: Any, sharding: Any = None) -> Any:
    """``ShapeDtypeStruct`` of each leaf of ``tree`` (arrays or abstract values), placed on ``sharding``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def markdown_table(rows: list[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """``rows`` as a markdown table; ``columns`` are ``(header, key, format)``, ``"s"`` left-aligned, a missing value ``-``."""
    cell = lambda row, key, fmt: "-" if row.get(key) is None else format(row[key], fmt)  # noqa: E731
    lines = ["| " + " | ".join(header for header, _, _ in columns) + " |"]
    lines.append("|" + "|".join("---" if fmt == "s" else "---:" for _, _, fmt in columns) + "|")
    lines += ["| " + " | ".join(cell(row, key, fmt) for _, key, fmt in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str, rows: list[dict], **config: Any) -> None:
    """``{"jax": version, **config, "rows": rows}`` written to ``path`` (a benchmark's ``--json``)."""
    with open(path, "w") as f:
        json.dump({"jax": jax.__version__, **config, "rows": rows}, f, indent=2)
