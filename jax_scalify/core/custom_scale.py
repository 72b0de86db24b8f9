"""``custom_scale``: a function with a user-defined scale rule, as ``jax.custom_jvp`` is for derivatives.

::

    @jsa.custom_scale
    def gelu(x):
        return jax.nn.gelu(x)

    @gelu.defscale
    def _(x: ScaledArray) -> ScaledArray:
        ...  # e.g. compute on the data, keep x's scale

Outside ``scalify`` the decorated function is the plain function, under ``jax.jit``,
``jax.vmap`` and ``jax.grad`` (its derivative is the derivative of the plain function).
Under ``scalify`` the forward is computed by the scale rule, which receives
``ScaledArray`` inputs (unscaled floating inputs promoted, as for every rule) and returns the
function's output structure with ``ScaledArray`` (or plain arrays) in place of arrays.
Gradients taken inside ``scalify`` differentiate the plain function; the forward still uses
the rule.

How: a call binds the primitive ``custom_scale_call``, which holds the jaxpr of the plain
function and the scale rule as parameters. It evaluates, lowers and differentiates (JVP:
the primitive again for the primal, ``jax.jvp`` of the plain function for the tangent) as
the plain function; its scalify rule calls the scale rule.

Under ``jax.vmap`` the plain function is vmapped; the scale rule is vmapped over the data
with the input scales shared by the whole batch (a batch of ``ScaledArray`` still has one
scalar scale), and an output scale that comes out per example is rebalanced to the
largest one (each example's data multiplied by ``its scale / largest``, an exact power of
two, as for the stacked outputs of ``scan``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Primitive, jaxpr_as_fun
from jax.interpreters import ad, batching, mlir

from .array import ScaledArray, is_scaled_leaf
from .registry import register_scaled_op

custom_scale_call_p = Primitive("custom_scale_call")
custom_scale_call_p.multiple_results = True


class custom_scale:  # noqa: N801  (named like jax.custom_jvp)
    """Decorator: a function whose behaviour under ``scalify`` is given by a custom scale rule.

    Args:
        fun: the plain function (positional and keyword arguments, pytrees of arrays in
            and out).
        static_argnums: positions of arguments that are not arrays (Python values, hashable
            or not): they are passed as they are to both the function and the rule.

    Define the rule with :meth:`defscale` before calling the function. The rule takes the
    same arguments as ``fun`` (``ScaledArray`` for floating arrays) and returns ``fun``'s
    output structure with ``ScaledArray`` or plain arrays of the same shapes and dtypes. It
    runs on the scaled representation: compute with ``jsa.lax`` functions on ``x.data`` and
    ``x.scale``, or call ``jsa.scalify(f)(x)`` for a sub-computation; it must not close over
    traced values.
    """

    def __init__(self, fun: Callable[..., Any], static_argnums: Sequence[int] = ()):
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.static_argnums = tuple(sorted(int(i) for i in static_argnums))
        self.scale_rule: Callable[..., Any] | None = None

    def defscale(self, rule: Callable[..., Any]) -> Callable[..., Any]:
        """Set the scale rule (usable as a decorator); returns ``rule``."""
        if not callable(rule):
            raise TypeError(f"custom_scale '{self._name}': defscale expects a callable rule, got {rule!r}.")
        self.scale_rule = rule
        return rule

    @property
    def _name(self) -> str:
        return getattr(self, "__name__", None) or getattr(self.fun, "__name__", repr(self.fun))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.scale_rule is None:
            raise TypeError(
                f"No scale rule defined for the custom_scale function '{self._name}'. "
                f"Define one with @{self._name}.defscale before calling it."
            )
        for i in self.static_argnums:
            if i >= len(args):
                raise TypeError(
                    f"custom_scale '{self._name}': static argument {i} is missing "
                    f"(called with {len(args)} positional arguments)."
                )
        static = {i: args[i] for i in self.static_argnums}
        dynamic = [a for i, a in enumerate(args) if i not in static]
        leaves, in_tree = jax.tree.flatten((dynamic, kwargs))

        def with_static(dyn_args):
            it = iter(dyn_args)
            return [static[i] if i in static else next(it) for i in range(len(args))]

        out_tree_box = []

        def flat_fun(*flat):
            dyn_args, kw = jax.tree.unflatten(in_tree, flat)
            out_flat, out_tree = jax.tree.flatten(self.fun(*with_static(dyn_args), **kw))
            out_tree_box.append(out_tree)
            return out_flat

        closed = jax.make_jaxpr(flat_fun)(*leaves)
        out_tree = out_tree_box[0]
        call_jaxpr, consts = _hoist_consts(closed)
        out_avals = tuple(call_jaxpr.out_avals)
        name, rule = self._name, self.scale_rule

        def flat_rule(*flat_inputs):
            dyn_args, kw = jax.tree.unflatten(in_tree, flat_inputs)
            out = rule(*with_static(dyn_args), **kw)
            return _check_rule_output(name, out, out_tree, out_avals)

        outs = custom_scale_call_p.bind(
            *consts, *leaves, call_jaxpr=call_jaxpr, num_consts=len(consts), scale_rule=flat_rule, name=name
        )
        return jax.tree.unflatten(out_tree, outs)


def _hoist_consts(closed: ClosedJaxpr) -> tuple[ClosedJaxpr, list]:
    """The jaxpr with its constants turned into leading arguments (they may be tracers)."""
    jaxpr = closed.jaxpr
    if not jaxpr.constvars:
        return closed, []
    open_jaxpr = jaxpr.replace(constvars=[], invars=[*jaxpr.constvars, *jaxpr.invars])
    return ClosedJaxpr(open_jaxpr, []), list(closed.consts)


def _check_rule_output(name: str, out: Any, out_tree: Any, out_avals: Sequence[Any]) -> list:
    flat, tree = jax.tree.flatten(out, is_leaf=is_scaled_leaf)
    if tree != out_tree:
        raise TypeError(
            f"The scale rule of the custom_scale function '{name}' returned the structure {tree}, "
            f"expected {out_tree} (the structure of '{name}''s output, with ScaledArray in place of arrays)."
        )
    for i, (x, aval) in enumerate(zip(flat, out_avals)):
        data = x.data if isinstance(x, ScaledArray) else x
        shape, dtype = np.shape(data), getattr(data, "dtype", None)
        if tuple(shape) != tuple(aval.shape) or dtype is None or dtype != aval.dtype:
            got = f"{dtype}{list(shape)}" if dtype is not None else type(data).__name__
            raise TypeError(
                f"The scale rule of the custom_scale function '{name}' returned {got} for output {i}, "
                f"expected {aval.dtype}{list(aval.shape)} (the output of '{name}')."
            )
    return flat


# --- the primitive: the plain function outside scalify ----------------------------------------
def _impl(*args, call_jaxpr: ClosedJaxpr, **_):
    return jaxpr_as_fun(call_jaxpr)(*args)


def _abstract_eval(*avals, call_jaxpr: ClosedJaxpr, **_):
    return list(call_jaxpr.out_avals), call_jaxpr.effects


custom_scale_call_p.def_impl(_impl)
custom_scale_call_p.def_effectful_abstract_eval(_abstract_eval)
mlir.register_lowering(custom_scale_call_p, mlir.lower_fun(_impl, multiple_results=True))


def _jvp(primals, tangents, *, call_jaxpr: ClosedJaxpr, **params):
    outs = custom_scale_call_p.bind(*primals, call_jaxpr=call_jaxpr, **params)
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    _, out_tangents = jax.jvp(jaxpr_as_fun(call_jaxpr), list(primals), tangents)
    return outs, out_tangents


ad.primitive_jvps[custom_scale_call_p] = _jvp


def _batch(args, dims, *, call_jaxpr: ClosedJaxpr, num_consts: int, scale_rule, name: str):
    size = next(np.shape(a)[d] for a, d in zip(args, dims) if d is not None)
    args = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    in_axes = [None if d is None else 0 for d in dims]
    batched = jax.make_jaxpr(jax.vmap(jaxpr_as_fun(call_jaxpr), in_axes=in_axes, axis_size=size))(*args)
    batched_jaxpr, consts = _hoist_consts(batched)
    rule = _vmapped_rule(scale_rule, [a is not None for a in in_axes[num_consts:]], size)
    outs = custom_scale_call_p.bind(
        *consts,
        *args,
        call_jaxpr=batched_jaxpr,
        num_consts=len(consts) + num_consts,
        scale_rule=rule,
        name=name,
    )
    return outs, [0] * len(outs)


batching.primitive_batchers[custom_scale_call_p] = _batch


def _vmapped_rule(rule: Callable[..., list], batched: Sequence[bool], size: int) -> Callable[..., list]:
    """The flat scale rule applied to a batch (axis 0 of the batched inputs).

    A batched ``ScaledArray`` input has one scale for the whole batch: the rule is vmapped
    over its data with the scale shared. Output scales come out per example and are
    rebalanced to the largest one.
    """
    # The scale arithmetic lives with the rules (jax_scalify.lax), which core does not import
    # while it is itself being imported; a batched rule only runs once jax_scalify is loaded.
    from .scaling import rebalance_stacked, with_scalar_scale

    def batched_rule(*inputs):
        in_axes = []
        shared = []
        for x, is_batched in zip(inputs, batched):
            if not is_batched:
                in_axes.append(None)
            elif isinstance(x, ScaledArray):
                x = with_scalar_scale(ScaledArray.unchecked(x.data, x.scale, any_scale=x.any_scale))
                in_axes.append(ScaledArray.unchecked(0, None, any_scale=x.any_scale))
            else:
                in_axes.append(0)
            shared.append(x)
        outs = jax.vmap(rule, in_axes=tuple(in_axes), out_axes=0, axis_size=size)(*shared)
        return [rebalance_stacked(y.data, y.scale) if isinstance(y, ScaledArray) else y for y in outs]

    return batched_rule


# --- under scalify: the user's rule ------------------------------------------------------------
@register_scaled_op(custom_scale_call_p)
def scaled_custom_scale_call(*inputs: Any, scale_rule: Callable[..., list], num_consts: int, **params: Any) -> list:
    """The user's scale rule (``jsa.custom_scale`` and ``defscale``)."""
    return scale_rule(*inputs[num_consts:])


__all__ = [
    "custom_scale",
    "custom_scale_call_p",
    "scaled_custom_scale_call",
]
