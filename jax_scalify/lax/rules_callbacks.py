"""Rules of the host callbacks: ``pure_callback``, ``io_callback``, ``debug_callback``, ``debug_print``.

The callbacks run user Python code on the host, which knows nothing of scales: they receive
plain values ``data * scale`` and return plain values. ``jsa.ops.debug_callback`` and
``jsa.ops.debug_print`` show data and scales instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import io_callback

from ..core.array import unscaled
from ..core.registry import ScaledPrimitiveType, primitive_of, register_scaled_op

_f32 = jax.ShapeDtypeStruct((), np.float32)
pure_callback_p = primitive_of(lambda x: jax.pure_callback(lambda v: v, _f32, x), np.float32(0))
io_callback_p = primitive_of(lambda x: io_callback(lambda v: v, _f32, x), np.float32(0))
debug_callback_p = primitive_of(lambda x: jax.debug.callback(lambda v: None, x), np.float32(0))
debug_print_p = primitive_of(lambda x: jax.debug.print("{}", x), np.float32(0))


def _bind_on_values(prim, args: Sequence[Any], params: dict) -> Any:
    return prim.bind(*(unscaled(a) for a in args), **params)


@register_scaled_op(pure_callback_p, scaled_type=ScaledPrimitiveType.NEVER)
def scaled_pure_callback(*args: Any, **params: Any) -> Any:
    """Plain in and out: the callback receives the values ``data * scale``."""
    return _bind_on_values(pure_callback_p, args, params)


@register_scaled_op(io_callback_p, scaled_type=ScaledPrimitiveType.NEVER)
def scaled_io_callback(*args: Any, **params: Any) -> Any:
    """Plain in and out: the callback receives the values ``data * scale``."""
    return _bind_on_values(io_callback_p, args, params)


@register_scaled_op(debug_callback_p, scaled_type=ScaledPrimitiveType.NEVER)
def scaled_debug_callback(*args: Any, **params: Any) -> Any:
    """Plain in: the callback receives the values ``data * scale`` (``jsa.ops.debug_callback`` shows the scales)."""
    return _bind_on_values(debug_callback_p, args, params)


@register_scaled_op(debug_print_p, scaled_type=ScaledPrimitiveType.NEVER)
def scaled_debug_print(*args: Any, **params: Any) -> Any:
    """Plain in: prints the values ``data * scale`` (``jsa.ops.debug_print`` shows the scales)."""
    return _bind_on_values(debug_print_p, args, params)


__all__ = ["scaled_debug_callback", "scaled_debug_print", "scaled_io_callback", "scaled_pure_callback"]
