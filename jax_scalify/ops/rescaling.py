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

Everything is built from the scaling primitives, so outside scalify the functions are the
identity on values (model invariance); under scalify they change only the representation.
The ``_grad`` variants do the same to the cotangent in the backward pass and are the
identity in the forward pass.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..core.array import ScaledArray, is_floating_dtype, is_scaled_leaf
from ..core.config import Pow2RoundMode, ScalifyConfig, get_scalify_config
from ..core.interpreter import scalify
from ..core.policy import STATIC_POLICY
from ..core.pow2 import pow2_round, pow2_round_down
from ..lax.base_scaling import as_scale, mul_data
from ..lax.primitives import get_data_scale, rebalance, scaled_rebalance

Array = Any
PyTree = Any
NormFn = Callable[[Array], Array]
Norm = str | NormFn


def _work_dtype(dtype) -> np.dtype:
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _max_abs(data: Array) -> Array:
    return jnp.max(jnp.abs(data))


def _normalised(data: Array) -> tuple[Array, Array]:
    """``(data / m, m)`` with ``m`` the power of two below ``max|data|`` (1 if that is 0 or not finite).

    Dividing by a power of two is exact; it keeps the squares and sums of the L1/L2
    statistics from overflowing when the data is large.
    """
    m = pow2_round_down(_max_abs(data))
    m = jnp.where(jnp.isfinite(m) & (m > 0), m, jnp.ones_like(m))
    return data / m, m


def l1_norm(data: Array) -> Array:
    """Mean absolute value of ``data``."""
    normed, m = _normalised(data)
    return m * jnp.mean(jnp.abs(normed))


def l2_norm(data: Array) -> Array:
    """Root mean square of ``data``."""
    normed, m = _normalised(data)
    return m * jnp.sqrt(jnp.mean(jnp.square(normed)))


def max_norm(data: Array) -> Array:
    """Maximum absolute value of ``data``."""
    return _max_abs(data)


_NORMS: dict[str, NormFn] = {"l1": l1_norm, "l2": l2_norm, "max": max_norm}


def _norm_fn(norm: Norm) -> NormFn:
    if callable(norm):
        return norm
    if norm not in _NORMS:
        raise ValueError(
            f"Unknown norm {norm!r} for dynamic_rescale: use 'l1', 'l2', 'max', or a callable "
            "norm(data) -> scalar."
        )
    return _NORMS[norm]


def _is_floating_array(x: Any) -> bool:
    return hasattr(x, "dtype") and hasattr(x, "shape") and is_floating_dtype(x.dtype)


def _pow2_max(dtype) -> float:
    """The largest power of two of ``dtype``."""
    return float(2.0 ** (jnp.finfo(dtype).maxexp - 1))


def _pow2_floor(min_scale: float) -> float:
    """``min_scale`` checked and rounded up to a power of two, so factors stay powers of two."""
    value = float(min_scale)
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"dynamic_rescale: min_scale must be a positive finite number, got {min_scale!r}.")
    return float(2.0 ** np.ceil(np.log2(value)))


def _rescale_factor(stat: Array, scale: Array, mode: Pow2RoundMode | None, min_scale: float | None) -> Array:
    """The power-of-two factor for ``rebalance``, guarded as the module docstring says."""
    scale_dtype = np.dtype(scale.dtype)
    work = np.promote_types(np.float32, scale_dtype)
    finfo = jnp.finfo(scale_dtype)
    lowest = np.asarray(finfo.tiny if min_scale is None else min_scale, work)
    highest = np.asarray(_pow2_max(scale_dtype), work)
    stat = pow2_round(jnp.asarray(stat).astype(work), mode)
    factor = jnp.where(jnp.isfinite(stat) & (stat > 0), stat, jnp.ones_like(stat))
    scale = jnp.asarray(scale).astype(work)
    has_scale = jnp.isfinite(scale) & (scale > 0)
    scale = jnp.where(has_scale, scale, jnp.ones_like(scale))
    # The new scale, scale * factor, stays in [lowest, highest] unless it already was outside
    # (then it may only move back towards the range); the factor itself stays representable.
    lower = jnp.maximum(jnp.minimum(lowest / scale, 1), np.asarray(finfo.tiny, work))
    upper = jnp.minimum(jnp.maximum(highest / scale, 1), highest)
    factor = jnp.clip(factor, lower, upper)
    return jnp.where(has_scale, factor, jnp.ones_like(factor)).astype(scale_dtype)


def _rescale_array(x: Array, norm_fn: NormFn, mode: Pow2RoundMode | None, min_scale: float | None) -> Array:
    if x.size == 0:
        return x
    data, scale = get_data_scale(x)
    data = jax.lax.stop_gradient(data)  # the factor is a choice of representation, not a function to differentiate
    stat = norm_fn(data.astype(_work_dtype(data.dtype)))
    return rebalance(x, _rescale_factor(stat, scale, mode, min_scale))


def strided_sample(data: Array, max_size: int | None) -> Array:
    """At most about ``max_size`` elements of ``data``: a regular grid of strided slices (``None``: all).

    Each axis is sampled with its own stride (the largest axes first), so no reshape is
    needed and a sharded array stays sharded the same way. The sample is a view XLA fuses
    into the reduction that consumes it: a statistic of the sample reads only the sampled
    elements, not the whole tensor.
    """
    if max_size is None or data.size <= max_size:
        return data
    counts = list(data.shape)
    while int(np.prod(counts)) > max_size:
        axis = int(np.argmax(counts))
        counts[axis] = -(-counts[axis] // 2)
    strides = tuple(-(-dim // count) if count else 1 for dim, count in zip(data.shape, counts))
    return jax.lax.slice(data, (0,) * data.ndim, data.shape, strides)


def rescale_scaled_array(x: ScaledArray, norm: Norm = "l2", sample_size: int | None = None) -> ScaledArray:
    """``x`` (a ``ScaledArray`` being evaluated by scalify) with the statistic of its data moved into its scale.

    The form of :func:`dynamic_rescale` that acts on the ``(data, scale)`` pair directly,
    for the automatic rescales of :class:`jax_scalify.RescalePolicy`: the same statistic,
    rounding and guards, without a ``jit`` equation around it. With ``sample_size`` the
    statistic is that of a strided sample of at most about that many elements
    (:func:`strided_sample`): enough to choose a power of two, at a fraction of the cost of
    reading the whole tensor. A power-of-two scale stays one (so is the factor, unless
    rounding is ``NONE``).
    """
    config = get_scalify_config()
    data = strided_sample(jax.lax.stop_gradient(x.data), sample_size)
    stat = _norm_fn(norm)(data.astype(_work_dtype(data.dtype)))
    scale = as_scale(x.scale)
    return scaled_rebalance(x, _rescale_factor(stat, jnp.asarray(scale), config.rounding_mode, None))


def _row_statistics(rows: Array, sizes: np.ndarray, norm: str) -> Array:
    """Per row: the statistic ``norm`` of its first ``sizes[i]`` elements (zero padding changes none of them)."""
    magnitudes = jnp.abs(rows)
    top = jnp.max(magnitudes, axis=1)
    if norm == "max":
        return top
    m = pow2_round_down(top)
    m = jnp.where(jnp.isfinite(m) & (m > 0), m, jnp.ones_like(m))
    normed = magnitudes / m[:, None]
    if norm == "l1":
        return m * (jnp.sum(normed, axis=1) / sizes)
    return m * jnp.sqrt(jnp.sum(jnp.square(normed), axis=1) / sizes)


def _explicitly_sharded(x: Array) -> bool:
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    return mesh is not None and not mesh.empty and jax.sharding.AxisType.Explicit in tuple(mesh.axis_types)


def _batch_statistics(samples: list[Array], norm: str, work, stack: bool) -> Array:
    """The statistic of each sample, as one vector.

    The samples are flattened, zero-padded and stacked into one matrix reduced row by row
    (two reductions for the whole batch, a few kernels to compile); under explicit sharding,
    where samples of differently sharded tensors cannot be stacked, or without ``stack``
    (whole tensors, which stacking would copy), each is reduced on its own.
    """
    if not stack or norm not in ("l1", "l2", "max") or any(_explicitly_sharded(d) for d in samples):
        norm_fn = _norm_fn(norm)
        return jnp.stack([norm_fn(d.astype(work)) for d in samples])
    flat = [d.reshape(-1).astype(work) for d in samples]
    length = max(d.size for d in flat)
    rows = jnp.stack([jnp.pad(d, (0, length - d.size)) for d in flat])
    return _row_statistics(rows, np.array([d.size for d in flat], work), norm)


def rescale_scaled_arrays(xs: list[ScaledArray], norm: str = "l2", sample_size: int | None = 4096) -> list[ScaledArray]:
    """:func:`rescale_scaled_array` of several ``ScaledArray`` at once, their statistics computed together.

    The statistics of the (sampled) data are computed together (:func:`_batch_statistics`)
    and the factors, their inverses and the new scales as vectors: the scalar arithmetic of
    the batch is a few kernels instead of a few per tensor. ``norm`` is ``"l1"``, ``"l2"``,
    ``"max"`` or a callable.
    """
    if len(xs) < 2:
        return [rescale_scaled_array(x, norm, sample_size) for x in xs]
    config = get_scalify_config()
    samples = [strided_sample(jax.lax.stop_gradient(x.data), sample_size) for x in xs]
    work = np.float64 if any(np.dtype(d.dtype) == np.float64 for d in samples) else np.float32
    stats = _batch_statistics(samples, norm, work, stack=sample_size is not None)
    scales = jnp.stack([jnp.asarray(as_scale(x.scale)) for x in xs])
    factors = _rescale_factor(stats, scales, config.rounding_mode, None)
    inverses, new_scales = 1 / factors, scales * factors
    outs = []
    for i, x in enumerate(xs):
        outs.append(ScaledArray(mul_data(x.data, inverses[i]), new_scales[i]))
    return outs


@functools.partial(jax.jit, static_argnames=("norm_fn", "min_scale", "config"))
def _rescale_jit(x: Array, norm_fn: NormFn, min_scale: float | None, config: ScalifyConfig) -> Array:
    """One jitted call per leaf: cheap eagerly, one ``jit`` equation in a trace.

    The config is a static argument (not read from the context inside) so that a cached
    trace never uses stale settings.
    """
    with config:
        return _rescale_array(x, norm_fn, config.rounding_mode, min_scale)


def _rescale_leaf(x: Any, norm_fn: NormFn, config: ScalifyConfig, min_scale: float | None) -> Any:
    if isinstance(x, ScaledArray):
        # A ScaledArray outside scalify: rescale its representation eagerly.
        return scalify(lambda a: _rescale_jit(a, norm_fn, min_scale, config), policy=STATIC_POLICY)(x)
    if not _is_floating_array(x):
        return x
    return _rescale_jit(x, norm_fn, min_scale, config)


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
    norm_fn = _norm_fn(norm)
    config = get_scalify_config()
    if rounding_mode is not None:
        config = dataclasses.replace(config, rounding_mode=rounding_mode)
    min_scale = None if min_scale is None else _pow2_floor(min_scale)
    return jax.tree.map(lambda x: _rescale_leaf(x, norm_fn, config, min_scale), tree, is_leaf=is_scaled_leaf)


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
    where = [i for i, x in enumerate(leaves) if _is_floating_array(x)]
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
    _norm_fn(norm)  # fail at the call, not in the backward pass

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
