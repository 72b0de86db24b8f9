"""Delayed rescaling: rescale with the statistic measured at the previous step (Scalify paper, section 3.3).

:func:`jax_scalify.ops.dynamic_rescale` measures a statistic of a tensor and rescales it in
the same step, so the reduction sits on the critical path. Delayed rescaling keeps the
statistic in the training state instead: each step rescales with the statistic measured
at the previous step and records the current one for the next step. When the
distribution of the tensor changes slowly (the usual case for gradients and optimizer
state) the scales are the same as dynamic rescaling's; the first step (no statistic yet)
leaves the tensor unchanged.

Usage, inside a scalified training step::

    state = jsa.ops.init_delayed_rescale_state(grads_like)       # once, outside
    ...
    grads, state = jsa.ops.delayed_rescale(grads, state)          # every step

What is stored is the statistic of the *value* (``scale * norm(data)``), so it stays valid
when the incoming scale changes from one step to the next. Outside scalify the function is
the identity on values (the state is still updated, with statistics of the plain values).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..core.array import ScaledArray, is_scaled_leaf
from ..core.config import Pow2RoundMode, get_scalify_config
from ..core.interpreter import scalify
from ..core.measure import (
    Norm,
    NormFn,
    is_floating_array,
    min_scale_pow2,
    norm_function,
    rescale_factor,
    statistic_dtype,
)
from ..lax.primitives import get_data_scale, rebalance, stop_scaling
from ..policy import STATIC_POLICY

Array = Any
PyTree = Any


class DelayedRescaleState(NamedTuple):
    """The statistics kept between steps.

    Attributes:
        stats: a pytree with the structure of the rescaled tree (``ScaledArray`` leaves
            counted as one leaf): per leaf, a scalar holding the statistic of the value
            measured at the previous step (0: none yet; leaves that are not floating arrays
            keep 0).
    """

    stats: PyTree


def init_delayed_rescale_state(tree: PyTree) -> DelayedRescaleState:
    """The initial state for :func:`delayed_rescale` of trees shaped like ``tree``: no statistic yet.

    The statistics have the configured scale dtype (float32 by default).
    """
    dtype = get_scalify_config().scale_dtype
    return DelayedRescaleState(jax.tree.map(lambda _: jnp.zeros((), dtype), tree, is_leaf=is_scaled_leaf))


def _value_statistic(x: Array, norm_fn: NormFn, dtype: Any) -> Array:
    """``scale * norm(data)``: the statistic of the value, in ``dtype``, not differentiated."""
    data, scale = get_data_scale(x)
    data = jax.lax.stop_gradient(data)
    stat = norm_fn(data.astype(statistic_dtype(data.dtype))) * jax.lax.stop_gradient(scale).astype(np.float32)
    return stat.astype(dtype)


def _delayed_leaf(
    x: Any, previous: Array, norm_fn: NormFn, mode: Pow2RoundMode | None, min_scale: float | None
) -> tuple[Any, Array]:
    if not is_floating_array(x) or x.size == 0:
        return x, previous
    stat_dtype = jnp.result_type(previous)
    previous = stop_scaling(jnp.asarray(previous), np.float32)  # the state itself may be scaled
    _, scale = get_data_scale(x)
    scale = jax.lax.stop_gradient(scale)
    # The previous value statistic in units of the current data: a zero (no statistic yet)
    # or non-finite one gives factor 1, and the factor is guarded as dynamic_rescale's is.
    factor = rescale_factor(previous / scale.astype(np.float32), scale, mode, min_scale)
    return rebalance(x, factor), _value_statistic(x, norm_fn, stat_dtype)


def delayed_rescale(
    tree: PyTree,
    state: DelayedRescaleState,
    norm: Norm = "l2",
    *,
    rounding_mode: Pow2RoundMode | None = None,
    min_scale: float | None = None,
) -> tuple[PyTree, DelayedRescaleState]:
    """Rescale every floating leaf of ``tree`` with the statistic recorded at the previous step.

    For each floating leaf ``x`` with data ``d`` and scale ``s``, and ``m`` the statistic of
    the value recorded in ``state``: ``x`` is rebalanced by ``pow2(m / s)``, so its new scale
    is ``pow2(m)`` (what :func:`dynamic_rescale` gives when the current statistic is
    ``m``); the new state records ``s * norm(d)`` of the current ``x``. A leaf without a
    statistic yet (the first step) is returned unchanged.

    Args:
        tree: a pytree (or a single array); leaves that are not floating arrays pass through.
        state: from :func:`init_delayed_rescale_state` or the previous call.
        norm: ``"l2"`` (RMS), ``"l1"`` (mean ``|x|``), ``"max"`` (max ``|x|``), or a callable
            ``norm(data) -> scalar`` given the data in float32.
        rounding_mode, min_scale: as in :func:`dynamic_rescale` (the same guards apply: the
            scale stays within ``[min_scale, largest power of two]``).

    Returns:
        ``(rescaled_tree, new_state)``. Values are unchanged, with or without scalify.
        Called outside scalify on ``ScaledArray`` leaves, it runs under ``scalify`` eagerly.
    """
    norm_fn = norm_function(norm)
    if not isinstance(state, DelayedRescaleState):
        raise TypeError(
            f"jsa.ops.delayed_rescale expects a DelayedRescaleState, got {type(state).__name__}. "
            "Create it with jsa.ops.init_delayed_rescale_state(tree)."
        )
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_scaled_leaf)
    try:
        stats = treedef.flatten_up_to(state.stats)
    except (ValueError, TypeError) as err:
        raise ValueError(
            "jsa.ops.delayed_rescale: the state does not match the structure of the tree; create it with "
            f"jsa.ops.init_delayed_rescale_state on a tree of the same structure ({err})."
        ) from None
    if any(isinstance(x, ScaledArray) for x in leaves + stats):
        # Only outside scalify are leaves ScaledArray objects (inside, they trace as data).
        fn = lambda t, s: delayed_rescale(t, s, norm, rounding_mode=rounding_mode, min_scale=min_scale)  # noqa: E731
        return scalify(fn, policy=STATIC_POLICY)(tree, state)
    min_scale = None if min_scale is None else min_scale_pow2(min_scale)
    outs = [_delayed_leaf(x, m, norm_fn, rounding_mode, min_scale) for x, m in zip(leaves, stats)]
    new_tree = jax.tree.unflatten(treedef, [x for x, _ in outs])
    new_stats = jax.tree.unflatten(treedef, [m for _, m in outs])
    return new_tree, DelayedRescaleState(new_stats)


__all__ = ["DelayedRescaleState", "delayed_rescale", "init_delayed_rescale_state"]
