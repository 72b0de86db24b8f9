"""The ``scalify`` transform: trace to a jaxpr, then evaluate it with the scale rules.

Evaluation is equation by equation (design section 4):

1. no input is scaled and the primitive is not ``ALWAYS_SCALE`` (nor holds one in a
   sub-jaxpr): the equation is bound as it is;
2. otherwise the registered rule is called, unscaled floating inputs promoted first
   (see :mod:`jax_scalify.core.promotion`);
3. no rule: ``NotImplementedError`` naming the primitive, inputs and user source line.

The rescale policy (:mod:`jax_scalify.core.policy`) adds dynamic rescales at a few points:
the gradients leaving the backward pass (rescaled together before their first use by a
forward equation), and the outputs of ``scalify``; loop carries are the control-flow rules'.

Nothing here knows about individual primitives: the rules, including those of call and
control-flow primitives, live in :mod:`jax_scalify.lax` and are looked up in the registry.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var, jaxprs_in_params

from . import known_pow2
from . import policy as rescale_policy
from .array import ScaledArray, is_floating_dtype, is_scaled_leaf
from .policy import RescalePolicy
from .promotion import AnyScaleArray, promote
from .registry import ScaledPrimitiveType, find_registered_scaled_op, scalar_preserving_fn
from .vma import match_varying_axes

jax.tree_util.register_pytree_node(
    AnyScaleArray,
    lambda x: ((x.data, x.scale), None),
    lambda _, children: AnyScaleArray.tree_unflatten(None, children),
)


class _TraceState(threading.local):
    def __init__(self):
        self.depth = 0
        self.observers: list[EquationObserver] = []


_trace_state = _TraceState()
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


def _is_tracing_user_code() -> bool:
    return _trace_state.depth > 0


def unpromoted_inputs(rule: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: the scale rule receives its inputs as they are (unscaled ones not promoted).

    For rules of primitives that hold sub-jaxprs (``scan``, ``while``, ``cond``,
    ``checkpoint``): they pass unscaled inputs into the sub-jaxpr unscaled, so that only the
    values that meet a scaled one inside it get a scale.
    """
    rule._jsa_unpromoted_inputs = True
    return rule


def scalify(fun: Callable[..., Any] | None = None, *, policy: RescalePolicy | None = None) -> Callable[..., Any]:
    """Transform ``fun`` to propagate power-of-two scales through every operation.

    The returned function takes the same arguments as ``fun``, where any floating array
    may be a :class:`ScaledArray`. ``fun`` is traced on the data of its inputs, then each
    primitive of the trace is evaluated with its scale rule, so scaled inputs give
    scaled outputs whose ``data`` stays close to unit size. Unscaled inputs are left
    unscaled until they meet a scaled value. In float32 the result equals ``fun`` on the
    values of the inputs up to round-off (model invariance).

    Args:
        fun: the function to transform. Without it, ``scalify(policy=...)`` returns a
            decorator.
        policy: where scales are re-estimated from the data at run time (a
            :class:`~jax_scalify.RescalePolicy`). ``None`` is ``RescalePolicy()``: the
            gradients the step computes, loop carries and the returned values are rescaled
            to their root mean square, so programs written without scalify in mind keep
            their data near unit size over many steps. ``RescalePolicy.static()`` is the
            paper's pure static propagation (output scales are functions of input scales
            only). Manual ``jsa.ops`` rescales compose with any policy.

    ``scalify`` takes keyword arguments and any pytree in and out, composes with
    ``jax.jit`` on either side, with ``jax.grad``, ``jax.vjp`` and ``jax.vmap`` inside,
    and with itself (it is idempotent: an already scalified function keeps its policy).
    """
    policy = rescale_policy.check_policy(policy)
    if fun is None:
        return functools.partial(scalify, policy=policy)
    if not callable(fun):
        raise TypeError(f"scalify expects a function, got {fun!r}; pass the policy as a keyword: scalify(f, policy=...).")
    if getattr(fun, "_jsa_scalified", False):
        return fun
    trace_cache: collections.OrderedDict = collections.OrderedDict()

    @functools.wraps(fun)
    def scalified(*args, **kwargs):
        leaves, in_tree = jax.tree.flatten((args, kwargs), is_leaf=is_scaled_leaf)
        if _is_tracing_user_code() and not any(isinstance(x, ScaledArray) for x in leaves):
            # Called while an outer scalify traces: the outer interpreter sees these equations.
            return fun(*args, **kwargs)
        dynamic = [i for i, x in enumerate(leaves) if _is_dynamic(x)]
        closed_jaxpr, out_tree = _cached_trace(trace_cache, fun, in_tree, leaves, dynamic)
        dynamic_leaves = [leaves[i] for i in dynamic]
        with known_pow2.tracking(), rescale_policy.applying(policy):
            outs = eval_scaled_jaxpr(closed_jaxpr.jaxpr, closed_jaxpr.consts, dynamic_leaves)
            if policy.outputs:
                fresh = [i for i, x in enumerate(outs) if not rescale_policy.was_rescaled(x)]
                for i, x in zip(fresh, rescale_policy.rescale_all([outs[i] for i in fresh])):
                    outs[i] = x
        return jax.tree.unflatten(out_tree, [_as_jax_arrays(x) for x in outs])

    scalified._jsa_scalified = True
    scalified._jsa_policy = policy
    return scalified


def _as_jax_arrays(x):
    """Scales folded at trace time are NumPy values; hand the user JAX arrays throughout."""
    if isinstance(x, ScaledArray):
        return ScaledArray(_as_jax_arrays(x.data), _as_jax_arrays(x.scale))
    return jnp.asarray(x) if isinstance(x, (np.ndarray, np.generic)) else x


def _is_dynamic(leaf) -> bool:
    """Arrays and numbers are traced; any other leaf (a dtype, a string ...) is static."""
    if isinstance(leaf, (ScaledArray, bool, int, float, complex)):
        return True
    return not isinstance(leaf, (type, np.dtype)) and hasattr(leaf, "dtype") and hasattr(leaf, "shape")


_TRACE_CACHE_SIZE = 32


def _cached_trace(cache, fun, in_tree, leaves, dynamic) -> tuple[ClosedJaxpr, Any]:
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
    traced = _trace_on_data(fun, in_tree, leaves, dynamic)
    if not any(isinstance(c, jax.core.Tracer) for c in traced[0].consts):
        cache[key] = traced
        if len(cache) > _TRACE_CACHE_SIZE:
            cache.popitem(last=False)
    return traced


def _leaf_signature(leaf, is_dynamic: bool):
    if not is_dynamic:
        return ("static", leaf)
    return jax.typeof(leaf.data if isinstance(leaf, ScaledArray) else leaf)


def _trace_on_data(fun, in_tree, leaves, dynamic) -> tuple[ClosedJaxpr, Any]:
    """Trace ``fun`` with every ``ScaledArray`` standing in as its data.

    ``dynamic`` indexes the leaves that become the jaxpr's arguments; the other (static)
    leaves are baked into the trace.
    """
    out_tree_box = []

    def flat_fun(*flat_dynamic):
        flat = list(leaves)
        for i, x in zip(dynamic, flat_dynamic):
            flat[i] = x
        args, kwargs = jax.tree.unflatten(in_tree, flat)
        _trace_state.depth += 1
        try:
            out = fun(*args, **kwargs)
        finally:
            _trace_state.depth -= 1
        out_flat, out_tree = jax.tree.flatten(out, is_leaf=is_scaled_leaf)
        out_tree_box.append(out_tree)
        return out_flat

    examples = [leaves[i].data if isinstance(leaves[i], ScaledArray) else leaves[i] for i in dynamic]
    closed_jaxpr = jax.make_jaxpr(flat_fun)(*examples)
    return closed_jaxpr, out_tree_box[0]


def eval_scaled_jaxpr(
    jaxpr: Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    arg_scalars: Sequence[np.ndarray | None] | None = None,
) -> list[Any]:
    """Evaluate ``jaxpr`` on ``args`` (``ScaledArray`` or plain) with the scale rules.

    This is the engine of :func:`scalify`; rules of call and control-flow primitives call
    it on their sub-jaxprs. ``arg_scalars`` gives, per argument, the known constant scalar
    it broadcasts (or None).
    """
    env: dict[Var, Any] = {}
    scalars: dict[Var, np.ndarray] = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    def read_scalar(v):
        if isinstance(v, Literal):
            return concrete_scalar(v.val)
        return scalars.get(v)

    def write(v, value, scalar=None):
        if type(v) is not Var:  # DropVar
            return
        env[v] = value
        if scalar is not None:
            scalars[v] = scalar

    for v, c in zip(jaxpr.constvars, consts):
        write(v, c, concrete_scalar(c))
    arg_scalars = arg_scalars or [None] * len(args)
    if len(args) != len(jaxpr.invars):
        raise ValueError(f"The jaxpr takes {len(jaxpr.invars)} arguments, {len(args)} were given.")
    for v, a, s in zip(jaxpr.invars, args, arg_scalars):
        write(v, a, s)
    gradients = _gradients_to_rescale(jaxpr)
    pending: list[Var] = []  # gradients defined, to rescale together before their first forward use

    def rescale_pending():
        for v, val in zip(pending, rescale_policy.rescale_all([env[v] for v in pending])):
            env[v] = val
        pending.clear()

    for eqn in jaxpr.eqns:
        uses_gradient = pending and any(isinstance(v, Var) and v in gradients for v in eqn.invars)
        if uses_gradient and not rescale_policy.is_backward_equation(eqn):
            rescale_pending()
        invals = [read(v) for v in eqn.invars]
        in_scalars = [read_scalar(v) for v in eqn.invars]
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
            outvals, out_scalars = _eval_equation(eqn, invals, in_scalars)
        for observer in _trace_state.observers:
            observer(eqn, invals, outvals)
        for v, val, s in zip(eqn.outvars, outvals, out_scalars):
            write(v, val, s)
            if v in gradients:
                pending.append(v)
    if pending:
        rescale_pending()
    return [read(v) for v in jaxpr.outvars]


def _gradients_to_rescale(jaxpr: Jaxpr) -> frozenset:
    """The variables of ``jaxpr`` the active policy rescales as gradients (none in a backward pass)."""
    if not rescale_policy.active_policy().gradients or rescale_policy.in_backward_pass():
        return frozenset()
    return rescale_policy.gradient_boundary(jaxpr)


def _eval_equation(eqn: JaxprEqn, invals: list, in_scalars: list) -> tuple[list, list]:
    prim = eqn.primitive
    registered = find_registered_scaled_op(prim)
    rule, scaled_type = registered if registered else (None, ScaledPrimitiveType.FORWARD)
    if scaled_type == ScaledPrimitiveType.NEVER:
        return _bind(eqn, [_unscale(x) for x in invals]), [None] * len(eqn.outvars)
    needs_rule = (
        scaled_type == ScaledPrimitiveType.ALWAYS_SCALE
        or any(isinstance(x, ScaledArray) for x in invals)
        or _holds_always_scale(eqn)
    )
    if not needs_rule:
        return _bind(eqn, invals), _propagate_scalars(eqn, in_scalars)
    if rule is None:
        raise _missing_rule_error(eqn, invals)
    if getattr(rule, "_jsa_unpromoted_inputs", False):
        inputs = list(invals)
    else:
        inputs = [_promote_if_floating(x, s) for x, s in zip(invals, in_scalars)]
    outs = rule(*inputs, **eqn.params)
    outs = list(outs) if prim.multiple_results else [outs]
    _check_rule_outputs(eqn, outs)
    return _keep_any_scale(prim, inputs, outs), [None] * len(outs)


def _keep_any_scale(prim, inputs: list, outs: list) -> list:
    """A scalar-preserving primitive maps a constant 0 or ±inf to a constant 0 or ±inf.

    Keeps e.g. ``broadcast_in_dim(convert_element_type(0.0))`` any-scale inside a jitted
    call that received the literal 0.0 as an argument (as ``jnp.where`` does).
    """
    floating = [x for x in inputs if isinstance(x, ScaledArray)]
    if floating and all(isinstance(x, AnyScaleArray) for x in floating) and scalar_preserving_fn(prim):
        return [AnyScaleArray(o.data, o.scale) if isinstance(o, ScaledArray) else o for o in outs]
    return outs


def _bind(eqn: JaxprEqn, invals: list) -> list:
    params = eqn.primitive.get_bind_params(eqn.params)  # a dict of bind params in JAX >= 0.10
    if len(invals) > 1:
        invals = match_varying_axes([v.aval for v in eqn.invars], invals)
    outs = eqn.primitive.bind(*invals, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _unscale(x):
    return x.to_array() if isinstance(x, ScaledArray) else x


def _promote_if_floating(x, scalar):
    if isinstance(x, ScaledArray) or not hasattr(x, "dtype") or not is_floating_dtype(x.dtype):
        return x
    return promote(x, scalar)


def concrete_scalar(value) -> np.ndarray | None:
    """The value as a 0-d NumPy array if it is a concrete (not traced) size-1 number."""
    if isinstance(value, (bool, int, float)):
        return np.asarray(value)
    if isinstance(value, jax.core.Tracer) or not hasattr(value, "dtype") or np.size(value) != 1:
        return None
    if jnp.issubdtype(value.dtype, jax.dtypes.extended):  # PRNG keys
        return None
    return np.asarray(value).reshape(())


def _propagate_scalars(eqn: JaxprEqn, in_scalars: list) -> list:
    """Outputs that broadcast a known scalar, for the primitives declared scalar-preserving."""
    fn = scalar_preserving_fn(eqn.primitive)
    if fn is None or eqn.primitive.multiple_results or len(in_scalars) != 1 or in_scalars[0] is None:
        return [None] * len(eqn.outvars)
    out = np.asarray(fn(in_scalars[0], **eqn.params))
    return [out.reshape(()) if out.size == 1 else None]


@functools.lru_cache(maxsize=4096)
def _jaxpr_holds_always_scale(jaxpr: Jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        registered = find_registered_scaled_op(eqn.primitive)
        if registered and registered[1] == ScaledPrimitiveType.ALWAYS_SCALE:
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
    where = source_info_util.summarize(eqn.source_info)
    inputs = ", ".join(_describe(x) for x in invals)
    return NotImplementedError(
        f"jax_scalify has no scale rule for the primitive '{name}'.\n"
        f"  inputs: {inputs}\n"
        f"  from:   {where}\n"
        "Register one with a decorator (the rule gets ScaledArray inputs and the equation's params):\n"
        f"    @jsa.core.register_scaled_op(<the '{name}' primitive>)\n"
        f"    def scaled_{name}(*inputs, **params): ...\n"
        "or compute this part outside scalify, or on plain values with jsa.lax.stop_scaling."
    )


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
        if tuple(got_shape) != tuple(aval.shape) or (got_dtype is not None and np.dtype(got_dtype) != np.dtype(aval.dtype)):
            raise RuntimeError(
                f"The scale rule of '{eqn.primitive.name}' returned {_describe(out)}, "
                f"expected {aval.dtype}{list(aval.shape)}. This is a bug in the rule."
            )
