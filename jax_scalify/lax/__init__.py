"""Scale rules of the LAX primitives, and the scaling primitives.

Importing this package registers every rule. Rules are grouped by family, one module each.
"""
from . import rules_calls  # noqa: F401  (registers rules)
from .primitives import (
    get_data_and_scale,
    get_data_scale,
    get_data_scale_p,
    rebalance,
    rebalance_p,
    set_scaling,
    set_scaling_p,
    stop_scaling,
    stop_scaling_p,
)
