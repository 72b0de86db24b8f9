"""Rules of the control-flow primitives: ``scan``, ``while``, ``cond`` and ``checkpoint``.

- ``scan``, ``while`` and ``cond`` (``lax.scan``, ``lax.fori_loop``, ``lax.while_loop``,
  ``lax.cond``, ``lax.switch``) are re-emitted with the public ``jax.lax`` functions over
  bodies and branches that run the scalify interpreter on the sub-jaxprs;
- ``checkpoint`` (``remat2``) is re-emitted as a checkpoint with the same policy,
  ``prevent_cse`` and ``differentiated`` flags.

These rules take their inputs unpromoted (``register_scaled_op(..., unpromoted_inputs=True)``),
so unscaled values stay unscaled inside the sub-jaxprs until they meet a scaled one.

Structure of loop carries and branch outputs: which carries (outputs) are ``ScaledArray``
is found by :func:`~jax_scalify.lax.subjaxpr.fixed_point`, starting with the carries scaled
on entry (none for ``cond``). Plain values that must be scaled are promoted with scale 1
(the value is unchanged), and carried scales are scalars of the configured scale dtype: a
carry's scale is an ordinary loop variable and may change from one iteration to the next.
Carries enter each iteration as plain ``ScaledArray``s (no
:class:`~jax_scalify.core.array.ScaleFacts`): a constant 0 on entry need not be one after an
iteration. The final carries of a ``scan`` of at least one iteration keep the marks of a
chosen scale (``rescaled``, ``pinned``) the body gave them: they are the last iteration's
values, so the outputs policy does not measure them again. Every scale is a power of two by
contract (:func:`~jax_scalify.core.pow2.scales_are_pow2`), inside the body as outside, so
nothing about scales needs to be carried across the loop boundary.

Under a rescale policy with ``loop_carries`` (the default of ``jsa.scalify``), the scaled
carries a ``scan`` or ``while`` body returns are rescaled dynamically at every iteration
(their RMS moved into the scale, see :mod:`jax_scalify.core.sites`): a body's static
estimate would otherwise compound once per iteration (a recurrent cell's carry scale
growing by a constant factor per step until the data underflow). This covers the
transposed scans of a backward pass too. The value of each carry is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr

from ..core.array import ScaledArray, is_concrete, unscaled
from ..core.interpreter import eval_closed_jaxpr
from ..core.registry import lax_primitive, register_scaled_op
from ..core.scaling import (
    align_to_largest,
    as_scale,
    rebalance_stacked,
    scale_dtype,
    with_scalar_scale,
)
from ..core.sites import rescale_loop_carries
from .subjaxpr import check_structure, eval_sub_jaxpr, fixed_point
from .subjaxpr import is_scaled as _is_scaled

Array = Any

scan_p = lax_primitive("scan")
while_p = lax_primitive("while")
cond_p = lax_primitive("cond")
remat_p = lax_primitive("remat")


def _as_carried(x: Any) -> ScaledArray:
    """``x`` as a ``ScaledArray`` with a scalar scale array of the configured dtype.

    A plain carry takes scale 1, and an any-scale one (a constant 0 or inf) keeps its scale,
    except where the value is all zero: then the scale is 0, an asserted zero, so that the
    first sum in the loop takes the other operand's scale (an accumulator started at
    ``jnp.zeros`` must not hold its scale at 1, where small terms flush to zero).
    """
    if not _is_scaled(x):
        return ScaledArray(x, _zero_if_all_zero(x, jnp.ones((), scale_dtype())))
    x = with_scalar_scale(x)
    scale = jnp.asarray(as_scale(x.scale))
    return ScaledArray(x.data, _zero_if_all_zero(x.data, scale) if x.any_scale else scale)


def _zero_if_all_zero(data: Any, scale: Any) -> Any:
    return jnp.where(jnp.any(data != 0), scale, jnp.zeros_like(scale))


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


# --- stacked outputs: per-iteration scales rebalanced to one scalar -------------------------
_PLAIN, _CONST_SCALE, _STACKED_SCALE = "plain", "const", "stacked"


def _split_ys(ys: Sequence[Any]) -> tuple[list, list]:
    """Flatten per-iteration outputs; a scaled one with a traced scale also emits its scale."""
    flat, kinds = [], []
    for y in ys:
        if not _is_scaled(y):
            flat.append(y)
            kinds.append((_PLAIN, None))
        elif is_concrete(y.scale):
            flat.append(y.data)
            kinds.append((_CONST_SCALE, (y.scale, y.any_scale)))
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
            scale, any_scale = scale
            out.append(ScaledArray.unchecked(next(it), scale, any_scale=any_scale))
        else:
            data, scales = next(it), next(it)
            merged = rebalance_stacked(data, scales)
            out.append(ScaledArray.unchecked(merged.data, merged.scale, slices=(data, scales)))
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

    Such rebalanced ys also keep their per-iteration form (``slices``, see
    :class:`~jax_scalify.core.array.ScaleFacts`): rules build plain ``ScaledArray`` outputs,
    so the extra form does not propagate, and under ``jax.jit`` whichever form is unused is
    removed as dead code. A later scan of the same length over them (the backward scan of
    ``grad`` over the forward scan's residuals) scans the original slices with their own
    scales, so each iteration sees what an unrolled loop would: from the rebalanced stack, a
    residual whose scale varies across iterations would reach the backward body with its
    slices shrunk by up to the whole spread, and the cotangents would inherit that spread as
    a scale offset that no rule removes.

    ``reverse``, ``length``, ``unroll`` and the other options of the scan are kept.
    """
    consts, init, xs = args[:num_consts], args[num_consts : num_consts + num_carry], args[num_consts + num_carry :]
    # Per xs: plain (data, None), scaled (data, scalar scale held constant), or stacked ys of
    # an earlier scan (slices and their scales, both scanned).
    per_slice = [_is_scaled(x) and x.slices is not None and np.shape(x.slices[1]) == (length,) for x in xs]
    xs = [x if p or not _is_scaled(x) else with_scalar_scale(x) for x, p in zip(xs, per_slice)]
    xs_data = [x.slices[0] if p else x.data if _is_scaled(x) else x for x, p in zip(xs, per_slice)]
    xs_scales = [x.slices[1] if p else x.scale if _is_scaled(x) else None for x, p in zip(xs, per_slice)]
    xs_any_scale = [_is_scaled(x) and x.any_scale for x in xs]
    scanned_scales = [s for s, p in zip(xs_scales, per_slice) if p]
    ys_kinds: list = []
    options = {k: v for k, v in params.items() if k == "_split_transpose"}

    def run(scaled: tuple[bool, ...], owner: object):
        def body(carry_flat, x_in):
            x_flat, scale_slices = x_in
            carry = _unflatten(carry_flat, scaled)
            scale_slices = iter(scale_slices)
            scales = [next(scale_slices) if p else s for s, p in zip(xs_scales, per_slice)]
            x_vals = [
                x if s is None else ScaledArray.unchecked(x, s, any_scale=any_scale)
                for x, s, any_scale in zip(x_flat, scales, xs_any_scale)
            ]
            outs = eval_closed_jaxpr(jaxpr, [*consts, *carry, *x_vals])
            carry_out, ys = outs[:num_carry], outs[num_carry:]
            check_structure(owner, carry_out, scaled)
            carry_out = rescale_loop_carries(carry_out)
            carry_marks[:] = [_marks_of(c) for c in carry_out]
            ys_flat, kinds = _split_ys(ys)
            ys_kinds[:] = kinds
            return _flatten(carry_out, scaled), ys_flat

        xs_in, init_flat = (xs_data, scanned_scales), _flatten(init, scaled)
        return jax.lax.scan(body, init_flat, xs_in, length=length, reverse=reverse, unroll=unroll, **options)

    carry_marks: list = []
    scaled, (carry_flat, ys_flat) = fixed_point(run, [_is_scaled(c) for c in init])
    carries = _unflatten(carry_flat, scaled)
    if length > 0:  # the final carries are the last iteration's: what the body knew of them holds
        carries = [c.marked(**marks) if marks else c for c, marks in zip(carries, carry_marks)]
    return [*carries, *_merge_ys(ys_flat, ys_kinds)]


def _marks_of(x: Any) -> dict | None:
    """The marks of a chosen scale (rescaled, pinned) a body gave a carry, or None."""
    if _is_scaled(x) and (x.rescaled or x.pinned):
        return {"rescaled": x.rescaled, "pinned": x.pinned}
    return None


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
    # A batched predicate (from vmap, e.g. inside jax.scipy.special.expi) holds one flag per
    # lane: the loop runs while any lane is active, and only active lanes take the body's value.
    batched = cond_jaxpr.out_avals[0].shape != ()

    def run(scaled: tuple[bool, ...], owner: object):
        def predicate(carry):
            (pred,) = eval_closed_jaxpr(cond_jaxpr, [*cond_consts, *carry])
            return unscaled(pred)

        def cond_fun(carry_flat):
            carry = _unflatten(carry_flat, scaled)
            pred = predicate(carry)
            return jnp.any(pred) if batched else pred

        def body_fun(carry_flat):
            carry = _unflatten(carry_flat, scaled)
            outs = eval_closed_jaxpr(body_jaxpr, [*body_consts, *carry])
            check_structure(owner, outs, scaled)
            if batched:
                active = predicate(carry)
                outs = [_select_lanes(active, new, old) for new, old in zip(outs, carry)]
            outs = rescale_loop_carries(outs)
            return _flatten(outs, scaled)

        return jax.lax.while_loop(cond_fun, body_fun, _flatten(init, scaled))

    scaled, carry_flat = fixed_point(run, [_is_scaled(c) for c in init])
    return _unflatten(carry_flat, scaled)


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

    def run(scaled: tuple[bool, ...], owner: object):
        def branch_fun(branch: ClosedJaxpr):
            # Operands are closed over (not passed) so that trace-time constants stay constants.
            def fun():
                outs = eval_closed_jaxpr(branch, operands)
                check_structure(owner, outs, scaled)
                return _flatten(outs, scaled)

            return fun

        return jax.lax.switch(unscaled(index), [branch_fun(b) for b in branches])

    scaled, outs_flat = fixed_point(run, [False] * num_outs)
    return _unflatten(outs_flat, scaled)


# --- checkpoint / remat ----------------------------------------------------------------------
@register_scaled_op(remat_p, unpromoted_inputs=True)
def scaled_checkpoint(*args: Any, jaxpr: Jaxpr, prevent_cse: bool | tuple, differentiated: bool, policy: Any) -> list:
    """Body scalified inside a checkpoint with the same policy, prevent_cse and differentiated flags."""
    leaves, treedef = jax.tree.flatten(list(args))
    arg_of_leaf = [i for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
    # NumPy and Python leaves (literals, folded constants and scales) stay constants of the body.
    constant_types = (np.ndarray, np.generic, bool, int, float)
    traced = [i for i, leaf in enumerate(leaves) if not isinstance(leaf, constant_types)]
    out_tree_box = []

    def flat_body(*traced_leaves):
        full = list(leaves)
        for i, leaf in zip(traced, traced_leaves):
            full[i] = leaf
        outs = eval_sub_jaxpr(jaxpr, [], jax.tree.unflatten(treedef, full))
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


__all__ = ["scaled_checkpoint", "scaled_cond", "scaled_scan", "scaled_while"]
