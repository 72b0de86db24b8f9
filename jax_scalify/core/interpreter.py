"""The ``scalify`` transform: trace to a jaxpr, then evaluate it with the scale rules.

Evaluation is equation by equation:

1. no input is scaled and the primitive is not ``ALWAYS_SCALE`` (nor holds one in a
   sub-jaxpr): the equation is bound as it is;
2. otherwise the registered rule is called, unscaled floating inputs promoted first
   (see :mod:`jax_scalify.core.promotion`);
3. no rule: ``NotImplementedError`` naming the primitive, inputs and user source line.

The active scale policy (the protocol in :mod:`jax_scalify.core.sites`; ``jsa.RescalePolicy``
by default) acts at the interpreter's own sites: plain arrays entering the backward pass, the
gradients leaving it (the variables its jaxpr analyses name, rescaled together before their
first use by a forward equation) and the outputs of ``scalify``; the other sites are the rules'.

Nothing here knows about individual primitives: the rules, including those of call and
control-flow primitives, live in :mod:`jax_scalify.lax` and are looked up in the registry.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import os
import threading
import traceback as pytraceback
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var, jaxprs_in_params

from . import constants
from . import sites as rescale_policy
from .array import (
    ScaledArray,
    check_scalify_inputs,
    conform_traced_scales,
    evaluating_rules,
    is_floating_dtype,
    is_scaled_leaf,
    unscaled,
    warn_restored_scaled_arrays,
)
from .promotion import any_scale_array, is_any_scale, promote
from .registry import RegisteredRule, ScaledPrimitiveType, registered_rule
from .sites import ScalePolicy
from .vma import match_varying_axes


class _TraceState(threading.local):
    def __init__(self):
        self.depth = 0
        self.observers: list[EquationObserver] = []
        self.enclosing: list[JaxprEqn] = []  # the equations being evaluated, outermost first


_trace_state = _TraceState()
# The functions scalify returned, by identity: an attribute would not do, since JAX's
# transformations copy the wrapped function's attributes (jax.grad(scalify(f)) is not scalified).
_scalified_functions: weakref.WeakSet = weakref.WeakSet()
EquationObserver = Callable[[JaxprEqn, list, list], None]


@contextlib.contextmanager
def observe_equations(observer: EquationObserver):
    """Call ``observer(eqn, inputs, outputs)`` after every equation the interpreter evaluates.

    For analysis tools (e.g. recording the scale of every intermediate value). Inputs and
    outputs are ``ScaledArray`` or plain values; under ``jax.jit`` they are tracers, so run
    the scalified function eagerly (``jax.disable_jit()``) to see concrete values.
    """
    _trace_state.observers.append(observer)
    try:
        yield
    finally:
        _trace_state.observers.remove(observer)


def is_tracing_user_code() -> bool:
    """True while ``scalify`` traces a user function (the jaxpr it will evaluate is being built)."""
    return _trace_state.depth > 0


def scalify(
    fun: Callable[..., Any] | None = None,
    *,
    policy: ScalePolicy | None = None,
    static_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Sequence[str] | None = None,
) -> Callable[..., Any]:
    """Transform ``fun`` to propagate power-of-two scales through every operation.

    The returned function takes the same arguments as ``fun``, where any floating array
    may be a :class:`ScaledArray`. ``fun`` is traced on the data of its inputs, then each
    primitive of the trace is evaluated with its scale rule, so scaled inputs give
    scaled outputs whose ``data`` stays close to unit size. Unscaled inputs are left
    unscaled until they meet a scaled value. In float32 the result equals ``fun`` on the
    values of the inputs up to round-off (model invariance).

    Call convention (as ``eqx.filter_jit``): the array leaves of the arguments (JAX and
    NumPy arrays, ``ScaledArray``) are traced; every other leaf (Python ``bool``/``int``/
    ``float``, functions, dtypes, strings, ``None``) reaches ``fun`` as it is and is part
    of the trace's cache key, so a Python number is a constant: each new value traces
    again (pass a JAX array for a value that changes every step, e.g. a learning rate).
    ``static_argnums``/``static_argnames`` make whole arguments static, as in ``jax.jit``;
    an unhashable static value is traced again at each call. Non-array outputs are
    returned as they are. Flax NNX objects (modules, optimizers, ``nnx.Rngs``) may be
    passed: their in-place updates inside ``fun`` are carried back to the objects given.

    Input scales must be scalars, 0 or positive powers of two (positive and finite under
    ``Pow2RoundMode.NONE``). Concrete ones are checked (a ``ValueError`` naming the leaf);
    traced ones (``jax.jit(jsa.scalify(f))``) cannot be, and an invalid one is made NaN, so
    the results are NaN rather than silently wrong. ``fun`` is traced, as by ``jax.jit``,
    also when called eagerly: Python code that needs an array argument's value raises
    JAX's concretization error, with that explanation.

    Args:
        fun: the function to transform. Without it, ``scalify(policy=..., ...)`` returns a
            decorator.
        policy: where scales are re-estimated from the data at run time (a
            :class:`~jax_scalify.RescalePolicy`). ``None`` is ``RescalePolicy()``: the
            gradients the step computes, loop carries and the returned values are rescaled
            to their root mean square, so programs written without scalify in mind keep
            their data near unit size over many steps. ``RescalePolicy.static()`` is the
            paper's pure static propagation (output scales are functions of input scales
            only). Manual ``jsa.ops`` rescales compose with any policy.
        static_argnums, static_argnames: arguments made static as a whole, as in ``jax.jit``.

    ``scalify`` takes keyword arguments and any pytree in and out, composes with
    ``jax.jit``, ``eqx.filter_jit`` and ``nnx.jit`` on either side, with ``jax.grad``,
    ``jax.vjp`` and ``jax.vmap`` inside, and with itself (it is idempotent: an already
    scalified function keeps its policy).
    """
    policy = rescale_policy.check_policy(policy)
    if fun is None:
        return functools.partial(scalify, policy=policy, static_argnums=static_argnums, static_argnames=static_argnames)
    if not callable(fun):
        raise TypeError(
            f"scalify expects a function, got {fun!r}; pass the policy as a keyword: scalify(f, policy=...)."
        )
    if fun in _scalified_functions and static_argnums is None and static_argnames is None:
        return fun
    argnums, argnames = _static_arguments(fun, static_argnums, static_argnames)
    trace_cache: collections.OrderedDict = collections.OrderedDict()

    @functools.wraps(fun)
    def scalified(*args, **kwargs):
        args, kwargs = _hold_static_arguments(args, kwargs, argnums, argnames)
        graph_call = _adapted_call(fun, args, kwargs)
        if graph_call is not None:
            outs = _scalified_call(trace_cache, policy, graph_call.functional_fun, graph_call.functional_args, {})
            return graph_call.write_back(*outs)
        return _scalified_call(trace_cache, policy, fun, args, kwargs)

    _scalified_functions.add(scalified)
    return scalified


def _scalified_call(trace_cache, policy: ScalePolicy, fun, args, kwargs):
    leaves, in_tree = jax.tree.flatten((args, kwargs), is_leaf=is_scaled_leaf)
    if is_tracing_user_code() and not any(isinstance(x, ScaledArray) for x in leaves):
        # Called while an outer scalify traces: the outer interpreter sees these equations.
        args, kwargs = jax.tree.unflatten(in_tree, [_release_static(x) for x in leaves])
        return fun(*args, **kwargs)
    check_scalify_inputs(leaves, (args, kwargs), nested=is_tracing_user_code())
    if not is_tracing_user_code():
        leaves = conform_traced_scales(leaves)
    dynamic = [i for i, x in enumerate(leaves) if _is_dynamic(x)]
    closed_jaxpr, out_tree, static_outs = _cached_trace(trace_cache, fun, in_tree, leaves, dynamic)
    dynamic_leaves = [leaves[i] for i in dynamic]
    known = constants.known_constants(_exact_constants.get(closed_jaxpr.jaxpr))
    scaled_inputs = any(isinstance(x, ScaledArray) for x in dynamic_leaves)
    with evaluating_rules(), known, rescale_policy.applying(policy, scaled_inputs):
        outs = eval_scaled_jaxpr(closed_jaxpr.jaxpr, closed_jaxpr.consts, dynamic_leaves)
        if policy.outputs:
            fresh = [i for i, x in enumerate(outs) if not rescale_policy.was_rescaled(x)]
            for i, x in zip(fresh, rescale_policy.rescale_all([outs[i] for i in fresh], returned=True)):
                outs[i] = x
    return _rebuild_outputs(out_tree, static_outs, outs)


def _rebuild_outputs(out_tree, static_outs: dict, array_outs: list):
    """The function's outputs: the jaxpr's array outputs and the static ones in their places."""
    arrays = iter(array_outs)
    leaves = [static_outs[i] if i in static_outs else _as_jax_arrays(next(arrays)) for i in range(out_tree.num_leaves)]
    return jax.tree.unflatten(out_tree, leaves)


class _StaticArgument:
    """Holds an argument named static (``static_argnums``/``static_argnames``) as one leaf."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return type(other) is _StaticArgument and type(self.value) is type(other.value) and self.value == other.value

    def __hash__(self):
        return hash(self.value)


def _release_static(leaf):
    return leaf.value if isinstance(leaf, _StaticArgument) else leaf


def _static_arguments(fun, static_argnums, static_argnames) -> tuple[frozenset, frozenset]:
    """Positions and names of the static arguments, each completed from the other as ``jax.jit`` does."""
    argnums = {static_argnums} if isinstance(static_argnums, int) else set(static_argnums or ())
    argnames = {static_argnames} if isinstance(static_argnames, str) else set(static_argnames or ())
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature: take the arguments as given
        return frozenset(argnums), frozenset(argnames)
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    argnums |= {positional.index(name) for name in argnames if name in positional}
    argnames |= {positional[i] for i in argnums if -len(positional) <= i < len(positional)}
    return frozenset(argnums), frozenset(argnames)


def _hold_static_arguments(args: tuple, kwargs: dict, argnums: frozenset, argnames: frozenset):
    if not argnums and not argnames:
        return args, kwargs
    positions = {i % len(args) for i in argnums if -len(args) <= i < len(args)}
    args = tuple(_StaticArgument(a) if i in positions else a for i, a in enumerate(args))
    kwargs = {k: _StaticArgument(v) if k in argnames else v for k, v in kwargs.items()}
    return args, kwargs


_call_adapters: list[Callable[[Callable, tuple, dict], Any]] = []


def register_call_adapter(adapter: Callable[[Callable, tuple, dict], Any]) -> None:
    """Register ``adapter(fun, args, kwargs)``, consulted at every call of a scalified function.

    For arguments that are not pytrees of arrays (Flax NNX modules, updated in place): it
    returns None, or an object with ``functional_fun`` and ``functional_args`` (a pure
    function of arrays and its arguments) and ``write_back(*outs)`` (applies the pure
    function's outputs to the objects given and returns the call's result).
    """
    _call_adapters.append(adapter)


def _adapted_call(fun, args, kwargs):
    for adapter in _call_adapters:
        call = adapter(fun, args, kwargs)
        if call is not None:
            return call
    return None


def _as_jax_arrays(x):
    """Scales and constants folded at trace time are NumPy values; hand the user JAX arrays throughout."""
    if isinstance(x, ScaledArray):
        return ScaledArray.unchecked(_as_jax_arrays(x.data), _as_jax_arrays(x.scale))
    return jnp.asarray(x) if isinstance(x, (np.ndarray, np.generic)) else x


def _is_dynamic(leaf) -> bool:
    """Arrays (JAX, NumPy, ``ScaledArray``) are traced; every other leaf is static, as in ``eqx.filter_jit``."""
    if isinstance(leaf, (ScaledArray, jax.Array, np.ndarray, np.generic)):
        return True
    return not isinstance(leaf, (type, np.dtype, _StaticArgument)) and hasattr(leaf, "dtype") and hasattr(leaf, "shape")


_TRACE_CACHE_SIZE = 32


def _cached_trace(cache, fun, in_tree, leaves, dynamic) -> tuple[ClosedJaxpr, Any, dict]:
    """The jaxpr of ``fun`` for these input types, traced once per type signature.

    Like ``jax.jit``, a trace is reused for inputs of the same tree, shapes and dtypes (and
    equal static leaves). Traces holding tracers of an enclosing transformation as
    constants are never reused.
    """
    try:
        key = (in_tree, tuple(_leaf_signature(x, i in dynamic) for i, x in enumerate(leaves)))
        hash(key)
    except TypeError:  # an unhashable static leaf: trace every time
        return _trace_on_data(fun, in_tree, leaves, dynamic)
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    warn_restored_scaled_arrays(jax.tree.unflatten(in_tree, leaves))
    traced = _trace_on_data(fun, in_tree, leaves, dynamic)
    if not any(isinstance(c, jax.core.Tracer) for c in traced[0].consts):
        cache[key] = traced
        if len(cache) > _TRACE_CACHE_SIZE:
            cache.popitem(last=False)
    return traced


def _leaf_signature(leaf, is_dynamic: bool):
    if is_dynamic:
        return jax.typeof(leaf.data if isinstance(leaf, ScaledArray) else leaf)
    if isinstance(leaf, (bool, int, float, complex)):
        # By type and repr: True == 1 == 1.0 and 0.0 == -0.0 trace differently, nan != nan.
        return ("static", type(leaf), repr(leaf))
    return ("static", type(leaf), leaf)


def _trace_on_data(fun, in_tree, leaves, dynamic) -> tuple[ClosedJaxpr, Any, dict]:
    """Trace ``fun`` with every ``ScaledArray`` standing in as its data.

    ``dynamic`` indexes the leaves that become the jaxpr's arguments; the other (static)
    leaves are baked into the trace. Returns the jaxpr, the output tree and the static
    (non-array) outputs by leaf index: the jaxpr returns only the array outputs.
    """
    out_box = []

    def flat_fun(*flat_dynamic):
        flat = [_release_static(x) for x in leaves]
        for i, x in zip(dynamic, flat_dynamic):
            flat[i] = x
        args, kwargs = jax.tree.unflatten(in_tree, flat)
        _trace_state.depth += 1
        try:
            out = fun(*args, **kwargs)
        finally:
            _trace_state.depth -= 1
        out_flat, out_tree = jax.tree.flatten(out, is_leaf=is_scaled_leaf)
        static_outs = {i: x for i, x in enumerate(out_flat) if not _is_dynamic(x)}
        out_box.append((out_tree, static_outs))
        return [x for i, x in enumerate(out_flat) if i not in static_outs]

    examples = [leaves[i].data if isinstance(leaves[i], ScaledArray) else leaves[i] for i in dynamic]
    try:
        closed_jaxpr = jax.make_jaxpr(flat_fun)(*examples)
    except _VALUE_DEPENDENT_ERRORS as err:
        if getattr(err, "_scalify_explained", False):  # raised by a nested scalify: explained there
            raise
        raise _explained_value_dependence(err) from err
    _recover_exact_constants(closed_jaxpr, flat_fun, examples)
    return (closed_jaxpr, *out_box[0])


# JAX's errors for Python code that needs the value of a traced array. Plain eager JAX runs
# such code; scalify traces even when called eagerly, so it explains why.
_VALUE_DEPENDENT_ERRORS = (
    jax.errors.ConcretizationTypeError,  # TracerBoolConversionError among them
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
    jax.errors.NonConcreteBooleanIndexError,
)


def _explained_value_dependence(err: Exception) -> Exception:
    """``err`` (one of :data:`_VALUE_DEPENDENT_ERRORS`) again, of the same type, with the explanation first."""
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    explained = type(err).__new__(
        type(err),
        "jsa.scalify traces the function to a jaxpr, as jax.jit does, also when it is called eagerly: "
        "Python code that needs the value of an array argument (`if x > 0`, float(x), int(x), "
        "np.asarray(x), x[x > 0]) cannot run inside it. Use jnp.where, jax.lax.cond or "
        "jax.lax.while_loop, make the argument static (jsa.scalify(f, static_argnums=...)), or "
        f"compute it outside the scalified function. JAX's error: {first_line}",
    )
    explained._scalify_explained = True
    return explained


# Exact values of the constants that a trace on narrow-float data rounded (see core.constants),
# per traced jaxpr; kept as long as the jaxpr (e.g. in a trace cache).
_exact_constants: weakref.WeakKeyDictionary[Jaxpr, constants.ExactConstants] = weakref.WeakKeyDictionary()


def _recover_exact_constants(closed_jaxpr: ClosedJaxpr, flat_fun, examples) -> None:
    """Trace ``flat_fun`` again on float32 stand-ins of the narrow inputs if the data trace
    may have lost constants; only then (float32 programs are traced once)."""
    if not any(constants.is_narrow_float(getattr(x, "dtype", np.int32)) for x in examples):
        return
    if not constants.has_narrow_constants(closed_jaxpr):
        return
    widened = [constants.widened_example(x) for x in examples]
    found = constants.recover(closed_jaxpr, lambda: jax.make_jaxpr(flat_fun)(*widened))
    if found:
        _exact_constants[closed_jaxpr.jaxpr] = found


def eval_scaled_jaxpr(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """Evaluate ``jaxpr`` on ``args`` (``ScaledArray`` or plain) with the scale rules.

    This is the engine of :func:`scalify`; rules of call and control-flow primitives call
    it on their sub-jaxprs. A plain value known at trace time is its own NumPy (or Python)
    value (see :func:`~jax_scalify.core.constants.known_scalar`): plain equations of the
    scalar-preserving primitives on such values are folded into NumPy values
    (:func:`~jax_scalify.core.constants.fold`) instead of bound, so a constant stays one
    wherever it is passed, and promotion splits it exactly.
    """
    with constants.known_constants():
        return _eval_jaxpr(jaxpr, consts, args)


def _eval_jaxpr(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    if len(args) != len(jaxpr.invars):
        raise ValueError(f"The jaxpr takes {len(jaxpr.invars)} arguments, {len(args)} were given.")
    env: dict[Var, Any] = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    def write(v, value):
        if type(v) is Var:  # not a DropVar
            env[v] = value

    for v, value in zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args]):
        write(v, value)
    gradients = _gradients_to_rescale(jaxpr)
    residuals = _residuals_to_rescale(jaxpr)
    pending: list[Var] = []  # gradients defined, to rescale together before their first forward use
    pending_residuals: list[Var] = []  # residuals defined, to rescale together before their first backward use

    def rescale_pending():
        fresh = [v for v in pending if not rescale_policy.was_rescaled(env[v])]  # a rule may have rescaled one
        for v, val in zip(fresh, rescale_policy.rescale_all([env[v] for v in fresh])):
            env[v] = val
        pending.clear()

    def rescale_pending_residuals():
        for v, val in zip(pending_residuals, rescale_policy.rescale_residuals([env[v] for v in pending_residuals])):
            env[v] = val
        pending_residuals.clear()

    with rescale_policy.recording_operand_rescales() as operand_rescales:
        for eqn in jaxpr.eqns:
            uses_gradient = pending and any(isinstance(v, Var) and v in gradients for v in eqn.invars)
            if uses_gradient and not rescale_policy.is_backward_equation(eqn):
                rescale_pending()
            uses_residual = pending_residuals and any(isinstance(v, Var) and v in residuals for v in eqn.invars)
            if uses_residual and rescale_policy.is_backward_equation(eqn):
                rescale_pending_residuals()
            invals = [read(v) for v in eqn.invars]
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            with (
                source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
                eqn.ctx.manager,
                rescale_policy.evaluating(eqn),
            ):
                _trace_state.enclosing.append(eqn)
                try:
                    outvals = _eval_equation(eqn, invals)
                finally:
                    _trace_state.enclosing.pop()
            for observer in _trace_state.observers:
                observer(eqn, invals, outvals)
            if operand_rescales:
                _rebind_rescaled_operands(eqn, invals, operand_rescales, write)
            for v, val in zip(eqn.outvars, outvals):
                write(v, val)
                if v in gradients:
                    pending.append(v)
                elif v in residuals:
                    pending_residuals.append(v)
    if pending:
        rescale_pending()
    return [read(v) for v in jaxpr.outvars]


def _rebind_rescaled_operands(eqn: JaxprEqn, invals: list, rescaled: dict, write) -> None:
    """Binds each operand a rule rescaled (same value) to its rescaled array, then empties the record."""
    for v, x in zip(eqn.invars, invals):
        if id(x) in rescaled and rescaled[id(x)][0] is x:
            write(v, rescaled[id(x)][1])
    rescaled.clear()


def _gradients_to_rescale(jaxpr: Jaxpr) -> frozenset:
    """The variables of ``jaxpr`` the active policy rescales as gradients (none in a backward pass)."""
    if rescale_policy.in_backward_pass():
        return frozenset()
    return rescale_policy.active_policy().gradient_values(jaxpr)


def _residuals_to_rescale(jaxpr: Jaxpr) -> frozenset:
    """The forward values of ``jaxpr`` the active policy rescales before the backward pass multiplies them."""
    if rescale_policy.in_backward_pass():
        return frozenset()
    return rescale_policy.active_policy().residual_values(jaxpr)


def _eval_equation(eqn: JaxprEqn, invals: list) -> list:
    prim = eqn.primitive
    entry = registered_rule(prim)
    scaled_type = entry.scaled_type if entry else ScaledPrimitiveType.FORWARD
    if scaled_type == ScaledPrimitiveType.NEVER:
        return _bind(eqn, [unscaled(x) for x in invals])
    needs_rule = (
        scaled_type == ScaledPrimitiveType.ALWAYS_SCALE
        or any(isinstance(x, ScaledArray) for x in invals)
        or _holds_always_scale(eqn)
    )
    if not needs_rule:
        folded = constants.fold(eqn, entry.scalar_fn if entry else None, invals)
        if folded is not None:
            return folded
        enters_scaled = constants.spreads_out_of_range(invals) or rescale_policy.narrows_plain_backward_data(
            eqn, invals
        )
        if entry is None or not enters_scaled:
            return _bind(eqn, invals)
    constants.check_not_lost(eqn)
    if entry is None:
        raise _missing_rule_error(eqn, invals)
    if entry.unpromoted_inputs:
        inputs = list(invals)
    else:
        backward = rescale_policy.rescales_in_backward_pass()  # evaluating(eqn) counts a backward eqn
        inputs = [_promote_if_floating(x, backward) for x in invals]
    outs = entry.rule(*inputs, **eqn.params)
    outs = list(outs) if prim.multiple_results else [outs]
    _check_rule_outputs(eqn, outs)
    return _keep_any_scale(entry, inputs, outs)


def _keep_any_scale(entry: RegisteredRule, inputs: list, outs: list) -> list:
    """A scalar-preserving primitive maps a constant 0 or ±inf to a constant 0 or ±inf.

    Keeps e.g. ``broadcast_in_dim(convert_element_type(0.0))`` any-scale inside a jitted
    call that received the literal 0.0 as an argument (as ``jnp.where`` does).
    """
    floating = [x for x in inputs if isinstance(x, ScaledArray)]
    if floating and all(is_any_scale(x) for x in floating) and entry.scalar_fn:
        return [any_scale_array(o.data, o.scale) if isinstance(o, ScaledArray) else o for o in outs]
    return outs


def _bind(eqn: JaxprEqn, invals: list) -> list:
    params = eqn.primitive.get_bind_params(eqn.params)  # a dict of bind params in JAX >= 0.10
    if len(invals) > 1:
        invals = match_varying_axes([v.aval for v in eqn.invars], invals)
    outs = eqn.primitive.bind(*invals, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _promote_if_floating(x, backward: bool = False):
    if isinstance(x, ScaledArray) or not hasattr(x, "dtype") or not is_floating_dtype(x.dtype):
        return x
    scalar = constants.known_scalar(x)
    promoted = promote(x, scalar)
    if scalar is None and np.ndim(x) > 0 and backward:
        # A plain array entering the scaled backward pass derives from the loss's cotangent
        # (jax.grad's seed times the loss's constants and plain inputs such as one-hot
        # labels): its data is not unit-sized, so its statistic goes into the scale.
        return rescale_policy.rescale_by_policy(promoted)
    return promoted


def eval_closed_jaxpr(closed: ClosedJaxpr, args: Sequence[Any]) -> list[Any]:
    """:func:`eval_scaled_jaxpr` on a closed sub-jaxpr, for the rules of call primitives.

    Arguments are taken as they are: a plain one known at trace time stays known inside.
    """
    return eval_scaled_jaxpr(closed.jaxpr, closed.consts, list(args))


@functools.lru_cache(maxsize=4096)
def _jaxpr_holds_always_scale(jaxpr: Jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        entry = registered_rule(eqn.primitive)
        if entry and entry.scaled_type == ScaledPrimitiveType.ALWAYS_SCALE:
            return True
        if _holds_always_scale(eqn):
            return True
    return False


def _holds_always_scale(eqn: JaxprEqn) -> bool:
    for sub in jaxprs_in_params(eqn.params):
        if _jaxpr_holds_always_scale(sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub):
            return True
    return False


def _describe(x) -> str:
    if isinstance(x, ScaledArray):
        return f"ScaledArray {x.dtype}{list(x.shape)}"
    if hasattr(x, "dtype"):
        return f"{x.dtype}{list(np.shape(x))}"
    return type(x).__name__


def _missing_rule_error(eqn: JaxprEqn, invals: list) -> NotImplementedError:
    name = eqn.primitive.name
    inputs = ", ".join(_describe(x) for x in invals)
    return NotImplementedError(
        f"jax_scalify has no scale rule for the primitive '{name}'.\n"
        f"  inputs: {inputs}\n"
        f"  from:   {_user_location(eqn)}\n"
        "Register one with a decorator (the rule gets ScaledArray inputs and the equation's params):\n"
        f"    @jax_scalify.extend.register_scaled_op(<the '{name}' primitive>)\n"
        f"    def scaled_{name}(*inputs, **params): ...\n"
        "or compute this part outside scalify, or on plain values with jsa.lax.stop_scaling."
    )


_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(module.__file__)) + os.sep for module in (jax, np)) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)


def _is_library_file(file_name: str) -> bool:
    path = os.path.abspath(file_name)
    return path.startswith(_LIBRARY_DIRS) or os.sep + "jaxlib" + os.sep in path


def _user_location(eqn: JaxprEqn) -> str:
    """The innermost user source line that produced ``eqn``: not in JAX, NumPy or jax_scalify.

    The equation's own traceback is searched first. An equation traced entirely inside
    library code (a jitted library function such as ``jnp.fft.rfft``, whose sub-jaxpr is
    traced on its own) has no user frame there; the equations that enclose it (the call of
    that function) are searched next, innermost first, then the current Python stack, which
    gives the line that called the scalified function.
    """
    for enclosing in [eqn, *reversed(_trace_state.enclosing)]:
        traceback = enclosing.source_info.traceback
        for frame in traceback.frames if traceback is not None else ():
            if not _is_library_file(frame.file_name):
                return f"{frame.file_name}:{frame.line_num} ({frame.function_name})"
    for frame in reversed(pytraceback.extract_stack()):
        if not _is_library_file(frame.filename):
            return (
                f"{frame.filename}:{frame.lineno} ({frame.name}), the call of the scalified function "
                "(the primitive comes from library code it runs)"
            )
    return "unknown (no user frame on the stack)"


def _check_rule_outputs(eqn: JaxprEqn, outs: list) -> None:
    if len(outs) != len(eqn.outvars):
        raise RuntimeError(
            f"The scale rule of '{eqn.primitive.name}' returned {len(outs)} outputs, expected {len(eqn.outvars)}."
        )
    for out, var in zip(outs, eqn.outvars):
        aval = var.aval
        if not hasattr(aval, "shape"):
            continue
        got_shape, got_dtype = np.shape(out.data if isinstance(out, ScaledArray) else out), getattr(out, "dtype", None)
        if tuple(got_shape) != tuple(aval.shape) or (
            got_dtype is not None and got_dtype != aval.dtype
        ):  # PRNG keys too
            raise RuntimeError(
                f"The scale rule of '{eqn.primitive.name}' returned {_describe(out)}, "
                f"expected {aval.dtype}{list(aval.shape)}. This is a bug in the rule."
            )
