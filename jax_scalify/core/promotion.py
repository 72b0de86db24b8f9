"""How unscaled inputs of a scaled equation become ``ScaledArray``s.

The interpreter tracks, for every unscaled value, whether it is a broadcast of a known
scalar constant. When such a value meets a scaled one, it is promoted:

- a constant 0 or ±inf becomes an any-scale ``ScaledArray`` (see
  :class:`~jax_scalify.core.array.ScaleFacts`): its value is the same at every scale, so
  rules let it adopt the scale the other operands want (``max(x, 0)`` keeps ``x``'s scale);
- any other broadcast scalar constant is split exactly into a power-of-two scale (the
  nearest to it) and a mantissa in ``[sqrt(1/2), sqrt(2))`` (``x * 8.0`` folds ``2**3``
  into the scale, ``x * 0.999`` keeps ``x``'s scale);
- a traced 0-d value (a learning rate from a schedule, a bias correction) is split at run
  time the same way, so ``lr * update`` carries ``lr``'s magnitude in its scale (a traced
  zero gets scale 0);
- every other floating array gets scale 1.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax import lax

from .array import ScaledArray
from .config import Pow2RoundMode, get_scalify_config
from .pow2 import pow2_decompose, pow2_round_positive_or_one


def any_scale_array(data: Any, scale: Any) -> ScaledArray:
    """A ``ScaledArray`` whose value (all 0, or all ±inf) is the same at any scale.

    Its scale is 1 when promoted, so that rules that ignore the distinction still compute the
    right value; rules that align scales (add, max, select, concatenate ...) skip it when
    choosing the common scale, then give it that scale. The mark is the ``any_scale`` fact
    of the ``ScaledArray`` (pytree aux data), so it crosses ``jit`` and loop boundaries.
    """
    return ScaledArray.unchecked(data, scale, any_scale=True)


def is_any_scale(x: Any) -> bool:
    """True for an operand that can take any scale (constant 0 or ±inf)."""
    return isinstance(x, ScaledArray) and x.any_scale


def promote(value: Any, scalar: np.ndarray | None) -> ScaledArray:
    """Promote the unscaled floating ``value`` (``scalar``: its constant value, if known)."""
    scale_dtype = get_scalify_config().scale_dtype
    if scalar is None:
        if np.ndim(value) == 0:
            return split_traced_scalar(value, scale_dtype)
        return ScaledArray(value, np.ones((), scale_dtype))
    if scalar == 0 or np.isinf(scalar):
        return any_scale_array(value, np.ones((), scale_dtype))
    if np.isnan(scalar):
        return ScaledArray(value, np.ones((), scale_dtype))
    scale, mantissa = nearest_pow2_split(np.asarray(scalar, np.float64), scale_dtype)
    data = np.broadcast_to(mantissa.astype(value.dtype), np.shape(value))
    return ScaledArray(data, scale.astype(scale_dtype))


def nearest_pow2_split(scalar: np.ndarray, scale_dtype: Any = np.float32) -> tuple[np.ndarray, np.ndarray]:
    """``(scale, mantissa)``, scale the power of two nearest to ``|scalar|`` (in log2).

    The mantissa lies in ``[sqrt(1/2), sqrt(2))``, so a constant near 1 (a decay rate of
    0.999, say) keeps the scale of what it multiplies instead of halving it every time.

    The scale stays a finite normal number of ``scale_dtype``: beyond its range the excess
    power of two moves into the mantissa (exact). Float32 max, whose nearest power of two
    ``2**128`` is inf in float32, gets the scale ``2**127`` and a mantissa just below 2.
    """
    scale, mantissa = pow2_decompose(scalar)
    if abs(mantissa) > np.sqrt(2):
        scale, mantissa = scale * 2, mantissa / 2
    info = np.finfo(scale_dtype)
    largest, smallest = np.float64(2.0 ** (info.maxexp - 1)), np.float64(info.tiny)
    if scale > largest:
        scale, mantissa = largest, mantissa * (scale / largest)
    elif 0 < scale < smallest:
        scale, mantissa = smallest, mantissa * (scale / smallest)
    return np.asarray(scale), np.asarray(mantissa)


def split_traced_scalar(value: Any, scale_dtype) -> ScaledArray:
    """Split a 0-d value known only at run time at its nearest power of two.

    Scale rule: ``scale = 2**round(log2|x|)`` and ``data = x / scale`` in
    ``[sqrt(1/2), sqrt(2))`` (exact: dividing by a power of two). Zero gets scale 0 ("asserted
    zero", so ``0 * u`` does not pull a sum towards scale 1: the first learning rate of a
    warmup schedule is 0); ±inf and nan get scale 1 (their data is the value). With scale 1
    for every traced scalar, an update ``-lr * m / sqrt(v)`` with ``lr ~ 1e-3`` would get
    scale ~1 and ``params + update`` would move the weights to scale 1, leaving their data
    far below unit RMS.
    """
    x = lax.convert_element_type(value, scale_dtype)
    magnitude = lax.abs(x) * np.asarray(np.sqrt(2), scale_dtype)
    finite = lax.is_finite(magnitude)
    magnitude = lax.select(finite, magnitude, lax.full_like(magnitude, 0))
    scale = pow2_round_positive_or_one(magnitude, Pow2RoundMode.DOWN)
    data = lax.convert_element_type(lax.div(x, scale), value.dtype)
    scale = lax.select(lax.eq(x, lax.full_like(x, 0)), lax.full_like(scale, 0), scale)
    return ScaledArray(data, scale)
