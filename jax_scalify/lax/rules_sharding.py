"""Rule of ``sharding_constraint`` (``jax.lax.with_sharding_constraint``).

The constraint says where the blocks of an array live, never what its values are: it applies
to the data, and a traced scalar scale is replicated over the same mesh (a scalar cannot be
partitioned). A scale folded at trace time is a constant and stays one.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..core.array import ScaledArray
from ..core.registry import lax_primitive, register_scaled_op

sharding_constraint_p = lax_primitive("sharding_constraint")


def _is_traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


@register_scaled_op(sharding_constraint_p)
def scaled_sharding_constraint(x: ScaledArray, *, sharding: Any, **params: Any) -> ScaledArray:
    """Scale unchanged: the constraint applies to the data, a traced scalar scale is replicated."""
    data = sharding_constraint_p.bind(x.data, sharding=sharding, **params)
    scale = x.scale
    if isinstance(sharding, jax.sharding.NamedSharding) and _is_traced(scale) and np.ndim(scale) == 0:
        scale = jax.lax.with_sharding_constraint(
            scale, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
        )
    return ScaledArray(data, scale)


__all__ = ["scaled_sharding_constraint"]
