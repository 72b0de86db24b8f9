"""Debug callbacks and prints that show the scaled representation (data and scale).

``jax.debug.callback`` under scalify would see plain values; these functions instead
unbundle every floating argument with ``get_data_scale`` and hand the host callback a
``ScaledArray`` with the real data and scale (outside scalify the scale is 1, and a
``ScaledArray`` argument is passed as it is). The ``_grad`` variants do the same with the
cotangents in the backward pass and are the identity in the forward pass.

Arguments may be arrays, ``ScaledArray`` or pytrees of them. Leaves that are arrays reach
the callback as arrays (floating ones as ``ScaledArray``); other leaves (strings, Python
numbers) are passed through unchanged. Like ``jax.debug.callback``, calls are unordered and
asynchronous under ``jax.jit``: call ``jax.effects_barrier()`` before reading what a
callback recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ..core.array import ScaledArray, is_floating_dtype, is_scaled_leaf
from ..lax.primitives import get_data_scale
from .rescaling import on_backward

PyTree = Any

_FLOAT, _ARRAY, _STATIC = "float", "array", "static"


def _kind(x: Any) -> str:
    if isinstance(x, ScaledArray):
        return _FLOAT
    if hasattr(x, "dtype") and hasattr(x, "shape"):
        return _FLOAT if is_floating_dtype(x.dtype) else _ARRAY
    return _STATIC


def _unbundle(x: Any, kind: str) -> Any:
    if kind == _STATIC:
        return None
    if kind == _ARRAY:
        return x
    if isinstance(x, ScaledArray):
        return (x.data, x.scale)
    return tuple(get_data_scale(x))


def _rebundle(payload: Any, kind: str, static: Any) -> Any:
    if kind == _STATIC:
        return static
    if kind == _ARRAY:
        return payload
    data, scale = payload
    return ScaledArray.unchecked(data, scale)


def debug_callback(callback: Callable[..., Any], *args: PyTree, **kwargs: PyTree) -> None:
    """Call ``callback(*args, **kwargs)`` on the host with each floating array as a ``ScaledArray``.

    Under scalify each floating argument reaches the callback as ``ScaledArray(data,
    scale)`` with its current data and scale (the representation, not just the value);
    outside scalify with scale 1. Works under ``jax.jit``, ``jax.grad`` (called on the
    primal values) and ``jax.vmap`` (called once per element). Returns None.
    """
    leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_scaled_leaf)
    kinds = [_kind(x) for x in leaves]
    payload = [_unbundle(x, k) for x, k in zip(leaves, kinds)]

    def host(*device_payload):
        rebuilt = [_rebundle(p, k, x) for p, k, x in zip(device_payload, kinds, leaves)]
        host_args, host_kwargs = jax.tree.unflatten(treedef, rebuilt)
        callback(*host_args, **host_kwargs)

    jax.debug.callback(host, *payload)


class _Formatted:
    """Formats a ``ScaledArray`` as ``ScaledArray(data=..., scale=...)``; a format spec applies to each number."""

    def __init__(self, x: ScaledArray):
        self.data, self.scale = np.asarray(x.data), np.asarray(x.scale)

    def __format__(self, spec: str) -> str:
        if not spec:
            return str(self)
        element = lambda v: format(v, spec)  # noqa: E731
        data = np.array2string(self.data, formatter={"all": element})
        scale = np.array2string(self.scale, formatter={"all": element})
        return f"ScaledArray(data={data}, scale={scale})"

    def __str__(self) -> str:
        return f"ScaledArray(data={self.data}, scale={self.scale})"

    __repr__ = __str__


def _formatted(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: _Formatted(x) if isinstance(x, ScaledArray) else x, tree, is_leaf=is_scaled_leaf)


def debug_print(fmt: str, *args: PyTree, **kwargs: PyTree) -> None:
    """Like ``jax.debug.print``, with each floating array printed as ``ScaledArray(data=..., scale=...)``.

    ``fmt`` is a ``str.format`` string. A format spec (``{x:.3f}``) applies to every number
    of the data and of the scale. Outside scalify the scale printed is 1.
    """

    def printer(*host_args, **host_kwargs):
        print(fmt.format(*_formatted(host_args), **_formatted(host_kwargs)))

    debug_callback(printer, *args, **kwargs)


def _check_grad_args(name: str, args: tuple) -> None:
    if not args:
        raise TypeError(f"jsa.ops.{name} needs at least one array to watch the cotangent of.")
    for leaf in jax.tree.leaves(args, is_leaf=is_scaled_leaf):
        if _kind(leaf) != _FLOAT:
            raise TypeError(
                f"jsa.ops.{name} takes floating arrays (or pytrees of them), got a leaf "
                f"{getattr(leaf, 'dtype', type(leaf).__name__)}: only floating values have a cotangent."
            )


def _single_or_tuple(args: tuple) -> Any:
    return args[0] if len(args) == 1 else args


def debug_callback_grad(callback: Callable[..., Any], *args: PyTree) -> Any:
    """Identity on ``args``; in the backward pass calls ``callback`` on their cotangents.

    The callback gets one ``ScaledArray`` cotangent per argument (pytrees keep their
    structure), as :func:`debug_callback` does. Returns ``args`` unchanged: the single
    argument itself for one argument, else the tuple. Use the returned values in the rest
    of the computation, otherwise the callback has no cotangent to see.
    """
    _check_grad_args("debug_callback_grad", args)

    def bwd(cts):
        debug_callback(callback, *jax.tree.unflatten(jax.tree.structure(args, is_leaf=is_scaled_leaf), cts))
        return cts

    return _single_or_tuple(on_backward(args, bwd))


def debug_print_grad(fmt: str, *args: PyTree) -> Any:
    """Identity on ``args``; in the backward pass prints their cotangents with :func:`debug_print`.

    Returns the single argument for one argument, else the tuple of arguments.
    """
    _check_grad_args("debug_print_grad", args)

    def bwd(cts):
        debug_print(fmt, *jax.tree.unflatten(jax.tree.structure(args, is_leaf=is_scaled_leaf), cts))
        return cts

    return _single_or_tuple(on_backward(args, bwd))


__all__ = ["debug_callback", "debug_callback_grad", "debug_print", "debug_print_grad"]
