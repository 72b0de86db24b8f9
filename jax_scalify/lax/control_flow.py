"""Rules of the control-flow primitives and of the primitives that run user code.

- ``scan``, ``while`` and ``cond`` (``lax.scan``, ``lax.fori_loop``, ``lax.while_loop``,
  ``lax.cond``, ``lax.switch``) are re-emitted with the public ``jax.lax`` functions over
  bodies and branches that run the scalify interpreter on the sub-jaxprs;
- ``checkpoint`` (``remat2``) is re-emitted as a checkpoint with the same policy,
  ``prevent_cse`` and ``differentiated`` flags;
- host callbacks (``pure_callback``, ``io_callback``, ``debug_callback``,
  ``debug_print``) receive plain values and return plain values;
- ``sharding_constraint`` constrains the data and replicates the scalar scale.

These rules take their inputs unpromoted (``register_scaled_op(..., unpromoted_inputs=True)``),
so unscaled values stay unscaled inside the sub-jaxprs until they meet a scaled one.

Structure of loop carries and branch outputs: a loop carry must have the same type on
entry and exit of the body, and every branch of a ``cond`` must return the same types.
Which carries (outputs) are ``ScaledArray`` is therefore found by iterating to a fixed
point: the body (branches) is traced assuming a set of scaled carries (outputs), starting
with those scaled on entry (none for ``cond``); if an output comes out scaled where it
was assumed plain, it joins the set and the trace is redone. The set only grows, so this
ends after at most one retry per carry. Plain values that must be scaled are promoted
with scale 1 (the value is unchanged), and carried scales are scalars of the configured
scale dtype: a carry's scale is an ordinary loop variable and may change from one
iteration to the next.

Under a rescale policy with ``loop_carries`` (the default of ``jsa.scalify``), the scaled
carries a ``scan`` or ``while`` body returns are rescaled dynamically at every iteration
(their RMS moved into the scale, see :mod:`jax_scalify.core.policy`): a body's static
estimate would otherwise compound once per iteration (a recurrent cell's carry scale
growing by a constant factor per step until the data underflow). This covers the
transposed scans of a backward pass too. The value of each carry is unchanged.

Known powers of two (:mod:`jax_scalify.core.known_pow2`) cross the loop boundary the same
way: a carry whose initial scale is known to be a power of two is assumed to stay one in the
body; if the body's output scale is not known to be one, the assumption is dropped for that
carry and the body traced again (the assumed set only shrinks). Scales of the loop's outputs
(carries, stacked per-iteration scales, branch outputs) are then marked as the body proved.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.extend.core import ClosedJaxpr, Jaxpr

from ..core.array import ScaledArray
from ..core.interpreter import concrete_scalar, eval_scaled_jaxpr
from ..core.known_pow2 import is_known_pow2, mark_pow2
from ..core.policy import rescale_loop_carries
from ..core.registry import ScaledPrimitiveType, lax_primitive, primitive_of, register_scaled_op
from .base_scaling import (
    align_to_largest,
    as_scale,
    rebalance_stacked,
    scale_dtype,
    unscaled,
    with_scalar_scale,
)

Array = Any

scan_p = lax_primitive("scan")
while_p = lax_primitive("while")
cond_p = lax_primitive("cond")
remat_p = lax_primitive("remat")
sharding_constraint_p = lax_primitive("sharding_constraint")

_f32 = jax.ShapeDtypeStruct((), np.float32)
pure_callback_p = primitive_of(lambda x: jax.pure_callback(lambda v: v, _f32, x), np.float32(0))
io_callback_p = primitive_of(lambda x: io_callback(lambda v: v, _f32, x), np.float32(0))
debug_callback_p = primitive_of(lambda x: jax.debug.callback(lambda v: None, x), np.float32(0))
debug_print_p = primitive_of(lambda x: jax.debug.print("{}", x), np.float32(0))


# --- carry structure: which values are scaled, and the fixed point over it ------------------
class _ScaledStructureGrew(Exception):
    """Raised while tracing a body or branch whose outputs are scaled where assumed plain."""

    def __init__(self, owner: object, scaled: tuple[bool, ...]):
        super().__init__("internal to jax_scalify: loop carry structure changed, retracing")
        self.owner = owner
        self.scaled = scaled


def _is_scaled(x: Any) -> bool:
    return isinstance(x, ScaledArray)


def _is_concrete(x: Any) -> bool:
    """A trace-time constant: NumPy, or a JAX array that is not a tracer."""
    return isinstance(x, (np.ndarray, np.generic)) or (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer))


def _as_carried(x: Any) -> ScaledArray:
    """``x`` as a ``ScaledArray`` with a scalar scale array of the configured dtype (plain: scale 1)."""
    if not _is_scaled(x):
        return ScaledArray(x, jnp.ones((), scale_dtype()))
    x = with_scalar_scale(x)
    return ScaledArray(x.data, jnp.asarray(as_scale(x.scale)))


def _flatten(values: Sequence[Any], scaled: Sequence[bool]) -> list:
    """Flat list of arrays: ``data, scale`` for the scaled positions, the value elsewhere."""
    flat = []
    for value, is_scaled in zip(values, scaled):
        if is_scaled:
            value = _as_carried(value)
            flat += [value.data, value.scale]
        else:
            flat.append(value)
    return flat


def _unflatten(flat: Sequence[Any], scaled: Sequence[bool]) -> list:
    it = iter(flat)
    return [ScaledArray(next(it), next(it)) if is_scaled else next(it) for is_scaled in scaled]


def _check_structure(owner: object, outs: Sequence[Any], scaled: tuple[bool, ...]) -> None:
    grown = tuple(s or _is_scaled(o) for s, o in zip(scaled, outs))
    if grown != scaled:
        raise _ScaledStructureGrew(owner, grown)


def _fixed_point(run: Callable[[tuple[bool, ...], object], Any], scaled: Sequence[bool]):
    """``run(scaled, owner)`` retried with a grown ``scaled`` until its trace succeeds.

    ``run`` may also retry with the same ``scaled`` after dropping a power-of-two assumption
    (:class:`_Pow2Assumption`); each set changes monotonically, so this ends.
    """
    owner = object()
    scaled = tuple(scaled)
    for _ in range(2 * len(scaled) + 1):
        try:
            return scaled, run(scaled, owner)
        except _ScaledStructureGrew as err:
            if err.owner is not owner:
                raise
            scaled = err.scaled
    raise AssertionError("unreachable: the scaled set grows at every retry")


class _Pow2Assumption:
    """Which loop carries are assumed to keep a power-of-two scale in the body (it only shrinks).

    Initially the carries whose entry scale is known to be a power of two, and the plain
    ones (if they become scaled they enter with scale 1).
    """

    def __init__(self, init: Sequence[Any]):
        self.flags = [not _is_scaled(c) or (np.ndim(c.scale) == 0 and is_known_pow2(as_scale(c.scale))) for c in init]

    def mark(self, carry: Sequence[Any]) -> None:
        """Mark the scales of the body's input carries (or of the loop's outputs) as assumed."""
        for c, flag in zip(carry, self.flags):
            if flag and _is_scaled(c):
                mark_pow2(c.scale)

    def check(self, owner: object, carry_out: Sequence[Any], scaled: tuple[bool, ...]) -> None:
        """Drop the assumption for output carries whose scale is not known a power of two, and retry."""
        kept = [f and (not s or (_is_scaled(o) and is_known_pow2(o.scale))) for f, s, o in zip(self.flags, scaled, carry_out)]
        if kept != self.flags:
            self.flags = kept
            raise _ScaledStructureGrew(owner, scaled)


def _known_scalars(args: Sequence[Any]) -> list:
    """Per argument, the constant scalar it holds if known at trace time (else None)."""
    return [None if _is_scaled(a) else concrete_scalar(a) for a in args]


def _eval_scaled(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list:
    """The interpreter on a sub-jaxpr; constant arguments keep their constant-scalar status."""
    return eval_scaled_jaxpr(jaxpr, consts, list(args), _known_scalars(args))


def _eval_closed(closed: ClosedJaxpr, args: Sequence[Any]) -> list:
    return _eval_scaled(closed.jaxpr, closed.consts, args)


# --- stacked outputs: per-iteration scales rebalanced to one scalar -------------------------
class _StackedScaledArray(ScaledArray):
    """Scan outputs with one scale per iteration: rebalanced to one scalar scale, per-slice form kept.

    To every rule it is the ``ScaledArray`` of :func:`rebalance_stacked` (``data``, scalar
    ``scale``); rules build plain ``ScaledArray`` outputs, so the extra form does not
    propagate. A later ``scan`` over it (the backward scan over the forward scan's
    residuals) scans ``slice_data`` and ``slice_scales`` instead, so each iteration sees
    the slice with the scale it was produced with, as an unrolled loop would. Under
    ``jax.jit`` whichever form is unused is removed as dead code.
    """

    __slots__ = ("slice_data", "slice_scales")

    def __init__(self, data, scale, slice_data, slice_scales):
        super().__init__(data, scale)
        self.slice_data = slice_data
        self.slice_scales = slice_scales

    def tree_flatten(self):
        return (self.data, self.scale, self.slice_data, self.slice_scales), None

    @classmethod
    def tree_unflatten(cls, aux_data, children):
        obj = object.__new__(cls)
        obj.data, obj.scale, obj.slice_data, obj.slice_scales = children
        return obj


jax.tree_util.register_pytree_node_class(_StackedScaledArray)

_PLAIN, _CONST_SCALE, _STACKED_SCALE = "plain", "const", "stacked"


def _split_ys(ys: Sequence[Any]) -> tuple[list, list]:
    """Flatten per-iteration outputs; a scaled one with a traced scale also emits its scale."""
    flat, kinds = [], []
    for y in ys:
        if not _is_scaled(y):
            flat.append(y)
            kinds.append((_PLAIN, None))
        elif _is_concrete(y.scale):
            flat.append(y.data)
            kinds.append((_CONST_SCALE, y.scale))
        else:
            y = _as_carried(y)
            flat += [y.data, y.scale]
            kinds.append((_STACKED_SCALE, None))
    return flat, kinds


def _merge_ys(flat: Sequence[Any], kinds: Sequence[tuple[str, Any]]) -> list:
    it = iter(flat)
    out = []
    for kind, scale in kinds:
        if kind == _PLAIN:
            out.append(next(it))
        elif kind == _CONST_SCALE:
            out.append(ScaledArray(next(it), scale))
        else:
            data, scales = next(it), next(it)
            merged = rebalance_stacked(data, scales)
            out.append(_StackedScaledArray(merged.data, merged.scale, data, scales))
    return out


# --- scan ------------------------------------------------------------------------------------
@register_scaled_op(scan_p, unpromoted_inputs=True)
def scaled_scan(
    *args: Any,
    jaxpr: ClosedJaxpr,
    num_consts: int,
    num_carry: int,
    length: int,
    reverse: bool,
    unroll: int | bool,
    **params: Any,
) -> list:
    """Body scalified; carries scaled if scaled on entry or in the body; ys rebalanced to their largest scale.

    Consts and scanned inputs (xs) keep their scaled or plain form; a scaled xs is scanned
    over its data with its (scalar) scale held constant. Carries: see the module docstring
    (rescaled at every iteration under a policy with ``loop_carries``).

    Scanned outputs (ys) of a scaled body have a scale per iteration. When that scale is a
    trace-time constant (loop invariant), the ys keep it. Otherwise the body emits its
    scale next to the data, so the scan stacks the scales, and after the scan the ys are
    rebalanced to the largest of them: each slice is multiplied by ``its scale / largest``
    (a power of two <= 1), exact except for slices more than the data dtype's range below
    the largest one. This keeps the body free of any cross-iteration dependency (no
    scale has to be known before the loop) and gives the result the scale that keeps its
    largest slice near unit size.

    Such rebalanced ys also keep their per-iteration form (:class:`_StackedScaledArray`):
    a later scan of the same length over them (the backward scan of ``grad`` over the
    forward scan's residuals) scans the original slices with their own scales, so each
    iteration sees what an unrolled loop would. Without this, a residual whose scale varies
    across iterations reached the backward body with its slices shrunk by up to the whole
    spread, and the cotangents inherited that spread as a scale offset that no rule
    removes (gradients of a 2-layer scanned transformer came out with scales 2**33 too large
    and data near float32's underflow).

    ``reverse``, ``length``, ``unroll`` and the other options of the scan are kept.
    """
    consts, init, xs = args[:num_consts], args[num_consts : num_consts + num_carry], args[num_consts + num_carry :]
    # Per xs: plain (data, None), scaled (data, scalar scale held constant), or stacked ys of
    # an earlier scan (slices and their scales, both scanned).
    per_slice = [isinstance(x, _StackedScaledArray) and np.shape(x.slice_scales) == (length,) for x in xs]
    xs = [x if p or not _is_scaled(x) else with_scalar_scale(x) for x, p in zip(xs, per_slice)]
    xs_data = [x.slice_data if p else x.data if _is_scaled(x) else x for x, p in zip(xs, per_slice)]
    xs_scales = [x.slice_scales if p else x.scale if _is_scaled(x) else None for x, p in zip(xs, per_slice)]
    scanned_scales = [s for s, p in zip(xs_scales, per_slice) if p]
    scanned_pow2 = [is_known_pow2(s) for s, p in zip(xs_scales, per_slice) if p]
    ys_kinds: list = []
    ys_pow2: list = []
    assumed = _Pow2Assumption(init)
    options = {k: v for k, v in params.items() if k == "_split_transpose"}

    def run(scaled: tuple[bool, ...], owner: object):
        def body(carry_flat, x_in):
            x_flat, scale_slices = x_in
            carry = _unflatten(carry_flat, scaled)
            assumed.mark(carry)
            for scale, known in zip(scale_slices, scanned_pow2):
                if known:
                    mark_pow2(scale)
            scale_slices = iter(scale_slices)
            scales = [next(scale_slices) if p else s for s, p in zip(xs_scales, per_slice)]
            x_vals = [x if s is None else ScaledArray(x, s) for x, s in zip(x_flat, scales)]
            outs = _eval_closed(jaxpr, [*consts, *carry, *x_vals])
            carry_out, ys = outs[:num_carry], outs[num_carry:]
            _check_structure(owner, carry_out, scaled)
            carry_out = rescale_loop_carries(carry_out)
            assumed.check(owner, carry_out, scaled)
            ys_flat, kinds = _split_ys(ys)
            ys_kinds[:] = kinds
            ys_pow2[:] = [_is_scaled(y) and is_known_pow2(y.scale) for y in ys]
            return _flatten(carry_out, scaled), ys_flat

        xs_in, init_flat = (xs_data, scanned_scales), _flatten(init, scaled)
        return jax.lax.scan(body, init_flat, xs_in, length=length, reverse=reverse, unroll=unroll, **options)

    scaled, (carry_flat, ys_flat) = _fixed_point(run, [_is_scaled(c) for c in init])
    carry = _unflatten(carry_flat, scaled)
    assumed.mark(carry)
    _mark_stacked_scales(ys_flat, ys_kinds, ys_pow2)
    return [*carry, *_merge_ys(ys_flat, ys_kinds)]


def _mark_stacked_scales(flat: Sequence[Any], kinds: Sequence[tuple[str, Any]], known: Sequence[bool]) -> None:
    """Mark the stacked per-iteration scales of the ys whose body scale was a known power of two."""
    position = 0
    for (kind, _), is_known in zip(kinds, known):
        if kind == _STACKED_SCALE and is_known:
            mark_pow2(flat[position + 1])
        position += 2 if kind == _STACKED_SCALE else 1


# --- while -----------------------------------------------------------------------------------
@register_scaled_op(while_p, unpromoted_inputs=True)
def scaled_while(
    *args: Any, cond_jaxpr: ClosedJaxpr, body_jaxpr: ClosedJaxpr, cond_nconsts: int, body_nconsts: int
) -> list:
    """Condition and body scalified; carries scaled if scaled on entry or in the body, scales traced.

    Under a policy with ``loop_carries`` the body's scaled carries are rescaled at every iteration.
    """
    cond_consts, body_consts = args[:cond_nconsts], args[cond_nconsts : cond_nconsts + body_nconsts]
    init = args[cond_nconsts + body_nconsts :]
    assumed = _Pow2Assumption(init)
    # A batched predicate (from vmap, e.g. inside jax.scipy.special.expi) holds one flag per
    # lane: the loop runs while any lane is active, and only active lanes take the body's value.
    batched = cond_jaxpr.out_avals[0].shape != ()

    def run(scaled: tuple[bool, ...], owner: object):
        def predicate(carry):
            (pred,) = _eval_closed(cond_jaxpr, [*cond_consts, *carry])
            return unscaled(pred)

        def cond_fun(carry_flat):
            carry = _unflatten(carry_flat, scaled)
            assumed.mark(carry)
            pred = predicate(carry)
            return jnp.any(pred) if batched else pred

        def body_fun(carry_flat):
            carry = _unflatten(carry_flat, scaled)
            assumed.mark(carry)
            outs = _eval_closed(body_jaxpr, [*body_consts, *carry])
            _check_structure(owner, outs, scaled)
            if batched:
                active = predicate(carry)
                outs = [_select_lanes(active, new, old) for new, old in zip(outs, carry)]
            outs = rescale_loop_carries(outs)
            assumed.check(owner, outs, scaled)
            return _flatten(outs, scaled)

        return jax.lax.while_loop(cond_fun, body_fun, _flatten(init, scaled))

    scaled, carry_flat = _fixed_point(run, [_is_scaled(c) for c in init])
    carry = _unflatten(carry_flat, scaled)
    assumed.mark(carry)
    return carry


def _select_lanes(active: Array, new: Any, old: Any) -> Any:
    """``new`` where ``active`` (over the leading dimensions) holds, else ``old``.

    Scaled values are aligned to the larger of their two scales first, as ``select_n`` does.
    """
    if _is_scaled(new) or _is_scaled(old):
        new, old = (x if _is_scaled(x) else ScaledArray(x, jnp.ones((), scale_dtype())) for x in (new, old))
        (new, old), scale = align_to_largest([new, old])
        return ScaledArray(_select_leading(active, new.data, old.data), scale)
    return _select_leading(active, new, old)


def _select_leading(active: Array, on_true: Array, on_false: Array) -> Array:
    mask = jax.lax.broadcast_in_dim(active, np.shape(on_true), tuple(range(np.ndim(active))))
    return jax.lax.select(mask, on_true, on_false)


# --- cond / switch ---------------------------------------------------------------------------
@register_scaled_op(cond_p, unpromoted_inputs=True)
def scaled_cond(index: Array, *operands: Any, branches: Sequence[ClosedJaxpr], **params: Any) -> list:
    """Branches scalified; an output scaled in one branch is scaled in all; the taken branch's scale."""
    num_outs = len(branches[0].out_avals)

    known = [True] * num_outs  # per output: a known power-of-two scale in every branch

    def run(scaled: tuple[bool, ...], owner: object):
        known[:] = [True] * num_outs

        def branch_fun(branch: ClosedJaxpr):
            # Operands are closed over (not passed) so that trace-time constants stay constants.
            def fun():
                outs = _eval_closed(branch, operands)
                _check_structure(owner, outs, scaled)
                known[:] = [k and (not _is_scaled(o) or is_known_pow2(o.scale)) for k, o in zip(known, outs)]
                return _flatten(outs, scaled)

            return fun

        return jax.lax.switch(unscaled(index), [branch_fun(b) for b in branches])

    scaled, outs_flat = _fixed_point(run, [False] * num_outs)
    outs = _unflatten(outs_flat, scaled)
    for out, is_known in zip(outs, known):
        if is_known and _is_scaled(out):
            mark_pow2(out.scale)
    return outs


# --- checkpoint / remat ----------------------------------------------------------------------
@register_scaled_op(remat_p, unpromoted_inputs=True)
def scaled_checkpoint(*args: Any, jaxpr: Jaxpr, prevent_cse: bool | tuple, differentiated: bool, policy: Any) -> list:
    """Body scalified inside a checkpoint with the same policy, prevent_cse and differentiated flags."""
    leaves, treedef = jax.tree.flatten(list(args))
    arg_of_leaf = [i for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
    # NumPy and Python leaves (literals, scales folded at trace time) stay constants of the body.
    constant_types = (np.ndarray, np.generic, bool, int, float)
    traced = [i for i, leaf in enumerate(leaves) if not isinstance(leaf, constant_types)]
    out_tree_box = []

    def flat_body(*traced_leaves):
        full = list(leaves)
        for i, leaf in zip(traced, traced_leaves):
            full[i] = leaf
        outs = _eval_scaled(jaxpr, [], jax.tree.unflatten(treedef, full))
        outs_flat, out_tree = jax.tree.flatten(outs)
        out_tree_box.append(out_tree)
        return outs_flat

    traced_leaves = [leaves[i] for i in traced]
    closed = jax.make_jaxpr(flat_body)(*traced_leaves)
    body = closed.jaxpr
    # remat2 takes a jaxpr without constvars: its constants become leading arguments.
    open_body = body.replace(constvars=[], invars=[*body.constvars, *body.invars])
    if isinstance(prevent_cse, tuple):
        prevent_cse = (False,) * len(closed.consts) + tuple(prevent_cse[arg_of_leaf[i]] for i in traced)
    outs = remat_p.bind(
        *closed.consts,
        *traced_leaves,
        jaxpr=open_body,
        prevent_cse=prevent_cse,
        differentiated=differentiated,
        policy=policy,
    )
    return jax.tree.unflatten(out_tree_box[-1], outs)


# --- host callbacks --------------------------------------------------------------------------
def _bind_on_values(prim, args: Sequence[Any], params: dict) -> Any:
    return prim.bind(*(unscaled(a) for a in args), **params)


@register_scaled_op(pure_callback_p, scaled_type=ScaledPrimitiveType.NEVER)
def scaled_pure_callback(*args: Any, **params: Any) -> Any:
    """Plain in and out: the callback receives the values ``data * scale``."""
    return _bind_on_values(pure_callback_p, args, params)


@register_scaled_op(io_callback_p, scaled_type=ScaledPrimitiveType.NEVER)
def scaled_io_callback(*args: Any, **params: Any) -> Any:
    """Plain in and out: the callback receives the values ``data * scale``."""
    return _bind_on_values(io_callback_p, args, params)


@register_scaled_op(debug_callback_p, scaled_type=ScaledPrimitiveType.NEVER)
def scaled_debug_callback(*args: Any, **params: Any) -> Any:
    """Plain in: the callback receives the values ``data * scale`` (``jsa.ops.debug_callback`` shows the scales)."""
    return _bind_on_values(debug_callback_p, args, params)


@register_scaled_op(debug_print_p, scaled_type=ScaledPrimitiveType.NEVER)
def scaled_debug_print(*args: Any, **params: Any) -> Any:
    """Plain in: prints the values ``data * scale`` (``jsa.ops.debug_print`` shows the scales)."""
    return _bind_on_values(debug_print_p, args, params)


# --- sharding_constraint ---------------------------------------------------------------------
@register_scaled_op(sharding_constraint_p)
def scaled_sharding_constraint(x: ScaledArray, *, sharding: Any, **params: Any) -> ScaledArray:
    """Scale unchanged: the constraint applies to the data, a traced scalar scale is replicated."""
    data = sharding_constraint_p.bind(x.data, sharding=sharding, **params)
    scale = x.scale
    if isinstance(sharding, jax.sharding.NamedSharding) and not _is_concrete(scale) and np.ndim(scale) == 0:
        scale = jax.lax.with_sharding_constraint(
            scale, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
        )
    return ScaledArray(data, scale)


__all__ = [
    "scaled_checkpoint",
    "scaled_cond",
    "scaled_debug_callback",
    "scaled_debug_print",
    "scaled_io_callback",
    "scaled_pure_callback",
    "scaled_scan",
    "scaled_sharding_constraint",
    "scaled_while",
]
