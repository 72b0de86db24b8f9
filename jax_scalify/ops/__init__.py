"""Operations built on the scaling primitives: dynamic and delayed rescaling, one-pass casts, debugging.

All of them are no-ops on values outside scalify (or the documented cast), so a model that
calls them computes the same with and without scalify.
"""

from .cast import cast_on_backward, cast_on_forward, reduce_precision_on_backward, reduce_precision_on_forward
from .debug import debug_callback, debug_callback_grad, debug_print, debug_print_grad
from .delayed import DelayedRescaleState, delayed_rescale, init_delayed_rescale_state
from .rescaling import (
    dynamic_rescale,
    dynamic_rescale_grad,
    dynamic_rescale_l1,
    dynamic_rescale_l1_grad,
    dynamic_rescale_l2,
    dynamic_rescale_l2_grad,
    dynamic_rescale_max,
    dynamic_rescale_max_grad,
)

__all__ = [
    "DelayedRescaleState",
    "cast_on_backward",
    "cast_on_forward",
    "debug_callback",
    "debug_callback_grad",
    "debug_print",
    "debug_print_grad",
    "delayed_rescale",
    "dynamic_rescale",
    "dynamic_rescale_grad",
    "dynamic_rescale_l1",
    "dynamic_rescale_l1_grad",
    "dynamic_rescale_l2",
    "dynamic_rescale_l2_grad",
    "dynamic_rescale_max",
    "dynamic_rescale_max_grad",
    "init_delayed_rescale_state",
    "reduce_precision_on_backward",
    "reduce_precision_on_forward",
]
