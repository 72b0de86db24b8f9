"""Dynamic rescaling: move a statistic of the data into the scale.

Scale rules assume unit-scaled, independent inputs; where statistics drift (typically the
gradient of a LayerNorm, or the whole gradient tree before the optimizer) a dynamic rescale
puts the data back near unit size. For each floating leaf ``x``:

1. ``data, scale = get_data_scale(x)``: plain arrays under scalify, ``(x, 1)`` outside;
2. a statistic of ``data`` is computed in float32 (float64 for float64 data):

   - ``"l1"``: mean of ``|data|``;
   - ``"l2"``: root mean square of ``data``;
   - ``"max"``: maximum of ``|data|``;
   - a callable: ``norm(data) -> scalar``;

3. it is rounded to a power of two with the configured rounding mode
   (:func:`jax_scalify.core.pow2_round`);
4. ``rebalance(x, factor)``: data divided by it, scale multiplied by it.

The factor is guarded so the scale never collapses: a zero or non-finite statistic (all-zero
or non-finite data) gives factor 1, leaving ``x`` unchanged, and the factor never moves the
scale below ``min_scale`` (default: the smallest normal number of the scale dtype) or above
the largest power of two of the scale dtype.

:func:`dynamic_rescale` of a pytree is one ``dynamic_rescale`` primitive with every floating
leaf as an operand: the identity on values outside scalify (model invariance: it lowers to
nothing, its derivative is the identity), and under scalify one rule that computes the
statistics of all operands together and changes only the representation.
The ``_grad`` variants do the same to the cotangent in the backward pass and are the
identity in the forward pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ..core.array import ScaledArray, is_scaled_leaf
from ..core.config import Pow2RoundMode, ScalifyConfig, get_scalify_config
from ..core.interpreter import scalify
from ..core.measure import (
    Norm,
    is_floating_array,
    min_scale_pow2,
    norm_function,
    rescale_scaled_arrays,
)
from ..core.registry import ScaledPrimitiveType, register_scaled_op
from ..core.sites import active_policy, is_rescalable, mark_rescaled, rescaled_from_data
from ..policy import STATIC_POLICY

Array = Any
PyTree = Any


# --- the dynamic_rescale primitive --------------------------------------------------------------
dynamic_rescale_p = Primitive("dynamic_rescale")
dynamic_rescale_p.multiple_results = True
dynamic_rescale_p.def_impl(lambda *xs, **_: list(xs))
dynamic_rescale_p.def_abstract_eval(lambda *avals, **_: list(avals))
mlir.register_lowering(dynamic_rescale_p, mlir.lower_fun(lambda *xs, **_: list(xs), multiple_results=True))
ad.primitive_jvps[dynamic_rescale_p] = lambda primals, tangents, **params: (
    dynamic_rescale_p.bind(*primals, **params),
    list(tangents),  # the value is unchanged: its derivative is the identity
)
batching.primitive_batchers[dynamic_rescale_p] = lambda args, dims, **params: (
    dynamic_rescale_p.bind(*args, **params),
    list(dims),
)


@register_scaled_op(dynamic_rescale_p, scaled_type=ScaledPrimitiveType.ALWAYS_SCALE)
def scaled_dynamic_rescale(*xs: ScaledArray, norm: Norm, rounding_mode: Pow2RoundMode, min_scale: float | None) -> list:
    """The statistic of each data moved into its scale; the scalar arithmetic of all operands batched.

    An operand the rescale policy has just rescaled with the same statistic and rounding is
    returned as it is (rescaling it again would move nothing); with that statistic, the
    outputs count as rescaled by the policy (its output rescale leaves them).
    """
    policy = active_policy()
    same_as_policy = norm == policy.norm and rounding_mode == get_scalify_config().rounding_mode and min_scale is None
    todo = [i for i, x in enumerate(xs) if is_rescalable(x) and not (same_as_policy and rescaled_from_data(x))]
    outs = list(xs)
    rescaled = rescale_scaled_arrays(
        [xs[i] for i in todo], norm, None, rounding_mode=rounding_mode, min_scale=min_scale
    )
    for i, out in zip(todo, rescaled):
        outs[i] = mark_rescaled(out) if same_as_policy else out
    return outs


def _rescale_leaves(leaves: list, norm: Norm, config: ScalifyConfig, min_scale: float | None) -> list:
    params = dict(norm=norm, rounding_mode=config.rounding_mode, min_scale=min_scale)
    if any(isinstance(x, ScaledArray) for x in leaves):
        # ScaledArrays outside scalify: rescale their representation eagerly.
        return scalify(lambda *xs: dynamic_rescale_p.bind(*xs, **params), policy=STATIC_POLICY)(*leaves)
    return dynamic_rescale_p.bind(*leaves, **params)


def dynamic_rescale(
    tree: PyTree,
    norm: Norm = "l2",
    *,
    rounding_mode: Pow2RoundMode | None = None,
    min_scale: float | None = None,
) -> PyTree:
    """Rescale every floating leaf of ``tree`` so its data has a statistic near 1.

    The statistic of the data (``norm``: ``"l2"`` RMS, ``"l1"`` mean ``|data|``, ``"max"``
    max ``|data|``, or a callable ``norm(data) -> scalar`` given the data in float32) is
    rounded to a power of two and moved from the data into the scale, so the value is
    unchanged. Outside scalify this is the identity on values; a ``ScaledArray`` leaf passed
    outside scalify is rescaled eagerly. Leaves that are not floating arrays pass through.

    Args:
        tree: a pytree (or a single array).
        norm: the statistic, see above.
        rounding_mode: how the statistic is rounded to a power of two (default: the
            configured ``ScalifyConfig.rounding_mode``).
        min_scale: the scale is never moved below it (default: the smallest normal number
            of the scale dtype; other values are rounded up to a power of two). A zero or
            non-finite statistic leaves the leaf unchanged.
    """
    if not callable(norm):
        norm_function(norm)  # checks the name
    config = get_scalify_config()
    if rounding_mode is not None:
        config = dataclasses.replace(config, rounding_mode=rounding_mode)
    min_scale = None if min_scale is None else min_scale_pow2(min_scale)
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_scaled_leaf)
    where = [i for i, x in enumerate(leaves) if isinstance(x, ScaledArray) or is_floating_array(x)]
    if where:
        for i, out in zip(where, _rescale_leaves([leaves[i] for i in where], norm, config, min_scale)):
            leaves[i] = out
    return jax.tree.unflatten(treedef, leaves)


def dynamic_rescale_l1(tree: PyTree, **kwargs) -> PyTree:
    """:func:`dynamic_rescale` with the mean absolute value of the data (``norm="l1"``)."""
    return dynamic_rescale(tree, "l1", **kwargs)


def dynamic_rescale_l2(tree: PyTree, **kwargs) -> PyTree:
    """:func:`dynamic_rescale` with the root mean square of the data (``norm="l2"``)."""
    return dynamic_rescale(tree, "l2", **kwargs)


def dynamic_rescale_max(tree: PyTree, **kwargs) -> PyTree:
    """:func:`dynamic_rescale` with the maximum absolute value of the data (``norm="max"``)."""
    return dynamic_rescale(tree, "max", **kwargs)


def on_backward(tree: PyTree, bwd: Callable[[list], list]) -> PyTree:
    """Identity on the floating array leaves of ``tree``; their cotangents go through ``bwd``.

    ``bwd(cotangents) -> cotangents`` gets and returns the list of the cotangents of the
    floating array leaves (in ``jax.tree.leaves`` order). Other leaves pass through and get
    no cotangent.
    """
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_scaled_leaf)
    where = [i for i, x in enumerate(leaves) if is_floating_array(x)]
    if not where:
        return tree

    @jax.custom_vjp
    def identity(floating):
        return floating

    identity.defvjp(lambda floating: (floating, None), lambda _, cts: (list(bwd(list(cts))),))
    out = identity([leaves[i] for i in where])
    for i, x in zip(where, out):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


def dynamic_rescale_grad(
    tree: PyTree,
    norm: Norm = "l2",
    *,
    rounding_mode: Pow2RoundMode | None = None,
    min_scale: float | None = None,
) -> PyTree:
    """Identity in the forward pass; :func:`dynamic_rescale` of the cotangent in the backward.

    Use it where gradients drift from unit scale (the paper applies it to the input
    gradient of each LayerNorm). Same arguments as :func:`dynamic_rescale`.
    """
    norm_function(norm)  # fail at the call, not in the backward pass

    def bwd(cts):
        return dynamic_rescale(cts, norm, rounding_mode=rounding_mode, min_scale=min_scale)

    return on_backward(tree, bwd)


def dynamic_rescale_l1_grad(tree: PyTree, **kwargs) -> PyTree:
    """:func:`dynamic_rescale_grad` with ``norm="l1"`` (mean absolute value of the cotangent)."""
    return dynamic_rescale_grad(tree, "l1", **kwargs)


def dynamic_rescale_l2_grad(tree: PyTree, **kwargs) -> PyTree:
    """:func:`dynamic_rescale_grad` with ``norm="l2"`` (root mean square of the cotangent)."""
    return dynamic_rescale_grad(tree, "l2", **kwargs)


def dynamic_rescale_max_grad(tree: PyTree, **kwargs) -> PyTree:
    """:func:`dynamic_rescale_grad` with ``norm="max"`` (maximum absolute value of the cotangent)."""
    return dynamic_rescale_grad(tree, "max", **kwargs)


__all__ = [
    "dynamic_rescale",
    "dynamic_rescale_grad",
    "dynamic_rescale_l1",
    "dynamic_rescale_l1_grad",
    "dynamic_rescale_l2",
    "dynamic_rescale_l2_grad",
    "dynamic_rescale_max",
    "dynamic_rescale_max_grad",
    "dynamic_rescale_p",
    "scaled_dynamic_rescale",
]
