"""The ``scalify`` transform: trace to a jaxpr, then evaluate it with the scale rules.

Evaluation is equation by equation (design section 4):

1. no input is scaled and the primitive is not ``ALWAYS_SCALE`` (nor holds one in a
   sub-jaxpr): the equation is bound as it is;
2. otherwise the registered rule is called, unscaled floating inputs promoted first
   (see :mod:`jax_scalify.core.promotion`);
3. no rule: ``NotImplementedError`` naming the primitive, inputs and user source line.

Nothing here knows about individual primitives: the rules, including those of call and
control-flow primitives, live in :mod:`jax_scalify.lax` and are looked up in the registry.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var, jaxprs_in_params

from .array import ScaledArray, is_floating_dtype, is_scaled_leaf
from .promotion import AnyScaleArray, promote
from .registry import ScaledPrimitiveType, find_registered_scaled_op, scalar_preserving_fn

jax.tree_util.register_pytree_node(
    AnyScaleArray,
    lambda x: ((x.data, x.scale), None),
    lambda _, children: AnyScaleArray.tree_unflatten(None, children),
)


class _TraceState(threading.local):
    def __init__(self):
        self.depth = 0


_trace_state = _TraceState()


def _is_tracing_user_code() -> bool:
    return _trace_state.depth > 0


def scalify(fun: Callable[..., Any]) -> Callable[..., Any]:
    """Transform ``fun`` to propagate power-of-two scales through every operation.

    The returned function takes the same arguments as ``fun``, where any floating array
    may be a :class:`ScaledArray`. ``fun`` is traced on the data of its inputs, then each
    primitive of the trace is evaluated with its scale rule, so scaled inputs give
    scaled outputs whose ``data`` stays close to unit size. Unscaled inputs are left
    unscaled until they meet a scaled value. In float32 the result equals ``fun`` on the
    values of the inputs up to round-off (model invariance).

    ``scalify`` takes keyword arguments and any pytree in and out, composes with
    ``jax.jit`` on either side, with ``jax.grad``, ``jax.vjp`` and ``jax.vmap`` inside,
    and with itself (it is idempotent).
    """
    if getattr(fun, "_jsa_scalified", False):
        return fun

    @functools.wraps(fun)
    def scalified(*args, **kwargs):
        leaves, in_tree = jax.tree.flatten((args, kwargs), is_leaf=is_scaled_leaf)
        if _is_tracing_user_code() and not any(isinstance(x, ScaledArray) for x in leaves):
            # Called while an outer scalify traces: the outer interpreter sees these equations.
            return fun(*args, **kwargs)
        closed_jaxpr, out_tree = _trace_on_data(fun, in_tree, leaves)
        outs = eval_scaled_jaxpr(closed_jaxpr.jaxpr, closed_jaxpr.consts, leaves)
        return jax.tree.unflatten(out_tree, [_as_jax_arrays(x) for x in outs])

    scalified._jsa_scalified = True
    return scalified


def _as_jax_arrays(x):
    """Scales folded at trace time are NumPy values; hand the user JAX arrays throughout."""
    if isinstance(x, ScaledArray):
        return ScaledArray(_as_jax_arrays(x.data), _as_jax_arrays(x.scale))
    return jnp.asarray(x) if isinstance(x, (np.ndarray, np.generic)) else x


def _trace_on_data(fun, in_tree, leaves) -> tuple[ClosedJaxpr, Any]:
    """Trace ``fun`` with every ``ScaledArray`` standing in as its data."""
    out_tree_box = []

    def flat_fun(*flat):
        args, kwargs = jax.tree.unflatten(in_tree, flat)
        _trace_state.depth += 1
        try:
            out = fun(*args, **kwargs)
        finally:
            _trace_state.depth -= 1
        out_flat, out_tree = jax.tree.flatten(out, is_leaf=is_scaled_leaf)
        out_tree_box.append(out_tree)
        return out_flat

    examples = [x.data if isinstance(x, ScaledArray) else x for x in leaves]
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
            return _concrete_scalar(v.val)
        return scalars.get(v)

    def write(v, value, scalar=None):
        if type(v) is not Var:  # DropVar
            return
        env[v] = value
        if scalar is not None:
            scalars[v] = scalar

    for v, c in zip(jaxpr.constvars, consts):
        write(v, c, _concrete_scalar(c))
    arg_scalars = arg_scalars or [None] * len(args)
    if len(args) != len(jaxpr.invars):
        raise ValueError(f"The jaxpr takes {len(jaxpr.invars)} arguments, {len(args)} were given.")
    for v, a, s in zip(jaxpr.invars, args, arg_scalars):
        write(v, a, s)

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        in_scalars = [read_scalar(v) for v in eqn.invars]
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
            outvals, out_scalars = _eval_equation(eqn, invals, in_scalars)
        for v, val, s in zip(eqn.outvars, outvals, out_scalars):
            write(v, val, s)
    return [read(v) for v in jaxpr.outvars]


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
    inputs = [_promote_if_floating(x, s) for x, s in zip(invals, in_scalars)]
    outs = rule(*inputs, **eqn.params)
    outs = list(outs) if prim.multiple_results else [outs]
    _check_rule_outputs(eqn, outs)
    return outs, [None] * len(outs)


def _bind(eqn: JaxprEqn, invals: list) -> list:
    subfuns, params = eqn.primitive.get_bind_params(eqn.params)
    outs = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _unscale(x):
    return x.to_array() if isinstance(x, ScaledArray) else x


def _promote_if_floating(x, scalar):
    if isinstance(x, ScaledArray) or not hasattr(x, "dtype") or not is_floating_dtype(x.dtype):
        return x
    return promote(x, scalar)


def _concrete_scalar(value) -> np.ndarray | None:
    """The value as a NumPy scalar if it is a concrete floating 0-d or size-1 array."""
    if isinstance(value, jax.core.Tracer) or not hasattr(value, "dtype") and not isinstance(value, float):
        return None
    if np.size(value) != 1 or not is_floating_dtype(np.asarray(value).dtype):
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
