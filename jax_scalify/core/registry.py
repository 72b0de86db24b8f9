"""The table of scale rules, one per JAX primitive.

A scale rule is a function ``rule(*inputs, **params)`` that receives the equation's
inputs (``ScaledArray`` for floating inputs, promoted if they were unscaled; plain arrays
otherwise) and the equation's params, and returns the outputs (``ScaledArray`` or plain
arrays; a list for multi-output primitives). Registering one is one decorator::

    @jsa.core.register_scaled_op(my_primitive)
    def scaled_my_op(x: ScaledArray, *, param) -> ScaledArray:
        ...

The interpreter only consults this table; it knows nothing about individual primitives.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable

import jax
from jax.extend.core import Primitive, primitives as _primitives

ScaledRule = Callable[..., Any]


class ScaledPrimitiveType(enum.IntEnum):
    """When the interpreter calls a primitive's scale rule.

    - ``NEVER``: never; the primitive is always bound on plain values (inputs are unscaled
      first). For primitives whose outputs carry no scale (e.g. random bits).
    - ``FORWARD``: only if at least one input is a ``ScaledArray``; otherwise the
      primitive is bound as it is (the default).
    - ``ALWAYS_SCALE``: always, even with unscaled inputs (e.g. ``set_scaling``).
    """

    NEVER = 0
    FORWARD = 1
    ALWAYS_SCALE = 2


@dataclasses.dataclass(frozen=True)
class RegisteredRule:
    """A registry entry: the rule, when it applies, and a one-line description of its scale logic."""

    primitive: Primitive
    rule: ScaledRule
    scaled_type: ScaledPrimitiveType
    summary: str


_RULES: dict[Primitive, RegisteredRule] = {}
_SCALAR_PRESERVING: dict[Primitive, Callable[..., Any]] = {}


def _summary_of(rule: ScaledRule) -> str:
    doc = (rule.__doc__ or "").strip()
    return doc.splitlines()[0].strip() if doc else ""


def register_scaled_op(
    primitive: Primitive,
    rule: ScaledRule | None = None,
    scaled_type: ScaledPrimitiveType = ScaledPrimitiveType.FORWARD,
):
    """Register ``rule`` as the scale rule of ``primitive``; usable as a decorator.

    Args:
        primitive: a JAX primitive (``jax.extend.core.Primitive``), e.g.
            ``jax.extend.core.primitives.add_p``.
        rule: ``rule(*inputs, **params)``; see the module docstring. The first line of its
            docstring is the one-line summary shown in ``docs/operators.md``.
        scaled_type: when the rule is called (see :class:`ScaledPrimitiveType`).

    Returns:
        The rule (so the decorator leaves the function usable by name).
    """
    if not isinstance(primitive, Primitive):
        raise TypeError(
            f"register_scaled_op expects a JAX primitive (jax.extend.core.Primitive), got {primitive!r}."
        )
    if rule is None:
        return lambda fn: register_scaled_op(primitive, fn, scaled_type)
    if not callable(rule):
        raise TypeError(f"The scale rule for '{primitive.name}' must be callable, got {rule!r}.")
    _RULES[primitive] = RegisteredRule(primitive, rule, ScaledPrimitiveType(scaled_type), _summary_of(rule))
    return rule


def lax_primitive(name: str) -> Primitive:
    """The LAX primitive called ``name`` (``jax.extend.core.primitives.<name>_p``)."""
    prim = getattr(_primitives, f"{name}_p", None)
    if prim is None:
        raise ValueError(f"jax.extend.core.primitives has no primitive '{name}_p'.")
    return prim


def register_scaled_lax_op(rule: ScaledRule) -> ScaledRule:
    """Decorator: register ``scaled_<name>`` as the rule of the LAX primitive ``<name>_p``.

    Example: ``@register_scaled_lax_op def scaled_add(a, b): ...`` registers it for
    ``add_p``.
    """
    name = rule.__name__
    if not name.startswith("scaled_"):
        raise ValueError(
            f"register_scaled_lax_op needs a function named 'scaled_<primitive>', got '{name}'. "
            "Use register_scaled_op(primitive, rule) for other names."
        )
    return register_scaled_op(lax_primitive(name[len("scaled_"):]), rule)


def find_registered_scaled_op(primitive: Primitive) -> tuple[ScaledRule, ScaledPrimitiveType] | None:
    """``(rule, scaled_type)`` registered for ``primitive``, or None."""
    entry = _RULES.get(primitive)
    return None if entry is None else (entry.rule, entry.scaled_type)


def registered_rules() -> dict[Primitive, RegisteredRule]:
    """A copy of the whole table (for documentation and tests)."""
    return dict(_RULES)


def register_scalar_preserving(primitive: Primitive, fn: Callable[..., Any] | None = None):
    """Declare that ``primitive`` maps a broadcast scalar constant to a broadcast scalar.

    ``fn(scalar, **params)`` computes the output scalar from the input scalar with NumPy
    (default: the identity, for layout ops such as ``broadcast_in_dim`` or ``reshape``).
    The interpreter uses this to recognise constants such as ``jnp.full(shape, 2.0)`` and
    split them exactly into mantissa and power-of-two scale.
    """
    _SCALAR_PRESERVING[primitive] = fn or (lambda scalar, **params: scalar)


def scalar_preserving_fn(primitive: Primitive) -> Callable[..., Any] | None:
    return _SCALAR_PRESERVING.get(primitive)


def primitive_of(fun: Callable[..., Any], *example_args) -> Primitive:
    """The primitive of the single equation that ``fun(*example_args)`` traces to.

    For primitives that ``jax.extend`` does not export (``stop_gradient``, ``square`` ...).
    """
    eqns = jax.make_jaxpr(fun)(*example_args).eqns
    if len(eqns) != 1:
        raise ValueError(f"{fun} traced to {len(eqns)} equations, expected one.")
    return eqns[0].primitive
