"""The sites where a scale policy may move a statistic of the data into the scale.

The scale rules propagate scales statically: each output scale is a function of the input
scales, chosen as if the inputs were unit-scaled and independent. At a few typed sites of a
training step that assumption fails predictably (gradients, loop carries, returned state,
forward contractions, products of a value with itself, casts into 8-bit floats), and a
policy may rescale there: the statistic of the data, rounded to a power of two, moves into
the scale (exact: values are unchanged, only the representation moves back to unit size).

This module is the core's side of that contract: the rules and the interpreter call the
site functions here; which sites act, and with which statistic, is the active policy's
choice. The core knows only the protocol :class:`ScalePolicy` (whose defaults act nowhere:
the paper's static propagation); :class:`jax_scalify.policy.RescalePolicy` implements it
and registers the default. What a site decided about a value (rescaled, pinned by the user,
sparse) is recorded in the value itself (:class:`~jax_scalify.core.array.ScaleFacts`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from jax.extend import source_info_util
from jax.extend.core import Jaxpr

from .array import ScaledArray, is_floating_dtype, narrow_range
from .measure import narrowed_within_range, rescale_scaled_array, rescale_scaled_arrays, rescaled_into_narrow
from .pow2 import is_numpy
from .promotion import is_any_scale
from .registry import Site, registered_rule


class ScalePolicy:
    """The protocol of a scale policy: which typed sites rescale, and with which statistic.

    Each flag switches one family of sites (see :class:`jax_scalify.policy.RescalePolicy`
    for what each covers); ``norm`` and ``sample_size`` are the statistic
    (:func:`jax_scalify.core.measure.rescale_scaled_arrays`). The jaxpr analyses name the
    variables of a jaxpr that are sites of the ``gradients`` family. This base acts nowhere.
    Implementations must be hashable (compiled sub-computations are cached per policy).
    """

    gradients: bool = False
    loop_carries: bool = False
    outputs: bool = False
    contractions: bool = False
    self_products: bool = False
    fp8_casts: bool = False
    norm: str = "l2"
    sample_size: int | None = None

    @property
    def is_static(self) -> bool:
        """True if no site rescales."""
        return not (
            self.gradients
            or self.loop_carries
            or self.outputs
            or self.contractions
            or self.self_products
            or self.fp8_casts
        )

    def gradient_values(self, jaxpr: Jaxpr) -> frozenset:
        """Variables of ``jaxpr`` rescaled together, before their first forward use, as gradients."""
        return frozenset()

    def residual_values(self, jaxpr: Jaxpr) -> frozenset:
        """Forward variables of ``jaxpr`` rescaled before the first backward equation that reads them."""
        return frozenset()


_STATIC = ScalePolicy()
_default: list[ScalePolicy] = [_STATIC]


def set_default_policy(policy: ScalePolicy) -> None:
    """The policy ``scalify`` applies when given none (the policy layer registers it at import)."""
    _default[0] = policy


def check_policy(policy: ScalePolicy | None) -> ScalePolicy:
    """``policy`` checked (``None`` is the registered default policy)."""
    if policy is None:
        return _default[0]
    if not isinstance(policy, ScalePolicy):
        raise TypeError(
            f"scalify: policy must be a jsa.RescalePolicy or None, got {policy!r}. "
            "Use jsa.RescalePolicy() (default) or jsa.RescalePolicy.static()."
        )
    return policy


class _PolicyState(threading.local):
    def __init__(self):
        # per scalify evaluation: (policy, whether the function was given scaled inputs)
        self.stack: list[tuple[ScalePolicy, bool]] = []
        self.backward_depth = 0
        self.operand_rescales: list[dict[int, tuple[Any, Any]]] = []


_state = _PolicyState()


@contextlib.contextmanager
def applying(policy: ScalePolicy, scaled_inputs: bool = True) -> Iterator[None]:
    """The policy the interpreter and the rules apply while ``scalify`` evaluates.

    ``scaled_inputs``: whether the scalified function was given a ``ScaledArray``.
    """
    _state.stack.append((policy, scaled_inputs))
    try:
        yield
    finally:
        _state.stack.pop()


def active_policy() -> ScalePolicy:
    """The policy of the innermost ``scalify`` being evaluated (static outside any)."""
    return _state.stack[-1][0] if _state.stack else _STATIC


def is_rescalable(x: Any) -> bool:
    """A floating, non-empty ``ScaledArray`` with a scalar scale that is not any-scale (0/inf)."""
    return (
        isinstance(x, ScaledArray)
        and not is_any_scale(x)
        and is_floating_dtype(x.dtype)
        and np.ndim(x.scale) == 0
        and np.size(x.data) > 0
    )


def mark_rescaled(x: Any, *, explicit: bool = False) -> Any:
    """``x`` recorded as having a deliberately chosen scale (:class:`~jax_scalify.core.array.ScaleFacts`).

    Policy sites then leave it as it is. For rules whose output scale is chosen: a rescale
    with the policy's own statistic, a cast of such a value, a bound known from the op
    (re-estimating it would move nothing), and, with ``explicit=True``, a scale the user set
    (``jsa.lax.set_scaling``), which every site leaves (an explicit ``jsa.ops.dynamic_rescale``
    still rescales it). Plain values are returned as they are.
    """
    if not isinstance(x, ScaledArray):
        return x
    return x.marked(pinned=True) if explicit else x.marked(rescaled=True)


def inherit_mark(out: Any, x: Any) -> Any:
    """``out``, a new representation of ``x``'s value (a cast), with ``x``'s marks of a chosen scale."""
    if isinstance(out, ScaledArray) and isinstance(x, ScaledArray) and (x.rescaled or x.pinned):
        return out.marked(rescaled=x.rescaled, pinned=x.pinned)
    return out


def mark_sparse(x: Any) -> Any:
    """``x`` recorded as data that may sit in a few entries (a scatter into zeros: the gradient of a lookup).

    A strided sample of such data can hold only the small rows; a policy rescale of narrow
    (float16/FP8) data marked sparse also bounds its largest entry (one reduction of the
    tensor), so the rows the sample missed cannot overflow.
    """
    return x.marked(sparse=True) if isinstance(x, ScaledArray) else x


def was_rescaled(x: Any) -> bool:
    """True if ``x``'s scale was chosen (:func:`mark_rescaled`): policy sites leave it."""
    return isinstance(x, ScaledArray) and (x.rescaled or x.pinned)


def rescaled_from_data(x: Any) -> bool:
    """True if ``x``'s scale was chosen from its data (:func:`mark_rescaled` without ``explicit``)."""
    return isinstance(x, ScaledArray) and x.rescaled and not x.pinned


def rescale_by_policy(x: Any, policy: ScalePolicy | None = None) -> Any:
    """``x`` rescaled with the policy's statistic (:func:`~jax_scalify.core.measure.rescale_scaled_array`).

    Values that are not rescalable are returned as they are.
    """
    if not is_rescalable(x):
        return x
    policy = policy or active_policy()
    return mark_rescaled(rescale_scaled_array(x, policy.norm, policy.sample_size))


def rescaled_into(wide: ScaledArray, dtype: Any) -> ScaledArray:
    """A value computed in wide data, stored in ``dtype``: the one narrowing of every site.

    Into float16/FP8: the policy's statistic of all the data moves into the scale and the
    largest entry is kept at most half the dtype's largest power of two
    (:func:`~jax_scalify.core.measure.rescaled_into_narrow`; a value that is not rescalable,
    such as an any-scale constant, only gets the bound). Into a wide dtype (bfloat16 has
    float32's range): the policy's sampled rescale, then the cast. The result counts as
    rescaled (:func:`mark_rescaled`): no later site measures it again.
    """
    if narrow_range(dtype):
        if is_rescalable(wide):
            policy = active_policy()
            out = rescaled_into_narrow(wide, dtype, policy.norm, policy.sample_size)
        else:
            out = narrowed_within_range(wide, dtype)
    else:
        out = rescale_by_policy(wide)
        if out.dtype != dtype:
            out = ScaledArray(out.data.astype(dtype), out.scale)
    return mark_rescaled(out)


def rescales_cast(x: Any, dtype: Any) -> bool:
    """Whether a cast of ``x`` to the floating ``dtype`` goes through :func:`rescaled_into` (``fp8_casts``).

    Casts of traced data wider than 8 bits into an 8-bit float, under the ``fp8_casts`` policy.
    """
    return (
        active_policy().fp8_casts
        and np.dtype(dtype).itemsize == 1
        and np.dtype(x.dtype).itemsize > 1
        and is_rescalable(x)
        and not is_numpy(x.data)
    )


def rescale_operand(x: Any) -> Any:
    """:func:`rescale_by_policy` of an operand of the equation being evaluated; later equations read the result.

    A rescale changes the representation, not the value, so once a rule has rescaled an
    operand the interpreter binds the operand's variable to the rescaled array for the
    equations after it (:func:`recording_operand_rescales`): the base of ``x ** 3``,
    rescaled for the cube, is also the ``x`` of the ``3 * x ** 2`` and ``x * t`` that
    differentiate it, instead of the drifted data multiplied once more. For rules that
    trace no sub-computation (the result must belong to the trace of the operand).
    """
    out = rescale_by_policy(x)
    if out is not x and _state.operand_rescales:
        _state.operand_rescales[-1][id(x)] = (x, out)
    return out


@contextlib.contextmanager
def recording_operand_rescales() -> Iterator[dict[int, tuple[Any, Any]]]:
    """Collects the :func:`rescale_operand` calls of one jaxpr's evaluation: ``id(x) -> (x, rescaled x)``.

    The interpreter opens one record per evaluated jaxpr (a sub-jaxpr has its own, so a
    rescale made there never rebinds a variable of the enclosing jaxpr) and empties it after
    each equation.
    """
    record: dict[int, tuple[Any, Any]] = {}
    _state.operand_rescales.append(record)
    try:
        yield record
    finally:
        _state.operand_rescales.pop()


def rescale_all(values: Sequence[Any], policy: ScalePolicy | None = None, *, returned: bool = False) -> list:
    """``values`` with the rescalable ones rescaled together (one batch of statistics), others unchanged.

    ``returned``: the values ``scalify`` returns; the data of a narrow one whose sample is
    mostly zeros is not moved up (see :func:`jax_scalify.core.measure.rescale_scaled_arrays`).
    """
    values = list(values)
    where = [i for i, x in enumerate(values) if is_rescalable(x)]
    if not where:
        return values
    policy = policy or active_policy()
    outs = rescale_scaled_arrays([values[i] for i in where], policy.norm, policy.sample_size, sparse_stay_down=returned)
    for i, out in zip(where, outs):
        values[i] = mark_rescaled(out)
    return values


def is_self_product(a: Any, b: Any) -> bool:
    """Whether the product of ``a`` and ``b`` is one the policy's ``self_products`` rescales: they share one scale object."""
    return (
        active_policy().self_products
        and isinstance(a, ScaledArray)
        and isinstance(b, ScaledArray)
        and a.scale is b.scale
    )


def rescale_self_product(product: Any, a: Any, b: Any) -> Any:
    """``product = a * b`` rescaled if ``a`` and ``b`` share one scale object and the policy says so."""
    return rescale_by_policy(product) if is_self_product(a, b) else product


def rescale_contraction(out: Any) -> Any:
    """The result of a contraction, rescaled under the policy's ``contractions`` in the forward pass.

    Traced data only: a contraction of constants (NumPy data) is not measured.
    """
    if not active_policy().contractions or in_backward_pass() or not is_rescalable(out) or is_numpy(out.data):
        return out
    return rescale_by_policy(out)


def rescale_self_product_operands(a: Any, b: Any) -> tuple[Any, Any]:
    """The operands of a contraction, each rescaled (:func:`rescale_operand`) if they share one scale object.

    ``x @ x.T`` squares the departure of ``x``'s data from unit size and sums ``K`` such
    squares; an iteration of such products (Newton-Schulz, as in Muon) compounds it
    exponentially. Rescaling the operands before the contraction, rather than its result
    after, also keeps float16/FP8 products in range.
    """
    if not is_self_product(a, b):
        return a, b
    if a is b:
        a = rescale_operand(a)
        return a, a
    return rescale_operand(a), rescale_operand(b)


def rescale_loop_carries(carries: Sequence[Any]) -> list:
    """The carries of one loop iteration, rescaled if the active policy says so.

    A carry that a rule has just rescaled from its data (a backward sum of a transposed
    loop: the statistic of all its data, its largest entry bounded) is left as it is: a
    sample can only estimate it worse (it may miss the rows that carry the tensor, and move
    them past the dtype's range).
    """
    if not active_policy().loop_carries:
        return list(carries)
    carries = list(carries)
    where = [i for i, x in enumerate(carries) if not was_rescaled(x)]
    for i, out in zip(where, rescale_all([carries[i] for i in where])):
        carries[i] = out
    return carries


# --- gradients: the values leaving the backward pass ------------------------------------------
def _is_backward_stack(name_stack: Any) -> bool:
    return "transpose(" in str(name_stack)


def is_backward_equation(eqn: Any) -> bool:
    """True for an equation of a transposed computation (its own name stack holds ``transpose(``)."""
    return _is_backward_stack(eqn.source_info.name_stack)


def in_backward_pass() -> bool:
    """True while evaluating a transposed (backward) computation, sub-jaxprs included.

    JAX's name stack is reset where a nested ``jit`` or a loop body is traced, so the
    interpreter also marks the evaluation of every backward equation (:func:`evaluating`):
    the sub-jaxprs of a backward ``jit`` (``jax.nn.one_hot``, ``log_softmax``...) or of a
    transposed ``scan`` are in the backward pass too.
    """
    return _state.backward_depth > 0 or _is_backward_stack(source_info_util.current_name_stack())


def rescales_in_backward_pass() -> bool:
    """Whether the ``gradients`` component acts here: inside a backward pass, under a policy that has it.

    It then rescales the plain arrays the backward pass promotes and its sums of narrow data.
    """
    return active_policy().gradients and in_backward_pass()


def narrows_plain_backward_data(eqn: Any, invals: Sequence[Any]) -> bool:
    """A backward-pass cast of plain float32 data to float16/FP8 in a function given scaled inputs, under ``gradients``.

    Such data derive from the loss's cotangent (its ``1 / N`` times plain inputs such as
    float32 one-hot labels); cast at scale 1, ``1e-6 / 128`` is 0 in float16 and a mean
    over a million tokens is subnormal. The interpreter then evaluates the cast with its
    scale rule, the data promoted with their statistic as scale, as where plain data meet
    scaled data in the backward pass. A function given only plain arrays computes what JAX
    computes.
    """
    entry = registered_rule(eqn.primitive)
    if entry is None or entry.site is not Site.CAST or not rescales_in_backward_pass():
        return False
    if not (_state.stack and _state.stack[-1][1]):
        return False
    (x,) = invals
    new_dtype = eqn.params["new_dtype"]
    return (
        not isinstance(x, ScaledArray)
        and np.ndim(x) > 0
        and is_floating_dtype(x.dtype)
        and is_floating_dtype(new_dtype)
        and narrow_range(new_dtype)
        and not narrow_range(x.dtype)
    )


@contextlib.contextmanager
def evaluating(eqn: Any) -> Iterator[None]:
    """Marks the evaluation of ``eqn`` as part of the backward pass if it is a backward equation.

    Only the ``gradients`` and ``contractions`` components read the mark, so without them
    nothing is computed.
    """
    policy = active_policy()
    backward = (policy.gradients or policy.contractions) and is_backward_equation(eqn)
    _state.backward_depth += backward
    try:
        yield
    finally:
        _state.backward_depth -= backward


def _is_residual_to_rescale(x: Any) -> bool:
    return is_rescalable(x) and narrow_range(x.dtype) and not is_numpy(x.scale) and not was_rescaled(x)


def rescale_residuals(values: Sequence[Any]) -> list:
    """The residuals (:func:`backward_product_residuals`) holding float16/FP8 data with a run-time scale, rescaled together.

    One batch of statistics (:func:`rescale_all`) for all the residuals defined before the
    backward equation that first reads one of them: each is the same rescale as on its own,
    in fewer reductions. Wide data, constants (NumPy scales) and values whose scale was
    already chosen from their data are returned as they are.
    """
    values = list(values)
    where = [i for i, x in enumerate(values) if _is_residual_to_rescale(x)]
    for i, out in zip(where, rescale_all([values[i] for i in where])):
        values[i] = out
    return values


__all__ = [
    "ScalePolicy",
    "active_policy",
    "applying",
    "check_policy",
    "evaluating",
    "in_backward_pass",
    "inherit_mark",
    "is_backward_equation",
    "is_rescalable",
    "is_self_product",
    "mark_rescaled",
    "mark_sparse",
    "narrows_plain_backward_data",
    "recording_operand_rescales",
    "rescale_by_policy",
    "rescale_all",
    "rescale_contraction",
    "rescaled_into",
    "rescale_loop_carries",
    "rescale_operand",
    "rescale_residuals",
    "rescale_self_product",
    "rescale_self_product_operands",
    "rescaled_from_data",
    "rescales_cast",
    "rescales_in_backward_pass",
    "set_default_policy",
    "was_rescaled",
]
