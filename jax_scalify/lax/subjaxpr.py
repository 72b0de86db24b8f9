"""Sub-jaxprs evaluated by the scalify interpreter, and the fixed point of which outputs are scaled.

The rules of the primitives that hold a sub-jaxpr evaluate it with
:func:`~jax_scalify.core.interpreter.eval_closed_jaxpr` (the calls ``closed_call``,
``custom_jvp_call``, ``custom_vjp_call``, ``scan``, ``while``, ``cond``,
``custom_linear_solve``) or, for an open jaxpr, :func:`eval_sub_jaxpr` (``checkpoint``,
``shard_map``); ``scan``, ``while``, ``cond`` and ``shard_map`` fix their scaled outputs
with :func:`fixed_point`.

- :func:`eval_sub_jaxpr` runs the interpreter on an open sub-jaxpr and its constants, as
  :func:`~jax_scalify.core.interpreter.eval_closed_jaxpr` (the one implementation, which the
  rules call directly on closed sub-jaxprs) does on a closed one. What is known about a
  ``ScaledArray`` argument travels with it (its :class:`~jax_scalify.core.array.ScaleFacts`);
  a plain argument known at trace time keeps its constant-scalar status.
- :func:`fixed_point` finds which outputs of a traced body are ``ScaledArray``s when that
  must be fixed before the trace: a loop carry has the same type on entry and exit of the
  body, every branch of a ``cond`` returns the same types, ``shard_map`` needs its output
  specs. The body is traced assuming a set of scaled outputs; if one comes out scaled where
  it was assumed plain (:func:`check_structure`), it joins the set and the trace is redone.
  The set only grows, so this ends after at most one retry per output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr

from ..core.array import ScaledArray
from ..core.interpreter import eval_closed_jaxpr


def is_scaled(x: Any) -> bool:
    return isinstance(x, ScaledArray)


def eval_sub_jaxpr(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list:
    """The interpreter on an open sub-jaxpr with its constants (see :func:`eval_closed_jaxpr`)."""
    return eval_closed_jaxpr(ClosedJaxpr(jaxpr, list(consts)), args)


class StructureGrew(Exception):
    """Raised while tracing a body whose outputs are scaled where they were assumed plain."""

    def __init__(self, owner: object, scaled: tuple[bool, ...]):
        super().__init__("internal to jax_scalify: the scaled outputs of a traced body changed, retracing")
        self.owner = owner
        self.scaled = scaled


def check_structure(owner: object, outs: Sequence[Any], scaled: tuple[bool, ...]) -> None:
    """Raise :class:`StructureGrew` (for :func:`fixed_point`) if an output assumed plain is scaled."""
    grown = tuple(s or is_scaled(o) for s, o in zip(scaled, outs))
    if grown != scaled:
        raise StructureGrew(owner, grown)


def fixed_point(run: Callable[[tuple[bool, ...], object], Any], scaled: Sequence[bool]) -> tuple[tuple[bool, ...], Any]:
    """``(scaled, run(scaled, owner))`` for the first ``scaled`` set whose trace succeeds.

    ``run`` traces the body assuming the outputs flagged in ``scaled`` are ``ScaledArray``s
    and calls :func:`check_structure` with ``owner`` on what it produced; each retry grows
    the set. ``owner`` tells this fixed point's retries from those of a nested one.
    """
    owner = object()
    scaled = tuple(scaled)
    for _ in range(len(scaled) + 1):
        try:
            return scaled, run(scaled, owner)
        except StructureGrew as err:
            if err.owner is not owner:
                raise
            scaled = err.scaled
    raise AssertionError("unreachable: the scaled set grows at every retry")


__all__ = ["StructureGrew", "check_structure", "eval_sub_jaxpr", "fixed_point"]
