"""Scale rules of the primitives that pass values through: ``name``, ``device_put``, ``optimization_barrier``.

- ``name`` (``jax.ad_checkpoint.checkpoint_name``): the data carries the name, the scale is
  unchanged; a traced scale is named too, so a checkpoint policy that saves the name saves
  the whole value (a scale folded at trace time is a constant and needs no saving).
- ``device_put`` (``jax.device_put``, also emitted by ``jax.scipy.sparse.linalg`` and
  ``jnp.array``): the data goes where the plain value would go, with the same copy
  semantics; a traced scale goes along, replicated over a ``NamedSharding``'s mesh (a
  scalar cannot be partitioned). Scales folded at trace time stay constants.
- ``optimization_barrier`` (``jax.lax.optimization_barrier``): the data and the traced
  scales go through one barrier together, so what it orders is the whole value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import primitives as P

from ..core.array import ScaledArray
from ..core.registry import primitive_of, register_scaled_lax_op, register_scaled_op
from ..core.scaling import with_scalar_scale

Array = Any

# Not exported by `jax.extend`.
optimization_barrier_p = primitive_of(jax.lax.optimization_barrier, np.zeros((2,), np.float32))


def _is_traced_scale(scale: Any) -> bool:
    return not isinstance(scale, (np.ndarray, np.generic, float, int))


def _scale_destination(dst: Any) -> Any:
    """Where a scalar scale goes when its data goes to ``dst``: replicated over a named mesh.

    A ``Format`` (layout and sharding) contributes its sharding only: a data layout does not
    apply to a scalar.
    """
    if isinstance(dst, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(dst.mesh, jax.sharding.PartitionSpec(), memory_kind=dst.memory_kind)
    if not isinstance(dst, jax.sharding.Sharding) and hasattr(dst, "layout") and hasattr(dst, "sharding"):
        return _scale_destination(dst.sharding)
    return dst


@register_scaled_lax_op
def scaled_name(x: ScaledArray, **params) -> ScaledArray:
    """Scale unchanged: the data carries the checkpoint name (a traced scale too)."""
    scale = P.name_p.bind(x.scale, **params) if _is_traced_scale(x.scale) else x.scale
    return ScaledArray(P.name_p.bind(x.data, **params), scale)


@register_scaled_lax_op
def scaled_device_put(
    *xs: Any, devices: Sequence[Any], srcs: Sequence[Any], copy_semantics: Sequence[Any], **params
) -> list:
    """Scale unchanged: data put with the equation's params, a traced scale along (replicated)."""
    xs = [with_scalar_scale(x) if isinstance(x, ScaledArray) else x for x in xs]
    entries = [
        (x.data if isinstance(x, ScaledArray) else x, dst, src, copy)
        for x, dst, src, copy in zip(xs, devices, srcs, copy_semantics)
    ]
    traced = [i for i, x in enumerate(xs) if isinstance(x, ScaledArray) and _is_traced_scale(x.scale)]
    for i in traced:
        entries.append((xs[i].scale, _scale_destination(devices[i]), _scale_destination(srcs[i]), copy_semantics[i]))
    values, dsts, srcs_all, copies = zip(*entries)
    outs = P.device_put_p.bind(*values, devices=dsts, srcs=srcs_all, copy_semantics=copies, **params)
    scales = dict(zip(traced, outs[len(xs) :]))
    return [
        ScaledArray(outs[i], scales.get(i, x.scale)) if isinstance(x, ScaledArray) else outs[i]
        for i, x in enumerate(xs)
    ]


@register_scaled_op(optimization_barrier_p)
def scaled_optimization_barrier(*xs: Any) -> list:
    """Scale unchanged: the data and the traced scales pass through one barrier together."""
    xs = [with_scalar_scale(x) if isinstance(x, ScaledArray) else x for x in xs]
    traced = [i for i, x in enumerate(xs) if isinstance(x, ScaledArray) and _is_traced_scale(x.scale)]
    values = [x.data if isinstance(x, ScaledArray) else x for x in xs] + [xs[i].scale for i in traced]
    outs = optimization_barrier_p.bind(*values)
    scales = dict(zip(traced, outs[len(xs) :]))
    return [
        ScaledArray(outs[i], scales.get(i, x.scale)) if isinstance(x, ScaledArray) else outs[i]
        for i, x in enumerate(xs)
    ]


__all__ = ["optimization_barrier_p", "scaled_device_put", "scaled_name", "scaled_optimization_barrier"]
