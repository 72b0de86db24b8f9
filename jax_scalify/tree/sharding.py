"""Shardings for pytrees holding ``ScaledArray``: data sharded, scales replicated.

A ``ScaledArray`` is a pytree of two arrays, its data and its (0-d) scale, so a sharding
meant for the data cannot be applied to the scale: ``jax.device_put(tree, NamedSharding(mesh,
P('d')))`` fails on the scale, and ``jax.jit``'s ``in_shardings`` needs one sharding per
array. :func:`scaled_shardings` expands a sharding (or a tree of them) into the matching
tree, with a replicated sharding for every scale; :func:`device_put` places a tree with it.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from ..core.array import ScaledArray, is_scaled_leaf

PyTree = Any


def replicated_like(sharding: Sharding) -> Sharding:
    """The sharding that replicates a value on the devices of ``sharding`` (for a scale).

    Args:
        sharding: a ``NamedSharding`` (the replicated one keeps its mesh and memory kind) or a
            ``SingleDeviceSharding`` (returned as it is).
    """
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(), memory_kind=sharding.memory_kind)
    if isinstance(sharding, SingleDeviceSharding) or sharding.is_fully_replicated:
        return sharding
    raise TypeError(
        f"jsa.scaled_shardings: cannot derive a replicated sharding for the scales from {sharding!r}. "
        "Use a jax.sharding.NamedSharding (e.g. NamedSharding(jax.make_mesh(...), P('d')))."
    )


def _expand(value: Any, sharding: Any) -> Any:
    if sharding is None or not isinstance(value, ScaledArray):
        return sharding
    if isinstance(sharding, ScaledArray):  # already expanded: (data sharding, scale sharding)
        return sharding
    if not isinstance(sharding, Sharding):
        raise TypeError(
            f"jsa.scaled_shardings: expected a jax.sharding.Sharding for a ScaledArray, got {sharding!r}. "
            "Give NamedSharding(mesh, spec) objects (a PartitionSpec needs its mesh)."
        )
    return ScaledArray.unchecked(sharding, replicated_like(sharding))


def scaled_shardings(tree: PyTree, shardings: Sharding | PyTree) -> PyTree:
    """The sharding tree matching ``tree``: each ``ScaledArray``'s data sharded, its scale replicated.

    Args:
        tree: a pytree of arrays and ``ScaledArray`` (only its structure is used, so
            ``jax.ShapeDtypeStruct`` leaves work too).
        shardings: one ``Sharding`` for every leaf, or a tree with the structure of ``tree``
            where each ``ScaledArray`` is one leaf (a ``Sharding`` for its data, or ``None``
            for JAX's default: unconstrained in ``jax.jit``, the default device in
            ``jax.device_put``).

    Returns:
        A tree to pass to ``jax.device_put`` or as ``in_shardings``/``out_shardings`` of
        ``jax.jit``: plain leaves keep their sharding; a ``ScaledArray`` leaf becomes
        ``ScaledArray(data_sharding, replicated_sharding)``.
    """
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_scaled_leaf)
    if isinstance(shardings, Sharding):
        per_leaf = [shardings] * len(leaves)
    else:
        try:
            per_leaf = treedef.flatten_up_to(shardings)
        except (ValueError, TypeError) as err:
            raise ValueError(
                "jsa.scaled_shardings: the shardings tree must have the structure of the value tree, "
                f"each ScaledArray one leaf ({err})."
            ) from None
    return jax.tree.unflatten(treedef, [_expand(x, s) for x, s in zip(leaves, per_leaf)])


def device_put(tree: PyTree, shardings: Sharding | PyTree) -> PyTree:
    """``jax.device_put`` where each ``ScaledArray`` gets its data sharded and its scale replicated.

    Args:
        tree: a pytree of arrays and ``ScaledArray``.
        shardings: as in :func:`scaled_shardings` (one ``Sharding``, or a tree of them with
            each ``ScaledArray`` one leaf).
    """
    return jax.device_put(tree, scaled_shardings(tree, shardings))


__all__ = ["device_put", "replicated_like", "scaled_shardings"]
