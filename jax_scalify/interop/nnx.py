"""Flax NNX objects as arguments of a scalified function: their in-place updates carried back.

An NNX module, optimizer or ``nnx.Rngs`` is mutable: the idiomatic training step updates
it in place (``optimizer.update(model, grads)``, BatchNorm statistics, RNG counters) and
returns nothing for it. ``scalify`` traces a functional form instead, as ``nnx.jit`` does:
the objects are split (``nnx.split``) into a static graph definition and a state of arrays,
the function runs on objects merged (``nnx.merge``) from the traced state, their state
after the call is an extra output, and it is written back into the objects given
(``nnx.update``). Scaled states (``ScaledArray`` variable values) flow through unchanged; a
variable given as a plain array is written back as a plain array, its value (state the user did not scale, such as the running totals of ``nnx.MultiMetric``, is read
outside ``scalify``: ``metrics.compute()``).

Only the public Flax API is used; :mod:`jax_scalify.interop` imports this module only once ``flax.nnx`` is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from ..core.array import ScaledArray, is_scaled_leaf


def is_graph_node(x: Any) -> bool:
    """True for NNX objects with a state: modules, optimizers, ``nnx.Rngs``, variables."""
    return isinstance(x, (nnx.Pytree, nnx.Variable))


def _node_or_scaled(x: Any) -> bool:
    return is_graph_node(x) or is_scaled_leaf(x)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Static part of a call: where the NNX objects sit among the arguments, and their graph.

    Hashable, so that ``scalify`` reuses a trace for calls with the same module structure
    (the graph definition holds the static attributes, e.g. ``train()``/``eval()`` flags).
    """

    treedef: Any
    node_positions: tuple[int, ...]
    graphdef: Any


@dataclasses.dataclass(frozen=True)
class _ReturnedNode:
    """Stands, in the outputs, for an NNX object given as an argument (by its position)."""

    index: int


class GraphCall:
    """``fun(*args, **kwargs)`` rewritten as a pure function of the NNX objects' state.

    ``functional_fun(*functional_args)`` returns ``(out, new_state)``; :meth:`write_back`
    applies the new state to the objects given and returns ``out``.
    """

    def __init__(self, fun: Callable[..., Any], leaves: list, treedef, node_positions: tuple[int, ...]):
        self.fun = fun
        self.nodes = tuple(leaves[i] for i in node_positions)
        graphdef, state = nnx.split(self.nodes)
        others = [None if i in node_positions else x for i, x in enumerate(leaves)]
        self.given_state = state
        self.functional_args = (_Layout(treedef, node_positions, graphdef), others, state)

    @classmethod
    def of(cls, fun: Callable[..., Any], args: tuple, kwargs: dict) -> GraphCall | None:
        """The functional form of the call, or None when no NNX object is among the arguments."""
        leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=_node_or_scaled)
        node_positions = tuple(i for i, x in enumerate(leaves) if is_graph_node(x))
        return cls(fun, leaves, treedef, node_positions) if node_positions else None

    def functional_fun(self, layout: _Layout, others: list, state) -> tuple[Any, Any]:
        nodes = nnx.merge(layout.graphdef, state)
        leaves = list(others)
        for i, node in zip(layout.node_positions, nodes):
            leaves[i] = node
        args, kwargs = jax.tree.unflatten(layout.treedef, leaves)
        out = self.fun(*args, **kwargs)
        new_graphdef, new_state = nnx.split(nodes)
        if new_graphdef != layout.graphdef:
            raise ValueError(
                "jsa.scalify: the function changed the structure of an NNX object it was given "
                "(a submodule or variable added, removed or replaced, or a static attribute such as "
                "a train()/eval() flag set). scalify carries back only new variable values: make "
                "structural changes outside the scalified function."
            )
        return _map_nodes(lambda x: _returned_node(nodes, x), out), new_state

    def write_back(self, out: Any, new_state: Any) -> Any:
        """Update the objects given with their state after the call; the call's outputs.

        An object the function returned is the object given (updated), as without scalify.
        """
        nnx.update(self.nodes, _as_given(self.given_state, new_state))
        return _map_nodes(lambda x: self.nodes[x.index] if isinstance(x, _ReturnedNode) else x, out)


def _as_given(given_state: Any, new_state: Any) -> Any:
    """``new_state`` with each variable given as a plain array back to a plain array (its value).

    Inside the call a plain variable that meets scaled values becomes a ``ScaledArray``
    (``metrics.update(loss=loss)`` with a scaled loss); written back as such, it would fail
    the first time it is used outside ``scalify``. Its value keeps the dtype the traced
    program gives it, as plain JAX would. The two states have the same structure: the graph
    definition is checked unchanged before.
    """
    given = jax.tree.leaves(given_state, is_leaf=is_scaled_leaf)
    new, treedef = jax.tree.flatten(new_state, is_leaf=is_scaled_leaf)

    def as_given(old, value):
        return (
            value.to_array(value.dtype)
            if isinstance(value, ScaledArray) and not isinstance(old, ScaledArray)
            else value
        )

    return jax.tree.unflatten(treedef, [as_given(old, value) for old, value in zip(given, new, strict=True)])


def _returned_node(nodes: tuple, x: Any) -> Any:
    index = next((k for k, node in enumerate(nodes) if node is x), None)
    return x if index is None else _ReturnedNode(index)


def _map_nodes(f: Callable[[Any], Any], tree: Any) -> Any:
    """Apply ``f`` to the NNX objects and markers of ``tree``, keeping the rest."""
    is_leaf = lambda x: _node_or_scaled(x) or isinstance(x, _ReturnedNode)  # noqa: E731
    return jax.tree.map(lambda x: f(x) if not is_scaled_leaf(x) else x, tree, is_leaf=is_leaf)
