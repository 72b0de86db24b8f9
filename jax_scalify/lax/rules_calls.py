"""Rules of the call primitives: ``jit``, ``closed_call``, ``custom_jvp_call``, ``custom_vjp_call``.

Their sub-jaxprs are evaluated by the scalify interpreter
(:func:`~jax_scalify.core.interpreter.eval_closed_jaxpr`).
A jitted call stays a jitted call (same name and inlining options); custom derivative
wrappers are evaluated on their primal computation (with ``grad`` inside ``scalify`` the
derivatives are already explicit in the jaxpr). ``closed_call``, which JAX emits when
partial evaluation splits a jaxpr (e.g. in the backward pass of a ``jax.checkpoint``
holding a ``scan``), is evaluated inline: a closed call has no semantics of its own to keep.
``call`` (the open-jaxpr variant) is not emitted by ``jax.make_jaxpr`` in JAX 0.10 and has
no rule.

What is known about a ``ScaledArray`` argument (its
:class:`~jax_scalify.core.array.ScaleFacts`) is pytree aux data, so it enters and leaves the
jitted body with the value; powers of two need nothing (they are the contract). A scale
known at trace time crosses the boundary as a constant in both directions: baked into the
body for an argument, returned as aux data (:class:`_BakedScale`) for a result, so that
the scale arithmetic after the call still folds in Python.

The rules take their inputs unpromoted (as the control-flow rules do): an unscaled argument
stays unscaled inside the sub-jaxpr until one of its equations meets a scaled value, so
evaluating a call gives what evaluating its body inline would. Promoting every plain
argument to scale 1 at the call boundary would turn plain arithmetic of the body into
scaled arithmetic: constants that JAX hoists into traced arguments of a jitted body (such
as clipping bounds ``2**-126`` and ``2**127``) would be aligned to a common scale, where
they underflow.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr

from ..core.array import ScaledArray
from ..core.config import ScalifyConfig, get_scalify_config
from ..core.constants import constant_value, known_scalar
from ..core.interpreter import eval_closed_jaxpr
from ..core.promotion import is_any_scale
from ..core.registry import lax_primitive, register_scaled_lax_op, register_scaled_op, registry_generation
from ..core.sites import ScalePolicy, active_policy, in_backward_pass

jit_p = lax_primitive("jit")
custom_jvp_call_p = lax_primitive("custom_jvp_call")
custom_vjp_call_p = lax_primitive("custom_vjp_call")


class _CallSignature(NamedTuple):
    """What a jitted body is specialised on, besides the sub-jaxpr and the argument types.

    - ``constants``: ``(position, dtype, shape, value, exact dtype, exact value)`` of the
      arguments known at trace time (:func:`~jax_scalify.core.constants.known_scalar`: NumPy
      and Python values repeating one scalar); they are baked into the body instead of
      passed, so the sub-jaxpr still sees them as constants (a literal ``0.0`` passed to
      ``jnp.where``'s jitted body stays any-scale) with their exact value;
    - ``const_scales``: ``(position, dtype, shape, values)`` of the ``ScaledArray`` arguments
      whose scale is a trace-time constant: only their data is passed, the scale is baked in,
      so scale arithmetic on it still folds in Python inside the body.
    """

    constants: tuple
    const_scales: tuple


@functools.lru_cache(maxsize=1024)
def _jitted_body(
    jaxpr: ClosedJaxpr,
    name: str,
    inline: bool,
    keep_unused: bool,
    signature: _CallSignature,
    config: ScalifyConfig,
    policy: ScalePolicy,
    backward: bool,
    rules: int,
):
    """One ``jax.jit`` per sub-jaxpr, :class:`_CallSignature`, configuration and policy context.

    JAX caches the trace of the returned function, so everything that changes what the
    scaled body computes is in the key: the configuration, the active rescale policy,
    whether the call is part of the backward pass (plain cotangents are promoted with
    their statistic there; gradients are not rescaled inside it) and the generation of the
    rule registry (a rule registered since compiles the body again).
    """
    baked = {
        i: (np.asarray(v, dtype), shape, np.asarray(e, e_dtype))
        for i, dtype, shape, v, e_dtype, e in signature.constants
    }
    scales = {i: np.asarray(v, dtype).reshape(shape) for i, dtype, shape, v in signature.const_scales}
    n_args = len(jaxpr.jaxpr.invars)

    def body(*dynamic_args):
        dynamic = iter(dynamic_args)
        args = []
        for i in range(n_args):
            if i in baked:
                args.append(constant_value(*baked[i]))
            elif i in scales:
                args.append(ScaledArray(next(dynamic), scales[i]))
            else:
                args.append(next(dynamic))
        return [_BakedScale(out) if _is_const_scale(out) else out for out in eval_closed_jaxpr(jaxpr, args)]

    body.__name__ = name
    return jax.jit(body, inline=inline, keep_unused=keep_unused)


def _known_constant(arg) -> tuple | None:
    """``(dtype, shape, value, exact dtype, exact value)`` of an argument known at trace time, or None."""
    if isinstance(arg, ScaledArray):  # a promoted scalar constant: its value, as a plain constant
        if not (isinstance(arg.data, np.ndarray) and isinstance(arg.scale, (np.ndarray, np.generic))):
            return None
        if np.ndim(arg.data) != 0:  # not multiplied out here: its data goes in, its scale is baked
            return None
        arg = arg.to_array(arg.dtype)
    exact = known_scalar(arg)
    if exact is None:
        return None
    value = np.asarray(arg)
    element = value[(0,) * value.ndim]
    return value.dtype, value.shape, element.item(), exact.dtype, exact.item()


def _is_const_scale(arg) -> bool:
    """A ``ScaledArray`` with a small trace-time constant scale (its data need not be constant)."""
    return (
        isinstance(arg, ScaledArray)
        and not is_any_scale(arg)
        and isinstance(arg.scale, (np.ndarray, np.generic))
        and np.size(arg.scale) <= 16
    )


@jax.tree_util.register_pytree_node_class
class _BakedScale:
    """A result of a jitted body whose scale is a trace-time constant: the scale is aux data, not an output."""

    def __init__(self, value: ScaledArray):
        self.value = value

    def tree_flatten(self):
        x = self.value
        scale = np.asarray(x.scale)
        return (x.data, *(x.slices or ())), (scale.dtype.str, scale.shape, tuple(scale.ravel().tolist()), x.facts)

    @classmethod
    def tree_unflatten(cls, aux, children):
        dtype, shape, values, facts = aux
        data, *slices = children
        scale = np.asarray(values, dtype).reshape(shape)
        return cls(ScaledArray.tree_unflatten(facts, (data, scale, *slices)))


@register_scaled_op(jit_p, unpromoted_inputs=True)
def scaled_jit(*args, jaxpr: ClosedJaxpr, name: str, inline: bool, keep_unused: bool, **params):
    """Sub-jaxpr scalified and re-emitted as a jitted call with the same name and options."""
    known, const_scales, dynamic = [], [], []
    for i, arg in enumerate(args):
        constant = _known_constant(arg)
        if constant is not None:
            known.append((i, *constant))
        elif _is_const_scale(arg):
            scale = np.asarray(arg.scale)
            const_scales.append((i, scale.dtype.str, scale.shape, tuple(scale.ravel().tolist())))
            dynamic.append(arg.data)
        else:
            dynamic.append(arg)
    signature = _CallSignature(tuple(known), tuple(const_scales))
    context = (get_scalify_config(), active_policy(), in_backward_pass(), registry_generation())
    body = _jitted_body(jaxpr, name, inline, keep_unused, signature, *context)
    return [out.value if isinstance(out, _BakedScale) else out for out in body(*dynamic)]


@register_scaled_op(custom_jvp_call_p, unpromoted_inputs=True)
def scaled_custom_jvp_call(*args, call_jaxpr: ClosedJaxpr, **params):
    """Primal computation scalified (derivatives are taken inside scalify, before this)."""
    return eval_closed_jaxpr(call_jaxpr, args)


@register_scaled_op(custom_vjp_call_p, unpromoted_inputs=True)
def scaled_custom_vjp_call(*args, call_jaxpr: ClosedJaxpr, **params):
    """Primal computation scalified (derivatives are taken inside scalify, before this)."""
    return eval_closed_jaxpr(call_jaxpr, args)


@register_scaled_lax_op(unpromoted_inputs=True)
def scaled_closed_call(*args, call_jaxpr: ClosedJaxpr, **params) -> list:
    """Sub-jaxpr evaluated inline by the scalify interpreter (unscaled inputs stay unscaled)."""
    return eval_closed_jaxpr(call_jaxpr, args)


__all__ = [
    "custom_jvp_call_p",
    "custom_vjp_call_p",
    "jit_p",
    "scaled_closed_call",
    "scaled_custom_jvp_call",
    "scaled_custom_vjp_call",
    "scaled_jit",
]
