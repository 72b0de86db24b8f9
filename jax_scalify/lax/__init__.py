"""Scale rules of the LAX primitives, and the scaling primitives.

Importing this package registers every rule. Rules are grouped by family, one module each;
this namespace holds every module's ``__all__`` (the scaling primitives ``set_scaling``,
``get_data_scale``, ``stop_scaling``, ``rebalance``, and each rule as ``scaled_<primitive>``).
The scale arithmetic the rules share is in :mod:`jax_scalify.core.scaling`, the evaluation of sub-jaxprs
and the fixed point of which of their outputs are scaled in :mod:`.subjaxpr` (both exported
for rule authors by :mod:`jax_scalify.extend`, not here).
"""

from . import (
    control_flow,
    primitives,
    rules_arithmetic,
    rules_callbacks,
    rules_calls,
    rules_collectives,
    rules_complex,
    rules_indexing,
    rules_layout,
    rules_linalg,
    rules_linalg_solvers,
    rules_misc,
    rules_reduce,
    rules_sharding,
    rules_special,
    rules_unary,
)
from .control_flow import *  # noqa: F401,F403
from .primitives import *  # noqa: F401,F403
from .rules_arithmetic import *  # noqa: F401,F403
from .rules_callbacks import *  # noqa: F401,F403
from .rules_calls import *  # noqa: F401,F403
from .rules_collectives import *  # noqa: F401,F403
from .rules_complex import *  # noqa: F401,F403
from .rules_indexing import *  # noqa: F401,F403
from .rules_layout import *  # noqa: F401,F403
from .rules_linalg import *  # noqa: F401,F403
from .rules_linalg_solvers import *  # noqa: F401,F403
from .rules_misc import *  # noqa: F401,F403
from .rules_reduce import *  # noqa: F401,F403
from .rules_sharding import *  # noqa: F401,F403
from .rules_special import *  # noqa: F401,F403
from .rules_unary import *  # noqa: F401,F403

_MODULES = (
    primitives,
    rules_arithmetic,
    rules_unary,
    rules_layout,
    rules_indexing,
    rules_reduce,
    rules_linalg,
    rules_linalg_solvers,
    rules_complex,
    rules_special,
    rules_misc,
    rules_calls,
    control_flow,
    rules_callbacks,
    rules_sharding,
    rules_collectives,
)
"""The modules whose ``__all__`` make up this namespace."""

__all__ = [name for module in _MODULES for name in module.__all__]
