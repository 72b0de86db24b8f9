"""Pytree utilities that keep ``ScaledArray`` leaves whole: ``jsa.tree.map``, ``jsa.tree.astype`` ...

``jsa.tree.map_values`` maps a function over the *values* of the leaves (what ``jax.tree.map``
cannot do for a ``ScaledArray``, see ``docs/pytrees.md``); ``jsa.tree.device_put`` and
``jsa.tree.scaled_shardings`` shard the data and replicate the scales.
"""

from .sharding import device_put, replicated_like, scaled_shardings
from .tree_util import all, astype, flatten, leaves, map, map_values, structure, unflatten

__all__ = [
    "all",
    "astype",
    "device_put",
    "flatten",
    "leaves",
    "map",
    "map_values",
    "replicated_like",
    "scaled_shardings",
    "structure",
    "unflatten",
]
