"""Operations built on the scaling primitives: dynamic and delayed rescaling, one-pass casts, debugging.

All of them are no-ops on values outside scalify (or the documented cast), so a model that
calls them computes the same with and without scalify.
"""

from . import cast, debug, delayed, rescaling
from .cast import *  # noqa: F401,F403
from .debug import *  # noqa: F401,F403
from .delayed import *  # noqa: F401,F403
from .rescaling import *  # noqa: F401,F403

__all__ = [
    # rescaling
    "dynamic_rescale",
    "dynamic_rescale_grad",
    "dynamic_rescale_l1",
    "dynamic_rescale_l1_grad",
    "dynamic_rescale_l2",
    "dynamic_rescale_l2_grad",
    "dynamic_rescale_max",
    "dynamic_rescale_max_grad",
    # delayed rescaling
    "DelayedRescaleState",
    "delayed_rescale",
    "init_delayed_rescale_state",
    # casts
    "cast_on_backward",
    "cast_on_forward",
    "reduce_precision_on_backward",
    "reduce_precision_on_forward",
    # debugging
    "debug_callback",
    "debug_callback_grad",
    "debug_print",
    "debug_print_grad",
]
"""The user API; the primitive ``dynamic_rescale_p`` and its rule are in :mod:`.rescaling`, for rule authors."""
