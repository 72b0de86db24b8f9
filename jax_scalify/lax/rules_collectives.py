"""Scale rules of ``shard_map`` and of the SPMD collectives used inside it.

Inside a ``shard_map`` body every device holds its own block of the data *and its own scale*:
scales enter replicated, but a rule that reads local statistics (``dynamic_rescale``) can
make them differ from device to device. A collective that combines blocks of several devices
must therefore first bring them to one scale (design section 4):

- ``psum`` (and ``psum_invariant``, its form under ``check_vma``), ``psum_scatter``
  (``reduce_scatter``): the scale ``s = pmax(s_i)`` over the reduced axes, local data
  rescaled by ``s_i / s`` (a power of two at most 1), then summed; a sum of ``K`` blocks
  (``K`` the number of devices reduced over) is unit-scaled like ``reduce_sum``:
  scale ``s * r``, data ``/ r``, ``r = pow2(sqrt(K))``;
- ``pmax``, ``pmin``, ``all_gather``, ``all_to_all``: blocks aligned to ``pmax(s_i)`` the
  same way, the collective applied to the data, scale ``pmax(s_i)``;
- ``ppermute``: data and scale travel together (the scale is permuted too);
- ``pvary`` (``jax.lax.pcast(..., to='varying')``): data only, the scale stays as it is.

The alignment costs one scalar ``pmax`` per collective, and is skipped when the scale is
known to be the same on every device of the reduced axes: a trace-time constant, or, under
``check_vma=True``, a scale whose type is not varying along those axes (while the data's is).

``shard_map`` itself is re-emitted with :func:`jax.shard_map` (same mesh, specs, manual axes
and ``check_vma``) over a body that runs the scalify interpreter on its sub-jaxpr. A scaled
input passes its data with its own spec and its (scalar) scale replicated (``P()``); a scaled
output returns its data with its own spec and a replicated scale, after aligning the blocks
to the ``pmax`` of their scales over the manual axes where the scale may vary.

Private JAX names: none. The primitives that ``jax.extend`` does not export (``shard_map``,
``pvary``, ``psum_invariant``, ``reduce_scatter``) are found by tracing tiny
``shard_map`` programs on an abstract mesh (no device is touched at import).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Primitive
from jax.extend.core import primitives as P
from jax.sharding import AbstractMesh, AxisType, PartitionSpec

from ..core.array import ScaledArray, is_floating_dtype
from ..core.registry import register_scaled_op
from ..core.scaling import as_scale, is_numpy, mul_data, scale_div, unit_scaled_sum, zero_to_one
from ..core.vma import varying_axes
from .subjaxpr import check_structure, eval_sub_jaxpr, fixed_point

Array = Any


# --- primitives -------------------------------------------------------------------------------
_AXIS = "_jsa_axis"
_MESH = AbstractMesh((2,), (_AXIS,), axis_types=(AxisType.Explicit,))


def _traced_primitives(fn: Callable[[Array], Array], out_spec: PartitionSpec) -> tuple[Primitive, list[Primitive]]:
    """The ``shard_map`` primitive and the primitives of ``fn``'s body, traced on an abstract mesh."""
    mapped = jax.shard_map(fn, mesh=_MESH, in_specs=PartitionSpec(), out_specs=out_spec, check_vma=True)
    jaxpr = jax.make_jaxpr(mapped)(np.zeros((4,), np.float32))
    (eqn,) = [e for e in jaxpr.eqns if "jaxpr" in e.params]
    body = eqn.params["jaxpr"]
    return eqn.primitive, [e.primitive for e in getattr(body, "jaxpr", body).eqns]


def _varying(x: Array) -> Array:
    return jax.lax.pcast(x, _AXIS, to="varying")


shard_map_p, (pvary_p, psum_invariant_p) = _traced_primitives(
    lambda x: jax.lax.psum(_varying(x), _AXIS), PartitionSpec()
)
_, (_, reduce_scatter_p) = _traced_primitives(
    lambda x: jax.lax.psum_scatter(_varying(x), _AXIS, tiled=True), PartitionSpec(_AXIS)
)
psum_p, pmax_p, pmin_p = P.psum_p, P.pmax_p, P.pmin_p


def _traced_reshard_primitive() -> Primitive:
    """The primitive of ``jax.sharding.reshard``, traced on the abstract mesh (no device touched)."""
    sharded = jax.ShapeDtypeStruct((4,), np.float32, sharding=jax.sharding.NamedSharding(_MESH, PartitionSpec(_AXIS)))
    with jax.sharding.use_abstract_mesh(_MESH):
        jaxpr = jax.make_jaxpr(lambda x: jax.sharding.reshard(x, PartitionSpec()))(sharded)
    return jaxpr.eqns[0].primitive


reshard_p = _traced_reshard_primitive()
all_gather_p, all_to_all_p, ppermute_p = P.all_gather_p, P.all_to_all_p, P.ppermute_p


# --- helpers ----------------------------------------------------------------------------------
def _axis_names(axes: Any) -> tuple:
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def _named_axes(axes: Any) -> tuple:
    """The mesh or ``vmap`` axis names of ``axes``; integers are positional axes of the data.

    ``jax.vmap(..., axis_name=...)`` turns a collective over its own axis into the same
    primitive over a positional axis of the batched data (``psum[axes=(0,)]``): a reduction
    of the data, under the one scale it already has.
    """
    return tuple(a for a in _axis_names(axes) if not isinstance(a, int))


def _positional_size(x: ScaledArray, axes: Any) -> int:
    return int(np.prod([x.shape[a] for a in _axis_names(axes) if isinstance(a, int)], dtype=np.int64))


def _scale_may_vary(x: ScaledArray, axes: Sequence) -> bool:
    """Whether ``x``'s scale may differ between the devices of ``axes``.

    A constant scale never does. Otherwise the types tell, but only when varying values are
    tracked (``check_vma=True``): the data of a collective varies along its axes, so data
    typed invariant means "not tracked" and the scale is assumed to possibly vary.
    """
    scale_axes, data_axes = varying_axes(x.scale), varying_axes(x.data)
    if scale_axes is None or data_axes is None:
        return not is_numpy(x.scale)
    if not data_axes:
        return not is_numpy(x.scale)
    return bool(scale_axes & set(axes))


def _common_scale(x: ScaledArray, axes: Sequence, groups: Any) -> tuple[Array, Array]:
    """``(data, scale)`` with the scale made equal on the devices of ``axes``: ``pmax`` of the scales.

    Each block's data is multiplied by ``s_i / pmax(s)``, a power of two at most 1 (exact
    unless the block is more than the data dtype's range below the largest one). A zero
    ``pmax`` (every block asserted zero) becomes 1.
    """
    scale = as_scale(x.scale)
    named = _named_axes(axes)
    if not named or not _scale_may_vary(x, named):
        return x.data, scale
    common = jax.lax.pmax(scale, named, axis_index_groups=groups)
    common = zero_to_one(common)  # all asserted zero
    return mul_data(x.data, scale / common), common


def _group_size(x: ScaledArray, axes: Sequence, groups: Any) -> int:
    """Number of blocks summed: the group size or the product of the named axis sizes, times positional ones."""
    devices = len(groups[0]) if groups else np.prod([jax.lax.axis_size(a) for a in _named_axes(axes)], dtype=np.int64)
    return int(devices) * _positional_size(x, axes)


def _plain_or(prim: Primitive, x: Any, params: dict) -> Any:
    return None if isinstance(x, ScaledArray) else prim.bind(x, **params)


# --- sums -------------------------------------------------------------------------------------
def _scaled_sum_collective(prim: Primitive, x: Any, axes: Sequence, groups: Any, params: dict) -> Any:
    plain = _plain_or(prim, x, params)
    if plain is not None:
        return plain
    data, scale = _common_scale(x, axes, groups)
    size = _group_size(x, axes, groups)
    return unit_scaled_sum(scale, size, lambda d: prim.bind(d, **params), data, communicates=True)


@register_scaled_op(psum_p)
def scaled_psum(x: Any, *, axes, axis_index_groups=None, **params) -> Any:
    """Blocks aligned to pmax(s_i); s = pmax(s_i) * r, data = psum(data) / r, r = pow2(sqrt(K)), K = blocks summed.

    K counts the devices of the named axes times the sizes of positional axes (what
    ``jax.vmap(..., axis_name=...)`` turns its own axis name into).
    """
    params = dict(axes=axes, axis_index_groups=axis_index_groups, **params)
    return _scaled_sum_collective(psum_p, x, axes, axis_index_groups, params)


@register_scaled_op(psum_invariant_p)
def scaled_psum_invariant(x: Any, *, axes, **params) -> Any:
    """As psum (its check_vma form): blocks aligned to pmax(s_i), scale * r, data / r, r = pow2(sqrt(K))."""
    return _scaled_sum_collective(psum_invariant_p, x, axes, None, dict(axes=axes, **params))


@register_scaled_op(reduce_scatter_p)
def scaled_reduce_scatter(x: Any, *, axis_name, axis_index_groups=None, **params) -> Any:
    """psum_scatter: blocks aligned to pmax(s_i), scale pmax(s_i) * r, data / r, r = pow2(sqrt(K)), K = devices summed."""
    params = dict(axis_name=axis_name, axis_index_groups=axis_index_groups, **params)
    return _scaled_sum_collective(reduce_scatter_p, x, axis_name, axis_index_groups, params)


# --- aligned collectives ----------------------------------------------------------------------
def _scaled_aligned_collective(prim: Primitive, x: Any, axes: Sequence, groups: Any, params: dict) -> Any:
    plain = _plain_or(prim, x, params)
    if plain is not None:
        return plain
    data, scale = _common_scale(x, axes, groups)
    return ScaledArray(prim.bind(data, **params), scale)


@register_scaled_op(pmax_p)
def scaled_pmax(x: Any, *, axes, axis_index_groups=None, **params) -> Any:
    """Blocks aligned to s = pmax(s_i), pmax of the data (max commutes with a positive scale), scale s."""
    params = dict(axes=axes, axis_index_groups=axis_index_groups, **params)
    return _scaled_aligned_collective(pmax_p, x, axes, axis_index_groups, params)


@register_scaled_op(pmin_p)
def scaled_pmin(x: Any, *, axes, axis_index_groups=None, **params) -> Any:
    """Blocks aligned to s = pmax(s_i), pmin of the data (min commutes with a positive scale), scale s."""
    params = dict(axes=axes, axis_index_groups=axis_index_groups, **params)
    return _scaled_aligned_collective(pmin_p, x, axes, axis_index_groups, params)


@register_scaled_op(all_gather_p)
def scaled_all_gather(x: Any, *, axis_name, axis_index_groups=None, **params) -> Any:
    """Blocks aligned to s = pmax(s_i), then gathered; scale s."""
    params = dict(axis_name=axis_name, axis_index_groups=axis_index_groups, **params)
    return _scaled_aligned_collective(all_gather_p, x, axis_name, axis_index_groups, params)


@register_scaled_op(all_to_all_p)
def scaled_all_to_all(x: Any, *, axis_name, axis_index_groups=None, **params) -> Any:
    """Blocks aligned to s = pmax(s_i), then exchanged; scale s."""
    params = dict(axis_name=axis_name, axis_index_groups=axis_index_groups, **params)
    return _scaled_aligned_collective(all_to_all_p, x, axis_name, axis_index_groups, params)


# --- data and scale moved together ------------------------------------------------------------
def _scaled_move(prim: Primitive, x: Any, axes: Sequence, params: dict) -> Any:
    plain = _plain_or(prim, x, params)
    if plain is not None:
        return plain
    scale = as_scale(x.scale)
    if _scale_may_vary(x, axes):
        scale = prim.bind(scale, **params)
    return ScaledArray(prim.bind(x.data, **params), scale)


@register_scaled_op(ppermute_p)
def scaled_ppermute(x: Any, *, axis_name, perm, **params) -> Any:
    """Data and scale permuted together (a scale equal on all devices is kept as it is)."""
    return _scaled_move(ppermute_p, x, _axis_names(axis_name), dict(axis_name=axis_name, perm=perm, **params))


@register_scaled_op(pvary_p)
def scaled_pvary(x: Any, **params) -> Any:
    """Data marked varying, scale unchanged (an invariant scale may scale varying data)."""
    if not isinstance(x, ScaledArray):
        return pvary_p.bind(x, **params)
    return ScaledArray(pvary_p.bind(x.data, **params), x.scale)


# --- explicit sharding (sharding in types) ------------------------------------------------------
@register_scaled_op(reshard_p)
def scaled_reshard(x: Any, **params) -> Any:
    """Data resharded to the destination; scale unchanged (a scalar is replicated on every mesh).

    ``jax.sharding.reshard`` (and ``auto_axes``/``explicit_axes``, which emit it) changes only
    where the blocks of an array live, never its values, so the scale carries over as it is.
    """
    if not isinstance(x, ScaledArray):
        return reshard_p.bind(x, **params)
    return ScaledArray(reshard_p.bind(x.data, **params), x.scale)


# --- shard_map --------------------------------------------------------------------------------
def _sync_output(x: ScaledArray, manual_axes: frozenset, check_vma: bool) -> tuple[Array, Array]:
    """``(data, scale)`` of a body output with its scale equal on every device (``out_specs`` ``P()``)."""
    scale = as_scale(x.scale)
    if is_numpy(scale):
        return x.data, jax.numpy.asarray(scale)
    axes = manual_axes
    if check_vma:
        varying = varying_axes(scale)
        axes = manual_axes if varying is None else varying & manual_axes
    if not axes:
        return x.data, scale
    common = jax.lax.pmax(scale, tuple(sorted(axes, key=str)))
    common = zero_to_one(common)  # all asserted zero
    return mul_data(x.data, scale_div(scale, common)), common


@register_scaled_op(shard_map_p, unpromoted_inputs=True)
def scaled_shard_map(*args: Any, jaxpr, mesh, in_specs, out_specs, check_vma: bool, newly_manual_axes, **params):
    """Body scalified and re-emitted with jax.shard_map: data with its spec, scalar scales replicated (P()).

    Output scales are made equal across the manual axes (blocks aligned to their pmax) where
    they may differ between devices. Mesh, specs, manual axes and check_vma are kept.
    """
    body_jaxpr, consts = (jaxpr.jaxpr, jaxpr.consts) if isinstance(jaxpr, ClosedJaxpr) else (jaxpr, ())
    manual_axes = frozenset(newly_manual_axes)
    const_scales = [isinstance(a, ScaledArray) and is_numpy(a.scale) for a in args]
    flat_args, flat_in_specs = [], []
    for arg, spec, const in zip(args, in_specs, const_scales):
        if isinstance(arg, ScaledArray) and not const:
            flat_args += [arg.data, as_scale(arg.scale)]
            flat_in_specs += [spec, PartitionSpec()]
        else:
            flat_args.append(arg.data if isinstance(arg, ScaledArray) else arg)
            flat_in_specs.append(spec)
    out_floating = [is_floating_dtype(v.aval.dtype) for v in body_jaxpr.outvars]
    any_scaled = any(isinstance(a, ScaledArray) for a in args)

    def run(scaled: tuple[bool, ...], owner: object):
        def body(*flat):
            it = iter(flat)
            inputs = []
            for arg, const in zip(args, const_scales):
                if isinstance(arg, ScaledArray):
                    data = next(it)
                    scale = arg.scale if const else next(it)
                    inputs.append(ScaledArray.unchecked(data, scale, any_scale=arg.any_scale))
                else:
                    inputs.append(next(it))
            outs = eval_sub_jaxpr(body_jaxpr, consts, inputs)
            check_structure(owner, outs, scaled)
            flat_outs = []
            for out, is_scaled in zip(outs, scaled):
                if not is_scaled:
                    flat_outs.append(out)
                    continue
                if not isinstance(out, ScaledArray):
                    out = ScaledArray(out, np.ones((), as_scale(1).dtype))
                flat_outs += list(_sync_output(out, manual_axes, check_vma))
            return tuple(flat_outs)

        specs = []
        for spec, is_scaled in zip(out_specs, scaled):
            specs += [spec, PartitionSpec()] if is_scaled else [spec]
        mapped = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=tuple(flat_in_specs),
            out_specs=tuple(specs),
            axis_names=manual_axes,
            check_vma=check_vma,
        )
        return mapped(*flat_args)

    scaled, flat_outs = fixed_point(run, [f and any_scaled for f in out_floating])
    it = iter(flat_outs)
    return [ScaledArray(next(it), next(it)) if is_scaled else next(it) for is_scaled in scaled]


__all__ = [
    "scaled_all_gather",
    "scaled_all_to_all",
    "scaled_pmax",
    "scaled_pmin",
    "scaled_ppermute",
    "scaled_psum",
    "scaled_psum_invariant",
    "scaled_pvary",
    "scaled_reduce_scatter",
    "scaled_reshard",
    "scaled_shard_map",
]
