"""Counting XLA compilations, for tests of what compiles once and what compiles per call."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def count_xla_compiles(calls: Sequence[Callable[[], Any]]) -> list[int]:
    """The number of XLA compilations each of ``calls`` (thunks, run in order and waited for) triggers."""
    compiles = []

    def listener(name, secs, **kwargs):
        if name == BACKEND_COMPILE_EVENT:
            compiles.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    counts = []
    try:
        for call in calls:
            before = len(compiles)
            jax.block_until_ready(call())
            counts.append(len(compiles) - before)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return counts
