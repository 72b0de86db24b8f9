"""The jaxpr analyses of the ``gradients`` sites: which variables a policy rescales, from the jaxpr alone.

Backward equations are those whose name stack holds ``transpose(`` (as those of
``jax.grad``/``jax.vjp`` do); products are the equations whose rule declares
:attr:`~jax_scalify.core.registry.Site.PRODUCT`. Results are cached per jaxpr.
"""

from __future__ import annotations

import functools

from jax.extend.core import Jaxpr, Var

from ..core.registry import Site, registered_rule
from ..core.sites import is_backward_equation


def _site(eqn) -> Site | None:
    entry = registered_rule(eqn.primitive)
    return None if entry is None else entry.site


def _is_product(eqn) -> bool:
    return _site(eqn) is Site.PRODUCT


@functools.lru_cache(maxsize=4096)
def backward_product_residuals(jaxpr: Jaxpr) -> frozenset:
    """Variables defined by a forward equation of ``jaxpr`` and multiplied by a backward product.

    The residuals a derivative multiplies onto the cotangent: the backward pass of a
    ``jvp`` multiplies it by several forward values in a row with no sum in between, and
    each static product adds its operand's departure from unit size.
    """
    forward_defined = {v for e in jaxpr.eqns if not is_backward_equation(e) for v in e.outvars if type(v) is Var}
    return frozenset(
        v
        for e in jaxpr.eqns
        if is_backward_equation(e) and _is_product(e)
        for v in e.invars
        if isinstance(v, Var) and v in forward_defined
    )


@functools.lru_cache(maxsize=4096)
def gradient_boundary(jaxpr: Jaxpr) -> frozenset:
    """Variables defined by a backward equation of ``jaxpr`` and used by a forward one or returned.

    A forward use that reads only the value (:attr:`~jax_scalify.core.registry.Site.VALUE`,
    as an optimizer reading the gradients in float32 does) does not count: the split of
    data and scale does not change what it reads. The jaxpr is assumed to be evaluated
    outside any backward pass (its returned values are then used by forward code).
    """
    backward = [is_backward_equation(e) for e in jaxpr.eqns]
    defined_backward = {v for e, b in zip(jaxpr.eqns, backward) if b for v in e.outvars if type(v) is Var}
    if not defined_backward:
        return frozenset()
    leaving = {v for v in jaxpr.outvars if isinstance(v, Var) and v in defined_backward}
    for eqn, is_bwd in zip(jaxpr.eqns, backward):
        if not is_bwd and _site(eqn) is not Site.VALUE:
            leaving.update(v for v in eqn.invars if isinstance(v, Var) and v in defined_backward)
    return frozenset(leaving)


__all__ = ["backward_product_residuals", "gradient_boundary"]
