"""The scaling primitives, and the scale rules of the LAX primitives.

The user API is the four scaling primitives: ``set_scaling``, ``get_data_scale``,
``stop_scaling`` and ``rebalance``. Importing this package registers every rule; the rules
are grouped by family, one module each (``rules_arithmetic``, ``rules_unary`` ...), each rule
``scaled_<primitive>`` in its module's ``__all__``. jax-scalify 0.1's names of this namespace
(its rule functions ``scaled_add`` ..., ``set_scaling_p`` ...) stay importable from here,
listed in :mod:`jax_scalify.compat`. The scale arithmetic the rules share is in
:mod:`jax_scalify.core.scaling`, the evaluation of sub-jaxprs in :mod:`.subjaxpr`: rule authors get
both from :mod:`jax_scalify.extend`.
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
from .primitives import get_data_scale, rebalance, set_scaling, stop_scaling

__all__ = ["get_data_scale", "rebalance", "set_scaling", "stop_scaling"]
