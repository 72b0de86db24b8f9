"""Trace-time knowledge that a traced scale is an exact power of two.

Most scales that rules compute are products, quotients, maxima or roundings of powers of two,
so they are powers of two themselves. When the rules know it at trace time, they can use exact
shortcuts that emit a few cheap equations instead of the general formula (e.g. the scale of a
sum, ``pow2_round_down(sqrt(sa**2 + sb**2))``, is ``max(sa, sb)`` for power-of-two scales).
Fewer scalar equations mean less tracing, lowering and, above all, less XLA compilation: XLA
duplicates cheap scalar chains into every fusion that consumes a scale.

The property tracked, for a scale ``s``: every element of ``s`` is ``+0``, ``+inf``, ``nan``
or a positive power of two ``2**k``. Products, quotients, maxima and minima of such scales
have it too (an overflow gives ``inf``, an underflow ``0``, ``0 * inf`` gives ``nan``).

- NumPy scales (folded at trace time) are checked by value;
- traced scales are *marked* by the rule helpers that create them
  (:mod:`jax_scalify.lax.base_scaling`); an unmarked traced scale (e.g. an input scale given
  by the user) is not assumed to be a power of two and takes the general path.

Marks live while the outermost :func:`jax_scalify.scalify` evaluates its jaxpr (see
:func:`tracking`); they hold weak references, so no tracer outlives its trace through them.
Outside that scope :func:`mark` does nothing and only NumPy values are known.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator

import numpy as np


class _KnownState(threading.local):
    def __init__(self):
        self.depth = 0
        self.marks: dict[int, weakref.ref] = {}


_state = _KnownState()


@contextlib.contextmanager
def tracking() -> Iterator[None]:
    """Scope in which traced scales can be marked; nested scopes share the outermost one's marks."""
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1
        if _state.depth == 0:
            _state.marks.clear()


def is_tracking() -> bool:
    """Whether a :func:`tracking` scope is open: the scalify interpreter is evaluating a jaxpr."""
    return _state.depth > 0


def _is_numpy(s: Any) -> bool:
    return isinstance(s, (np.ndarray, np.generic, float, int)) and not isinstance(s, bool)


def _numpy_is_pow2(s: Any) -> bool:
    value = np.asarray(s, np.float64)
    with np.errstate(invalid="ignore"):
        mantissa, _ = np.frexp(value)
    ok = (value == 0) | np.isnan(value) | (value == np.inf) | (mantissa == 0.5)
    return bool(np.all(ok & ~(value < 0)))


def is_known_pow2(s: Any) -> bool:
    """True if ``s`` is known at trace time to hold only ``+0``, ``+inf``, ``nan`` or powers of two."""
    if _is_numpy(s):
        return _numpy_is_pow2(s)
    ref = _state.marks.get(id(s))
    return ref is not None and ref() is s


def mark_pow2(s: Any) -> Any:
    """Record that the traced scale ``s`` holds only ``+0``, ``+inf``, ``nan`` or powers of two; returns ``s``.

    Only call it where this is guaranteed by construction (never on a user-given scale).
    """
    if _state.depth > 0 and not _is_numpy(s):
        try:
            _state.marks[id(s)] = weakref.ref(s)
        except TypeError:  # not weak-referenceable: simply not remembered
            pass
    return s


def all_known_pow2(*scales: Any) -> bool:
    return all(is_known_pow2(s) for s in scales)


__all__ = ["all_known_pow2", "is_known_pow2", "is_tracking", "mark_pow2", "tracking"]
