"""Pytree utilities that keep ``ScaledArray`` leaves whole: ``jsa.tree.map``, ``jsa.tree.astype`` ..."""
from .tree_util import all, astype, flatten, leaves, map, structure, unflatten

__all__ = ["all", "astype", "flatten", "leaves", "map", "structure", "unflatten"]
