"""Operations built on the scaling primitives: dynamic and delayed rescaling, one-pass casts, debugging.

All of them are no-ops on values outside scalify (or the documented cast), so a model that
calls them computes the same with and without scalify.
"""

from . import cast, debug, delayed, rescaling
from .cast import *  # noqa: F401,F403
from .debug import *  # noqa: F401,F403
from .delayed import *  # noqa: F401,F403
from .rescaling import *  # noqa: F401,F403

_MODULES = (rescaling, delayed, cast, debug)
"""The modules whose ``__all__`` make up this namespace."""

__all__ = [name for module in _MODULES for name in module.__all__]
