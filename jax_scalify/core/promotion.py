"""How unscaled inputs of a scaled equation become ``ScaledArray``s.

The interpreter tracks, for every unscaled value, whether it is a broadcast of a known
scalar constant. When such a value meets a scaled one, it is promoted:

- a constant 0 or ±inf becomes an :class:`AnyScaleArray`: its value is the same at every
  scale, so rules let it adopt the scale the other operands want (``max(x, 0)`` keeps
  ``x``'s scale);
- any other broadcast scalar constant is split exactly into a power-of-two scale (the
  nearest to it) and a mantissa in ``[sqrt(1/2), sqrt(2))`` (``x * 8.0`` folds ``2**3``
  into the scale, ``x * 0.999`` keeps ``x``'s scale);
- every other floating array gets scale 1.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .array import ScaledArray
from .config import get_scalify_config
from .pow2 import pow2_decompose


class AnyScaleArray(ScaledArray):
    """A ``ScaledArray`` whose value (all 0, or all ±inf) is the same at any scale.

    Its scale is 1 so that rules that ignore the distinction still compute the right value;
    rules that align scales (add, max, select, concatenate ...) skip it when choosing the
    common scale, then give it that scale.
    """

    __slots__ = ()


def is_any_scale(x: Any) -> bool:
    """True for an operand that can take any scale (constant 0 or ±inf)."""
    return isinstance(x, AnyScaleArray)


def promote(value: Any, scalar: np.ndarray | None) -> ScaledArray:
    """Promote the unscaled floating ``value`` (``scalar``: its constant value, if known)."""
    scale_dtype = get_scalify_config().scale_dtype
    if scalar is None:
        return ScaledArray(value, np.ones((), scale_dtype))
    if scalar == 0 or np.isinf(scalar):
        return AnyScaleArray(value, np.ones((), scale_dtype))
    if np.isnan(scalar):
        return ScaledArray(value, np.ones((), scale_dtype))
    scale, mantissa = nearest_pow2_split(np.asarray(scalar, np.float64))
    data = np.broadcast_to(mantissa.astype(value.dtype), np.shape(value))
    return ScaledArray(data, scale.astype(scale_dtype))


def nearest_pow2_split(scalar: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(scale, mantissa)``, scale the power of two nearest to ``|scalar|`` (in log2).

    The mantissa lies in ``[sqrt(1/2), sqrt(2))``, so a constant near 1 (a decay rate of
    0.999, say) keeps the scale of what it multiplies instead of halving it every time.
    """
    scale, mantissa = pow2_decompose(scalar)
    if abs(mantissa) > np.sqrt(2):
        scale, mantissa = scale * 2, mantissa / 2
    return scale, mantissa
