"""Timing helpers for the benchmarks: interleaved A/B runs, medians, compile times."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax


def block(tree: Any) -> Any:
    return jax.block_until_ready(tree)


def compile_seconds(fn: Callable, *args) -> float:
    """Trace + lower + compile time of ``jax.jit(fn)`` for ``args`` (no execution), cold caches."""
    jax.clear_caches()
    start = time.perf_counter()
    jax.jit(fn).trace(*args).lower().compile()
    return time.perf_counter() - start


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


def interleaved_compile_medians(fns: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(fn())
    return {name: statistics.median(s) for name, s in samples.items()}
