"""Varying manual axes (``shard_map(..., check_vma=True)``) of the values scalify handles.

Under ``check_vma`` every value inside a ``shard_map`` body has a type that says along which
mesh axes it differs from device to device, and multi-operand primitives require their
operands to agree. Scalify can make a value vary where the traced program did not: a scale
computed from device-local statistics (``dynamic_rescale``), or a traced scalar split into
mantissa and scale, varies with the data it came from. When the interpreter re-binds a plain
equation whose operands agreed in the traced program, it therefore widens the operands to the
union of their varying axes, as JAX's own ``lax`` functions do for their operands.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


def varying_axes(x: Any) -> frozenset | None:
    """Mesh axes along which ``x`` varies, from its type; None if its type does not say."""
    if isinstance(x, (np.ndarray, np.generic, int, float, bool)):
        return frozenset()
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    vma = getattr(aval, "vma", None)  # the attribute's name in JAX 0.10
    return None if vma is None else frozenset(vma)


def match_varying_axes(traced_avals: Sequence[Any], values: list) -> list:
    """``values`` widened to their union of varying axes if the traced operands all agreed."""
    traced = [_aval_axes(a) for a in traced_avals]
    if None in traced or len(set(traced)) != 1:
        return values
    current = [varying_axes(v) for v in values]
    if None in current or len(set(current)) == 1:
        return values
    union = frozenset().union(*current)
    return [v if axes == union else _widen(v, union - axes) for v, axes in zip(values, current)]


def _aval_axes(aval: Any) -> frozenset | None:
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    vma = getattr(aval, "vma", None)
    return None if vma is None else frozenset(vma)


def _widen(value: Any, axes: frozenset) -> Any:
    return jax.lax.pcast(value, tuple(sorted(axes, key=str)), to="varying")
