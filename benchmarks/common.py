"""Timing helpers for the benchmarks: interleaved A/B runs, medians, compile times."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


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
