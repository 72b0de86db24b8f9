"""Pytree utilities that keep ``ScaledArray`` leaves whole: ``jsa.tree.map``, ``jsa.tree.astype`` ...

``jsa.tree.map_values`` maps a function over the *values* of the leaves (what ``jax.tree.map``
cannot do for a ``ScaledArray``, see ``docs/pytrees.md``). Sharding a pytree (the data sharded,
the scales replicated) is ``jsa.device_put`` / ``jsa.scaled_shardings`` (:mod:`.sharding`).
"""

from .tree_util import all, astype, flatten, leaves, map, map_values, structure, unflatten

__all__ = [
    "all",
    "astype",
    "flatten",
    "leaves",
    "map",
    "map_values",
    "structure",
    "unflatten",
]
