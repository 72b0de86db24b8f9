"""The table of scale rules, one per JAX primitive.

A scale rule is a function ``rule(*inputs, **params)`` that receives the equation's
inputs (``ScaledArray`` for floating inputs, promoted if they were unscaled; plain arrays
otherwise) and the equation's params, and returns the outputs (``ScaledArray`` or plain
arrays; a list for multi-output primitives). Registering one is one decorator, which also carries what else the interpreter must know
about the primitive::

    @jax_scalify.extend.register_scaled_op(my_primitive, scalar_preserving=True)
    def scaled_my_op(x: ScaledArray, *, param) -> ScaledArray:
        ...

The interpreter only consults this table; it knows nothing about individual primitives.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import Primitive
from jax.extend.core import primitives as _primitives

ScaledRule = Callable[..., Any]


class Site(enum.Enum):
    """What kind of computation a rule performs, where it matters to a scale policy.

    A rule declares its site when it is registered; the interpreter and the policy's jaxpr
    analyses read it instead of naming primitives.

    - ``PRODUCT``: an elementwise product (``mul``): a derivative's backward products read
      forward values (the residuals a policy may rescale first).
    - ``CAST``: a change of floating dtype (``convert_element_type``): plain data narrowed
      inside a backward pass enter it scaled.
    - ``VALUE``: reads only the value ``data * scale``, formed in float32 or wider
      (``stop_scaling``): how the operand is split between data and scale does not matter,
      so a policy need not rescale what only such equations read.
    """

    PRODUCT = "product"
    CAST = "cast"
    VALUE = "value"


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
    """A registry entry: a primitive's scale rule and everything the interpreter needs to know about it.

    Attributes:
        primitive: the JAX primitive.
        rule: ``rule(*inputs, **params)``.
        scaled_type: when the rule is called (see :class:`ScaledPrimitiveType`).
        summary: the first line of the rule's docstring (shown in ``docs/operators.md``).
        unpromoted_inputs: the rule receives unscaled inputs as they are instead of promoted to
            ``ScaledArray`` (rules of primitives holding sub-jaxprs: only values that meet a
            scaled one inside get a scale).
        scalar_fn: for scalar-preserving primitives, ``scalar_fn(*scalars, **params)`` maps
            the scalars of operands that are all broadcast constants to the scalar of the
            output (NumPy), or to ``None`` where the output is not one; None otherwise.
        site: the :class:`Site` the primitive's computation is, or None.
    """

    primitive: Primitive
    rule: ScaledRule
    scaled_type: ScaledPrimitiveType
    summary: str
    unpromoted_inputs: bool = False
    scalar_fn: Callable[..., Any] | None = None
    site: Site | None = None


_RULES: dict[Primitive, RegisteredRule] = {}
_generation = [0]  # bumped by every registration: compiled evaluations keyed on it go stale


def _summary_of(rule: ScaledRule) -> str:
    doc = (rule.__doc__ or "").strip()
    return doc.splitlines()[0].strip() if doc else ""


def _identity_scalar(scalar: Any, *others: Any, **params: Any) -> Any:
    return None if others else scalar


def _scalar_fn(primitive: Primitive, scalar_preserving: bool | Callable[..., Any]) -> Callable[..., Any] | None:
    if scalar_preserving is True:
        return _identity_scalar
    if scalar_preserving is False or scalar_preserving is None:
        return None
    if not callable(scalar_preserving):
        raise TypeError(
            f"scalar_preserving for '{primitive.name}' must be a bool or a function "
            f"fn(*scalars, **params), got {scalar_preserving!r}."
        )
    return scalar_preserving


def register_scaled_op(
    primitive: Primitive,
    rule: ScaledRule | None = None,
    scaled_type: ScaledPrimitiveType = ScaledPrimitiveType.FORWARD,
    *,
    unpromoted_inputs: bool = False,
    scalar_preserving: bool | Callable[..., Any] = False,
    site: Site | None = None,
):
    """Register ``rule`` as the scale rule of ``primitive``; usable as a decorator.

    One call holds all that the interpreter knows about the primitive; registering again
    replaces the whole entry (so user code can override a built-in rule).

    Args:
        primitive: a JAX primitive (``jax.extend.core.Primitive``), e.g.
            ``jax.extend.core.primitives.add_p``.
        rule: ``rule(*inputs, **params)``; see the module docstring. The first line of its
            docstring is the one-line summary shown in ``docs/operators.md``.
        scaled_type: when the rule is called (see :class:`ScaledPrimitiveType`).
        unpromoted_inputs: pass unscaled inputs to the rule as they are (plain arrays) instead
            of promoting floating ones to ``ScaledArray``; for primitives holding sub-jaxprs.
        scalar_preserving: the primitive maps broadcast scalar constants to a broadcast scalar
            (``True``: one operand, the same scalar, as layout ops do; or
            ``fn(*scalars, **params)`` computing the output scalar from those of all operands
            with NumPy, ``None`` where the output is not a scalar). The interpreter then folds
            the primitive on constants at trace time (:func:`jax_scalify.core.constants.fold`),
            so constants such as ``jnp.full(shape, 2.0)``, or the ``1 / N`` of a mean's
            gradient, stay known and are split exactly into mantissa and power-of-two scale
            where they meet scaled data. The function's result on the operands as traced, cast
            to the output dtype, replaces the equation: it must be what the primitive computes.
        site: the :class:`Site` of the primitive's computation, if a scale policy acts there.

    Returns:
        The rule (so the decorator leaves the function usable by name).
    """
    if not isinstance(primitive, Primitive):
        raise TypeError(f"register_scaled_op expects a JAX primitive (jax.extend.core.Primitive), got {primitive!r}.")
    if rule is None:
        return lambda fn: register_scaled_op(
            primitive,
            fn,
            scaled_type,
            unpromoted_inputs=unpromoted_inputs,
            scalar_preserving=scalar_preserving,
            site=site,
        )
    if not callable(rule):
        raise TypeError(f"The scale rule for '{primitive.name}' must be callable, got {rule!r}.")
    _RULES[primitive] = RegisteredRule(
        primitive,
        rule,
        ScaledPrimitiveType(scaled_type),
        _summary_of(rule),
        unpromoted_inputs=bool(unpromoted_inputs),
        scalar_fn=_scalar_fn(primitive, scalar_preserving),
        site=None if site is None else Site(site),
    )
    _generation[0] += 1
    return rule


def registry_generation() -> int:
    """A number that changes with every registration: part of the key of anything compiled from the rules."""
    return _generation[0]


def lax_primitive(name: str) -> Primitive:
    """The LAX primitive called ``name`` (``jax.extend.core.primitives.<name>_p``)."""
    prim = getattr(_primitives, f"{name}_p", None)
    if prim is None:
        raise ValueError(f"jax.extend.core.primitives has no primitive '{name}_p'.")
    return prim


def register_scaled_lax_op(
    rule: ScaledRule | None = None,
    *,
    scaled_type: ScaledPrimitiveType = ScaledPrimitiveType.FORWARD,
    unpromoted_inputs: bool = False,
    scalar_preserving: bool | Callable[..., Any] = False,
    site: Site | None = None,
):
    """Decorator: register ``scaled_<name>`` as the rule of the LAX primitive ``<name>_p``.

    ``@register_scaled_lax_op def scaled_add(a, b): ...`` registers it for ``add_p``;
    ``@register_scaled_lax_op(scalar_preserving=True)`` passes the options of
    :func:`register_scaled_op`.
    """
    options = dict(
        scaled_type=scaled_type, unpromoted_inputs=unpromoted_inputs, scalar_preserving=scalar_preserving, site=site
    )
    if rule is None:
        return lambda fn: register_scaled_lax_op(fn, **options)
    name = getattr(rule, "__name__", "")
    if not name.startswith("scaled_"):
        raise ValueError(
            f"register_scaled_lax_op needs a function named 'scaled_<primitive>', got '{name}'. "
            "Use register_scaled_op(primitive, rule) for other names."
        )
    primitive = lax_primitive(name[len("scaled_") :])
    return register_scaled_op(primitive, rule, options.pop("scaled_type"), **options)


def find_registered_scaled_op(primitive: Primitive) -> tuple[ScaledRule, ScaledPrimitiveType] | None:
    """``(rule, scaled_type)`` registered for ``primitive``, or None (the 0.1 lookup; see :func:`registered_rule`)."""
    entry = _RULES.get(primitive)
    return None if entry is None else (entry.rule, entry.scaled_type)


def registered_rule(primitive: Primitive) -> RegisteredRule | None:
    """The whole registry entry of ``primitive``, or None."""
    return _RULES.get(primitive)


def registered_rules() -> dict[Primitive, RegisteredRule]:
    """A copy of the whole table (for documentation and tests)."""
    return dict(_RULES)


def primitive_of(fun: Callable[..., Any], *example_args) -> Primitive:
    """The primitive of the single equation that ``fun(*example_args)`` traces to.

    For primitives that ``jax.extend`` does not export (``stop_gradient``, ``square`` ...).
    """
    eqns = jax.make_jaxpr(fun)(*example_args).eqns
    if len(eqns) != 1:
        raise ValueError(f"{fun} traced to {len(eqns)} equations, expected one.")
    return eqns[0].primitive
