"""Rescale policy: where ``scalify`` moves a statistic of the data into the scale by itself.

The scale rules propagate scales statically: each output scale is a function of the input
scales, chosen as if the inputs were unit-scaled and independent. In a training step that
assumption fails in a few predictable places, and the static scales drift from the data:

- the gradients the step computes: a backward pass multiplies many estimates, and its
  scales come out orders of magnitude above the values (data near underflow), which then
  inflate every sum they enter (the sum scale is about the larger operand scale);
- loop carries (``scan``, ``while``, ``fori_loop``): the same body estimate compounds at
  every iteration (a scale growing by a constant factor per step of an RNN);
- the values a step returns as the next step's state (parameters, optimizer moments): a
  static scale never follows the value down (``b1 * m + (1 - b1) * g`` keeps ``m``'s scale
  while ``m`` decays), so the drift accumulates over steps;
- contractions (``dot_general``, convolutions) in the forward pass: the static rule expects
  a sum of ``K`` products to grow like ``sqrt(K)``, as for independent operands; trained
  weights and positive activations (after ReLU, SiLU, softplus) are correlated, their sums
  grow up to ``K``, and a chain of projections with no normalisation between them (an MLP,
  a Mamba mixer's ``in_proj -> x_proj -> dt_proj``) adds each layer's departure to the last;
- products of two values that share one scale (``x * x``, or slices of one array multiplied
  together, as ``jax.lax.associative_scan``'s combine does at every level): the product
  squares both the scale and any departure of the data from unit size, so repeated
  squarings compound it exponentially (a cumulative product over 256 steps of data in
  ``[1, 2)`` overflows float32 data, and its scale leaves float32's range).

At these points a :class:`RescalePolicy` rescales dynamically: the root mean square (or
another statistic) of the data is rounded to a power of two and moved into the scale.
Multiplying by powers of two is exact, so values are unchanged (float32 invariance holds
under every policy); only the representation moves back to unit size.

Everything else stays static: the rules are not changed, and manual rescales
(``jsa.ops.dynamic_rescale*``) compose with any policy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from jax.extend import source_info_util
from jax.extend.core import Jaxpr, Var

from .array import ScaledArray, is_floating_dtype, narrow_range
from .pow2 import is_numpy
from .promotion import is_any_scale

_NORMS = ("l1", "l2", "max")
_COMPONENTS = ("gradients", "loop_carries", "outputs", "contractions", "self_products", "fp8_casts")


@dataclasses.dataclass(frozen=True)
class RescalePolicy:
    """Where ``jsa.scalify`` inserts dynamic rescales by itself (see the module docstring).

    Args:
        gradients: rescale the gradients the step computes: every value defined in the
            backward pass (an equation whose name stack holds ``transpose(``, as those of
            ``jax.grad``/``jax.vjp`` do) that leaves it, i.e. is used by a forward equation
            (e.g. the optimizer update) or returned. One rescale per gradient tensor, all
            of them together once the backward pass is done (before the first forward use
            of any). Inside the backward pass, a plain array that meets scaled data (the
            loss's cotangent times plain inputs such as one-hot labels: ``1 / N`` sits in
            its values) is promoted with its statistic as scale instead of scale 1 (also
            where such float32 data are cast to float16/FP8 before they meet scaled data,
            in a function given scaled inputs: float32 one-hot labels), and a
            sum of float16/FP8 data (``reduce_sum``, ``cumsum``, ``scatter-add``; not collectives) is accumulated in
            float32 and rescaled from its result before it is narrowed (the transposes of
            broadcasts add contributions that share a sign: up to ``K`` times a term, not
            the ``sqrt(K)`` of the static rule), and so is an elementwise sum (``add``,
            ``sub``, ``add_any``) of two operands with run-time scales of their own, in any
            floating dtype (taken at the smaller operand scale: a product whose factors
            cancelled, such as the tanh GELU's ``x ** 3`` term, no longer lends its large
            scale to the cotangent); and each float16/FP8 forward value that a backward
            product (``mul``) reads is rescaled once, before its first backward use (the
            backward pass of a ``jvp`` multiplies the cotangent by four or five of them in
            a row, and each static product adds its factor's departure from unit size);
            the rest of the backward pass is static.
        loop_carries: rescale the scaled carries of ``scan`` and ``while`` bodies at every
            iteration (this includes the transposed scans of a backward pass).
        outputs: rescale the floating scaled outputs of the scalified function (the state
            handed to the next step), together. Outputs already rescaled are not rescaled
            twice: as gradients, by ``jsa.ops.dynamic_rescale`` with the policy's
            statistic (``jsa.optim.scale_state``'s stored state), or a float cast of
            either; a scale set with ``jsa.lax.set_scaling`` stands (here, in loop
            carries and among the gradients). The data of a float16/FP8 output whose sample is mostly zeros (a
            parameter that only lookups update) are moved down by the statistic, never up.
        contractions: rescale the result of every forward contraction (``dot_general``,
            ``conv_general_dilated``: ``x @ w``, ``jnp.einsum``, ``nn.Dense``, ``nn.Conv``)
            from its data, in every floating dtype. Its static scale assumes independent
            unit-sized operands; trained weights and positive activations are correlated,
            and each layer of a chain without normalisation added its departure to the
            previous one's (float16 data 2^6 above unit size after four projections of a
            Mamba mixer, whose backward products then overflowed; in float32, weights given
            at scale 2^8 with their data 2^-8 off unit size sank the data of seven chained
            layers to 2^-77, where a square underflows). Contractions of the backward pass
            stay static (their sums are the gradients, rescaled where they leave it).
        self_products: rescale the product of two operands that share one scale object
            (``x * x``; slices of one array multiplied together, as in the combine of
            ``jax.lax.associative_scan`` or ``jnp.cumprod`` written as a parallel scan), the
            operands of such a contraction before it (``x @ x.T``, iterated in the
            Newton-Schulz orthogonalisation of Muon), and
            the base of a power ``x ** y`` with ``|y| >= 3``, before the power; such a
            product of float16/FP8 data is computed in float32 and narrowed with its
            largest entry bounded. Products of independent values (activations and weights)
            are left static.
        fp8_casts: rescale a value cast from wider data to an 8-bit float (the forward
            and backward casts of ``jsa.nn.linear``, ``jsa.nn.cast_dot_general``,
            ``jsa.ops.cast_on_forward``...) by the statistic of all its data, its largest
            entry kept at most half the format's largest power of two, as per-tensor FP8
            recipes do: one reduction of the tensor per cast. Static scales estimate a
            sum of ``K`` terms as ``sqrt(K)`` terms; positive, correlated ReLU activations
            add up like ``K``, and their data grew 2**4 per layer until ``float8_e4m3fn``,
            which has no inf, turned them into NaN (an Equinox CNN in FP8 at step 34).
            Plain arrays (not ``ScaledArray``) are cast as in plain JAX.
        norm: the statistic moved into the scale: ``"l2"`` (root mean square, the
            default), ``"l1"`` (mean absolute value) or ``"max"`` (maximum absolute value).
            It is rounded to a power of two with the configured rounding mode.
        sample_size: a tensor of at most this many elements is read whole; a larger one
            on a strided sample of at most about this many elements, and at most 32 along
            any axis (every axis sampled with a regular stride); ``None`` reads every tensor whole. A power of two only
            needs the order of magnitude, and reading every gradient and every state tensor
            once more would cost several passes over the model per step; the sample costs
            next to nothing, and its statistic compiles into one small kernel. A sample that
            is all zeros (e.g. a sparse gradient) leaves the scale unchanged.

    ``RescalePolicy()`` (all on, RMS) is the default of ``jsa.scalify``;
    :meth:`RescalePolicy.static` is the paper's pure static propagation (no automatic
    rescale). Values are the same under every policy; only the data/scale split differs.
    """

    gradients: bool = True
    loop_carries: bool = True
    outputs: bool = True
    contractions: bool = True
    self_products: bool = True
    fp8_casts: bool = True
    norm: str = "l2"
    sample_size: int | None = 1024

    def __post_init__(self):
        for field in _COMPONENTS:
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"RescalePolicy.{field} must be True or False, got {getattr(self, field)!r}.")
        if self.norm not in _NORMS:
            raise ValueError(f"RescalePolicy.norm must be one of {_NORMS}, got {self.norm!r}.")
        size = self.sample_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"RescalePolicy.sample_size must be a positive int or None, got {size!r}.")

    @classmethod
    def static(cls) -> RescalePolicy:
        """The paper's pure static propagation: no automatic rescale anywhere."""
        return cls(**dict.fromkeys(_COMPONENTS, False))

    @property
    def is_static(self) -> bool:
        return not any(getattr(self, field) for field in _COMPONENTS)


DEFAULT_POLICY = RescalePolicy()
STATIC_POLICY = RescalePolicy.static()


def check_policy(policy: RescalePolicy | None) -> RescalePolicy:
    """``policy`` checked (``None`` is the default policy)."""
    if policy is None:
        return DEFAULT_POLICY
    if not isinstance(policy, RescalePolicy):
        raise TypeError(
            f"scalify: policy must be a jsa.RescalePolicy or None, got {policy!r}. "
            "Use jsa.RescalePolicy() (default) or jsa.RescalePolicy.static()."
        )
    return policy


class _PolicyState(threading.local):
    def __init__(self):
        # per scalify evaluation: (policy, rescaled values, sparse values, given scaled inputs)
        self.stack: list[tuple[RescalePolicy, dict[int, Any], dict[int, Any], bool]] = []
        self.backward_depth = 0
        self.operand_rescales: list[dict[int, tuple[Any, Any]]] = []


_state = _PolicyState()


@contextlib.contextmanager
def applying(policy: RescalePolicy, scaled_inputs: bool = True) -> Iterator[None]:
    """The policy the interpreter and the control-flow rules apply while ``scalify`` evaluates.

    ``scaled_inputs``: whether the scalified function was given a ``ScaledArray``.
    """
    _state.stack.append((policy, {}, {}, scaled_inputs))
    try:
        yield
    finally:
        _state.stack.pop()


def active_policy() -> RescalePolicy:
    """The policy of the innermost ``scalify`` being evaluated (static outside any)."""
    return _state.stack[-1][0] if _state.stack else STATIC_POLICY


def _rescaled_by_policy() -> dict[int, Any]:
    return _state.stack[-1][1] if _state.stack else {}


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
    """Record ``x`` as having a deliberately chosen scale in the current ``scalify`` evaluation.

    The policy's rescales (gradients, loop carries, outputs, residuals) then leave it as it
    is. For rules whose output scale is chosen: a rescale with the policy's own statistic, a
    cast of such a value, a bound known from the op (re-estimating it would move nothing),
    and, with ``explicit=True``, a scale the user set (``jsa.lax.set_scaling``), which must
    stand; an explicit ``jsa.ops.dynamic_rescale`` still rescales such a value. Returns ``x``.
    """
    if isinstance(x, ScaledArray):
        _rescaled_by_policy()[id(x)] = (x, explicit)  # x kept alive, so the id is not reused
    return x


def inherit_mark(out: Any, x: Any) -> Any:
    """``out``, a new representation of ``x``'s value (a cast), marked as ``x`` is (see :func:`mark_rescaled`)."""
    entry = _rescaled_by_policy().get(id(x))
    if entry is not None and entry[0] is x:
        mark_rescaled(out, explicit=entry[1])
    return out


def mark_sparse(x: Any) -> Any:
    """Record that ``x``'s data may sit in a few entries (a scatter into zeros: the gradient of a lookup).

    A strided sample of such data can hold only the small rows; the policy's rescale of
    narrow (float16/FP8) data marked sparse also bounds its largest entry (one reduction of
    the tensor), so the rows the sample missed cannot overflow. Returns ``x``.
    """
    if isinstance(x, ScaledArray) and _state.stack:
        _state.stack[-1][2][id(x)] = x  # kept alive, so the id is not reused
    return x


def is_sparse(x: Any) -> bool:
    """True if ``x`` was marked by :func:`mark_sparse` in the current ``scalify`` evaluation."""
    return bool(_state.stack) and _state.stack[-1][2].get(id(x)) is x


def rescale(x: Any, policy: RescalePolicy | None = None) -> Any:
    """``x`` dynamically rescaled with the policy's statistic (non-rescalable values unchanged).

    The rescale itself is :func:`jax_scalify.ops.rescaling.rescale_scaled_array` (imported
    lazily: the core does not depend on the ops layer at import time).
    """
    if not is_rescalable(x):
        return x
    from ..ops.rescaling import rescale_scaled_array

    policy = policy or active_policy()
    return mark_rescaled(rescale_scaled_array(x, policy.norm, policy.sample_size))


def rescale_into_narrow(x: Any, dtype: Any) -> Any:
    """``x`` (wide data) rescaled with the policy's statistic of all its data and cast to the narrow ``dtype``.

    :func:`jax_scalify.ops.rescaling.rescaled_into_narrow` (imported lazily, as in
    :func:`rescale`); a value that is not rescalable is returned as it is.
    """
    if not is_rescalable(x):
        return x
    from ..ops.rescaling import rescaled_into_narrow

    return mark_rescaled(rescaled_into_narrow(x, dtype, active_policy().norm))


def rescales_cast(x: Any, dtype: Any) -> bool:
    """Whether a cast of ``x`` to the floating ``dtype`` goes through :func:`rescale_into_narrow` (``fp8_casts``).

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
    """:func:`rescale` of an operand of the equation being evaluated; later equations read the result.

    A rescale changes the representation, not the value, so once a rule has rescaled an
    operand the interpreter binds the operand's variable to the rescaled array for the
    equations after it (:func:`recording_operand_rescales`): the base of ``x ** 3``,
    rescaled for the cube, is also the ``x`` of the ``3 * x ** 2`` and ``x * t`` that
    differentiate it, instead of the drifted data multiplied once more. For rules that
    trace no sub-computation (the result must belong to the trace of the operand).
    """
    out = rescale(x)
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


def rescale_all(values: Sequence[Any], policy: RescalePolicy | None = None, *, returned: bool = False) -> list:
    """``values`` with the rescalable ones rescaled together (one batch of statistics), others unchanged.

    ``returned``: the values ``scalify`` returns; the data of a narrow one whose sample is
    mostly zeros is not moved up (see :func:`jax_scalify.ops.rescaling.rescale_scaled_arrays`).
    """
    values = list(values)
    where = [i for i, x in enumerate(values) if is_rescalable(x)]
    if not where:
        return values
    from ..ops.rescaling import rescale_scaled_arrays

    policy = policy or active_policy()
    outs = rescale_scaled_arrays([values[i] for i in where], policy.norm, policy.sample_size, sparse_stay_down=returned)
    for i, out in zip(where, outs):
        values[i] = mark_rescaled(out)
    return values


def was_rescaled(x: Any) -> bool:
    """True if ``x``'s scale was chosen in the current ``scalify`` evaluation (:func:`mark_rescaled`)."""
    entry = _rescaled_by_policy().get(id(x))
    return entry is not None and entry[0] is x


def rescaled_from_data(x: Any) -> bool:
    """True if ``x``'s scale was chosen from its data (:func:`mark_rescaled` without ``explicit``)."""
    entry = _rescaled_by_policy().get(id(x))
    return entry is not None and entry[0] is x and not entry[1]


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
    return rescale(product) if is_self_product(a, b) else product


def rescale_contraction(out: Any) -> Any:
    """The result of a contraction, rescaled under the policy's ``contractions`` in the forward pass.

    Traced data only: a contraction of constants (NumPy data) is not measured.
    """
    if not active_policy().contractions or in_backward_pass() or not is_rescalable(out) or is_numpy(out.data):
        return out
    return rescale(out)


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
    sample can only estimate it worse. (A deep-equilibrium model's tangent solve: one row of
    the cotangent carried the tensor, the sample read none of its rows and moved the data
    2^10 up, to inf after a few iterations.)
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
    if eqn.primitive.name != "convert_element_type" or not rescales_in_backward_pass():
        return False
    if not (_state.stack and _state.stack[-1][3]):
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


# The backward primitives whose forward operands are rescaled before them (see backward_product_residuals).
_RESIDUAL_READERS = frozenset({"mul"})


@functools.lru_cache(maxsize=4096)
def backward_product_residuals(jaxpr: Jaxpr) -> frozenset:
    """Variables defined by a forward equation of ``jaxpr`` and multiplied (``mul``) by a backward one.

    The residuals a derivative multiplies onto the cotangent: the backward pass of a
    ``jvp`` multiplies it by four or five forward values in a row with no sum in between,
    and each static product adds its operand's departure from unit size.
    """
    forward_defined = {v for e in jaxpr.eqns if not is_backward_equation(e) for v in e.outvars if type(v) is Var}
    return frozenset(
        v
        for e in jaxpr.eqns
        if e.primitive.name in _RESIDUAL_READERS and is_backward_equation(e)
        for v in e.invars
        if isinstance(v, Var) and v in forward_defined
    )


def rescale_residual(x: Any) -> Any:
    """A residual (:func:`backward_product_residuals`) rescaled if it holds float16/FP8 data with a run-time scale.

    Wide data, constants (NumPy scales) and values whose scale was already chosen from their
    data are returned as they are.
    """
    if not (is_rescalable(x) and narrow_range(x.dtype)) or is_numpy(x.scale) or was_rescaled(x):
        return x
    return rescale(x)


@functools.lru_cache(maxsize=4096)
def gradient_boundary(jaxpr: Jaxpr) -> frozenset:
    """Variables defined by a backward equation and used by a forward one or returned.

    Backward equations are those whose name stack holds ``transpose(``; the jaxpr is
    assumed to be evaluated outside any backward pass (its returned values are then used
    by forward code).
    """
    backward = [is_backward_equation(e) for e in jaxpr.eqns]
    defined_backward = {v for e, b in zip(jaxpr.eqns, backward) if b for v in e.outvars if type(v) is Var}
    if not defined_backward:
        return frozenset()
    leaving = {v for v in jaxpr.outvars if isinstance(v, Var) and v in defined_backward}
    for eqn, is_bwd in zip(jaxpr.eqns, backward):
        if not is_bwd:
            leaving.update(v for v in eqn.invars if isinstance(v, Var) and v in defined_backward)
    return frozenset(leaving)


__all__ = [
    "DEFAULT_POLICY",
    "backward_product_residuals",
    "RescalePolicy",
    "STATIC_POLICY",
    "active_policy",
    "applying",
    "check_policy",
    "evaluating",
    "gradient_boundary",
    "in_backward_pass",
    "is_backward_equation",
    "is_rescalable",
    "is_self_product",
    "is_sparse",
    "rescale",
    "rescale_all",
    "rescale_contraction",
    "rescale_into_narrow",
    "rescale_loop_carries",
    "rescale_self_product",
    "rescale_self_product_operands",
    "inherit_mark",
    "mark_rescaled",
    "mark_sparse",
    "recording_operand_rescales",
    "rescale_operand",
    "rescale_residual",
    "rescaled_from_data",
    "rescales_in_backward_pass",
    "was_rescaled",
]
