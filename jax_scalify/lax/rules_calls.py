"""Rules of the call primitives: ``jit``, ``custom_jvp_call``, ``custom_vjp_call``.

Their sub-jaxprs are evaluated by the scalify interpreter. A jitted call stays a jitted call
(same name and inlining options); custom derivative wrappers are evaluated on their primal
computation (with ``grad`` inside ``scalify`` the derivatives are already explicit in the
jaxpr).
"""
from __future__ import annotations

import functools

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr

from ..core.array import ScaledArray
from ..core.interpreter import concrete_scalar, eval_scaled_jaxpr
from ..core.registry import lax_primitive, register_scaled_op

jit_p = lax_primitive("jit")
custom_jvp_call_p = lax_primitive("custom_jvp_call")
custom_vjp_call_p = lax_primitive("custom_vjp_call")


def _eval_closed(closed: ClosedJaxpr, args) -> list:
    return eval_scaled_jaxpr(closed.jaxpr, closed.consts, args)


@functools.lru_cache(maxsize=1024)
def _jitted_body(jaxpr: ClosedJaxpr, name: str, inline: bool, keep_unused: bool, constants: tuple):
    """One ``jax.jit`` per sub-jaxpr and set of constant arguments (JAX caches compilations).

    ``constants`` holds ``(position, dtype, value)`` of the arguments known at trace time;
    they are baked into the body instead of passed, so the sub-jaxpr still sees them as
    constants (a literal ``0.0`` passed to ``jnp.where``'s jitted body stays any-scale).
    """
    values = {i: np.asarray(v, dtype) for i, dtype, v in constants}

    def body(*dynamic_args):
        dynamic = iter(dynamic_args)
        n_args = len(jaxpr.jaxpr.invars)
        args = [values[i] if i in values else next(dynamic) for i in range(n_args)]
        scalars = [values.get(i) for i in range(n_args)]
        return eval_scaled_jaxpr(jaxpr.jaxpr, jaxpr.consts, args, scalars)

    body.__name__ = name
    return jax.jit(body, inline=inline, keep_unused=keep_unused)


def _constant_value(arg) -> np.ndarray | None:
    """The 0-d value of an argument known at trace time (a literal, or a promoted one)."""
    if isinstance(arg, ScaledArray):
        if isinstance(arg.data, (np.ndarray, np.generic)) and isinstance(arg.scale, (np.ndarray, np.generic)):
            return concrete_scalar(arg.to_array()) if np.ndim(arg.data) == 0 else None
        return None
    return concrete_scalar(arg) if np.ndim(arg) == 0 else None


@register_scaled_op(jit_p)
def scaled_jit(*args, jaxpr: ClosedJaxpr, name: str, inline: bool, keep_unused: bool, **params):
    """Sub-jaxpr scalified and re-emitted as a jitted call with the same name and options."""
    known = [(i, _constant_value(a)) for i, a in enumerate(args)]
    constants = tuple((i, v.dtype.str, v.item()) for i, v in known if v is not None)
    dynamic = [a for (i, v), a in zip(known, args) if v is None]
    return _jitted_body(jaxpr, name, inline, keep_unused, constants)(*dynamic)


@register_scaled_op(custom_jvp_call_p)
def scaled_custom_jvp_call(*args, call_jaxpr: ClosedJaxpr, **params):
    """Primal computation scalified (derivatives are taken inside scalify, before this)."""
    return _eval_closed(call_jaxpr, args)


@register_scaled_op(custom_vjp_call_p)
def scaled_custom_vjp_call(*args, call_jaxpr: ClosedJaxpr, **params):
    """Primal computation scalified (derivatives are taken inside scalify, before this)."""
    return _eval_closed(call_jaxpr, args)
