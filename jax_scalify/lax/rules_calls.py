"""Rules of the call primitives: ``jit``, ``custom_jvp_call``, ``custom_vjp_call``.

Their sub-jaxprs are evaluated by the scalify interpreter. A jitted call stays a jitted call
(same name and inlining options); custom derivative wrappers are evaluated on their primal
computation (with ``grad`` inside ``scalify`` the derivatives are already explicit in the
jaxpr).
"""
from __future__ import annotations

import functools

import jax
from jax.extend.core import ClosedJaxpr

from ..core.interpreter import eval_scaled_jaxpr
from ..core.registry import lax_primitive, register_scaled_op

jit_p = lax_primitive("jit")
custom_jvp_call_p = lax_primitive("custom_jvp_call")
custom_vjp_call_p = lax_primitive("custom_vjp_call")


def _eval_closed(closed: ClosedJaxpr, args) -> list:
    return eval_scaled_jaxpr(closed.jaxpr, closed.consts, args)


@functools.lru_cache(maxsize=1024)
def _jitted_body(jaxpr: ClosedJaxpr, name: str, inline: bool, keep_unused: bool):
    """One ``jax.jit`` per sub-jaxpr, so repeated calls hit JAX's compilation cache."""

    def body(*inner_args):
        return _eval_closed(jaxpr, inner_args)

    body.__name__ = name
    return jax.jit(body, inline=inline, keep_unused=keep_unused)


@register_scaled_op(jit_p)
def scaled_jit(*args, jaxpr: ClosedJaxpr, name: str, inline: bool, keep_unused: bool, **params):
    """Sub-jaxpr scalified and re-emitted as a jitted call with the same name and options."""
    return _jitted_body(jaxpr, name, inline, keep_unused)(*args)


@register_scaled_op(custom_jvp_call_p)
def scaled_custom_jvp_call(*args, call_jaxpr: ClosedJaxpr, **params):
    """Primal computation scalified (derivatives are taken inside scalify, before this)."""
    return _eval_closed(call_jaxpr, args)


@register_scaled_op(custom_vjp_call_p)
def scaled_custom_vjp_call(*args, call_jaxpr: ClosedJaxpr, **params):
    """Primal computation scalified (derivatives are taken inside scalify, before this)."""
    return _eval_closed(call_jaxpr, args)
