"""``jax.tree`` functions that keep every ``ScaledArray`` whole.

A ``ScaledArray`` is a pytree with children ``(data, scale)``, so plain ``jax.tree``
functions look inside it. The functions here treat it as a single leaf instead (they
combine the user's ``is_leaf`` with :func:`jax_scalify.is_scaled_leaf`), which is what model
code wants when it maps over parameters or gradients.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.array import ScaledArray, is_floating_dtype, is_scaled_leaf
from ..core.interpreter import scalify

PyTree = Any
IsLeaf = Callable[[Any], bool] | None


def _with_scaled_leaves(is_leaf: IsLeaf) -> Callable[[Any], bool]:
    """``is_leaf`` that is true for ``ScaledArray`` and wherever the user's predicate is."""
    if is_leaf is None:
        return is_scaled_leaf
    return lambda x: is_scaled_leaf(x) or bool(is_leaf(x))


def _is_array(x: Any) -> bool:
    return hasattr(x, "dtype") and hasattr(x, "shape") and not isinstance(x, (type, np.dtype))


def astype(tree: PyTree, dtype: Any, floating_only: bool = True) -> PyTree:
    """Cast the floating arrays of ``tree`` to ``dtype``; every other leaf is kept as it is.

    - ``ScaledArray`` leaves: the data is cast, the scale is kept (so the value is kept up to
      the rounding of the new dtype). Casting one to a non-floating dtype raises: its scale
      would be lost (use ``jsa.asarray`` first).
    - floating arrays: ``jnp.asarray(x, dtype)``.
    - integer, boolean and PRNG-key arrays (an Optax or ``nnx.Optimizer`` step count, an
      ``nnx.Rngs`` counter) and non-array leaves (Python numbers, functions, strings) are
      returned untouched, so a whole training state can be cast in one call: a step count
      cast to float16 would stop counting at 2048.

    Args:
        tree: a pytree of arrays and ``ScaledArray`` (other leaves pass through).
        dtype: the target dtype (e.g. ``jnp.float16`` or ``jnp.float8_e4m3fn``).
        floating_only: pass False to cast the integer and boolean arrays too (never the
            non-array leaves, nor PRNG keys).
    """

    def cast(x):
        if isinstance(x, ScaledArray):
            return x.astype(dtype)
        if not _is_array(x) or jnp.issubdtype(x.dtype, jax.dtypes.extended):
            return x
        if floating_only and not is_floating_dtype(x.dtype):
            return x
        return jnp.asarray(x, dtype)

    return jax.tree.map(cast, tree, is_leaf=is_scaled_leaf)


def leaves(tree: PyTree, is_leaf: IsLeaf = None) -> list[Any]:
    """``jax.tree.leaves`` with each ``ScaledArray`` one leaf."""
    return jax.tree.leaves(tree, is_leaf=_with_scaled_leaves(is_leaf))


def flatten(tree: PyTree, is_leaf: IsLeaf = None) -> tuple[list[Any], Any]:
    """``jax.tree.flatten`` with each ``ScaledArray`` one leaf: ``(leaves, treedef)``."""
    return jax.tree.flatten(tree, is_leaf=_with_scaled_leaves(is_leaf))


def unflatten(treedef: Any, leaves: Any) -> PyTree:
    """``jax.tree.unflatten``: the inverse of :func:`flatten` (``ScaledArray`` leaves put back whole)."""
    return jax.tree.unflatten(treedef, leaves)


def structure(tree: PyTree, is_leaf: IsLeaf = None) -> Any:
    """``jax.tree.structure`` with each ``ScaledArray`` one leaf."""
    return jax.tree.structure(tree, is_leaf=_with_scaled_leaves(is_leaf))


def map(f: Callable[..., Any], tree: PyTree, *rest: PyTree, is_leaf: IsLeaf = None) -> PyTree:
    """``jax.tree.map`` where ``f`` receives each ``ScaledArray`` whole."""
    return jax.tree.map(f, tree, *rest, is_leaf=_with_scaled_leaves(is_leaf))


def map_values(f: Callable[..., Any], tree: PyTree, *rest: PyTree, is_leaf: IsLeaf = None) -> PyTree:
    """Map ``f`` over the *values* of the leaves: ``f`` sees each ``ScaledArray`` as the array it stands for.

    ``jax.tree.map(f, tree)`` applies ``f`` to a ``ScaledArray``'s data and to its scale
    separately, which is wrong for almost every ``f``: ``x * 3`` multiplies the value by 9,
    ``x.astype(jnp.float16)`` casts the scale too (to 0 for scales below float16's range).
    Here, leaves are grouped as in :func:`map` and, where one of them is a ``ScaledArray``,
    ``f`` is run under :func:`jax_scalify.scalify`: the scale rules give the result (``x * 3``:
    scale doubled, data times 1.5; ``astype``: data cast, scale kept). Other leaves get plain
    ``f``. For pure casts :func:`astype` is shorter.

    Args:
        f: a function of as many arrays as there are trees, written for plain arrays.
        tree, rest: pytrees of the same structure (each ``ScaledArray`` one leaf).
        is_leaf: extra leaf predicate, as in ``jax.tree.map``.
    """
    scaled_f = scalify(f)

    def apply(*values):
        if builtins.any(isinstance(v, ScaledArray) for v in values):
            return scaled_f(*values)
        return f(*values)

    return map(apply, tree, *rest, is_leaf=is_leaf)


def _truth(x: Any) -> bool:
    if isinstance(x, ScaledArray):
        return bool(np.asarray(x.to_array()))
    return bool(x)


def all(tree: PyTree, is_leaf: IsLeaf = None) -> bool:
    """``jax.tree.all``: True if every leaf is truthy; a ``ScaledArray`` by its value ``data * scale``."""
    return builtins.all(_truth(x) for x in leaves(tree, is_leaf))


__all__ = ["all", "astype", "flatten", "leaves", "map", "map_values", "structure", "unflatten"]
