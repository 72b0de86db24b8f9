"""Where a scale is measured from data, and wide data narrowed: the one place for both.

Every site that moves a statistic of the data into the scale (the rescale policy's sites,
``jsa.ops.dynamic_rescale``, the delayed rescales) and every cast of wide data into a narrow
dtype that must not overflow goes through the functions here:

- a statistic of the data (``"l1"`` mean ``|data|``, ``"l2"`` root mean square, ``"max"``
  largest ``|data|``, or a callable), computed in float32 on the whole tensor or on a strided
  sample, rounded to a power of two and moved from the data into the scale
  (:func:`rescale_scaled_arrays`: one batch of statistics for many tensors);
- narrowing (:func:`rescaled_into_narrow`, :func:`narrowed_within_range`): wide data cast to
  float16/FP8 with the largest entry bounded at half the dtype's largest power of two.

Moving a power of two between data and scale is exact, so values never change here; only
the representation does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .array import ScaledArray, is_floating_dtype, narrow_range
from .config import Pow2RoundMode, get_scalify_config
from .pow2 import binary, is_numpy, map_scalars, pow2_round, pow2_round_down, pow2_round_up

Array = Any
NormFn = Callable[[Array], Array]
Norm = str | NormFn


def scale_dtype() -> np.dtype:
    """The configured scale dtype."""
    return get_scalify_config().scale_dtype


def as_scale(s: Array) -> Array:
    """``s`` in the configured scale dtype (NumPy stays NumPy, so constants fold at trace time).

    A JAX scale already of that dtype is returned as it is (same object, so rules can tell
    that two operands share one scale).
    """
    if isinstance(s, (np.ndarray, np.generic, float, int)):
        return np.asarray(s, scale_dtype())
    if getattr(s, "dtype", None) == scale_dtype() and not getattr(s, "weak_type", False):
        return s
    return jnp.asarray(s).astype(scale_dtype())


def scale_bounds() -> tuple[np.ndarray, np.ndarray]:
    """``(smallest, largest)`` power of two that is a normal number of the scale dtype.

    Output scales of products and quotients are kept in this range (``2**-126 .. 2**127`` in
    float32): a subnormal scale is flushed to zero by XLA on CPU and ``2**128`` is inf.
    """
    info = np.finfo(scale_dtype())
    return np.asarray(info.tiny, scale_dtype()), np.asarray(2.0 ** (info.maxexp - 1), scale_dtype())


def is_wide_dtype(dtype) -> bool:
    """At least 32 bits: float32 or wider."""
    return jnp.finfo(dtype).bits >= 32


def _native_16bit_factor(data: Array, factor: Array) -> np.ndarray | None:
    """``factor`` in the 16-bit data dtype when multiplying in that dtype gives the float32 result.

    For a trace-time factor that the dtype holds exactly (a power of two within its range),
    the product rounded once from float32 and the product in the data dtype are the same
    correctly rounded value. Multiplying in the data dtype lets XLA fold the factor into a
    neighbouring kernel (on GPU, the epilogue of a matmul), where a convert-multiply-convert
    is a kernel of its own.
    """
    if jnp.finfo(data.dtype).bits != 16 or not isinstance(factor, (np.ndarray, np.generic)) or np.ndim(factor):
        return None
    in_dtype = np.asarray(factor, data.dtype)
    exact = np.isfinite(factor) and factor != 0 and np.asarray(in_dtype, np.float32) == factor
    return in_dtype if exact else None


def mul_data(data: Array, factor: Array) -> Array:
    """``data * factor`` in the data dtype; ``factor`` a (power-of-two) scalar.

    Narrow dtypes (16 and 8 bits) multiply in float32 and round once, so a factor outside
    their range (e.g. ``2**-30`` for float16) is still applied exactly before rounding; a
    trace-time factor that a 16-bit dtype holds exactly multiplies in that dtype (the same
    value, see :func:`_native_16bit_factor`).
    """
    if isinstance(factor, (np.ndarray, np.generic)) and np.all(factor == 1):
        return data
    if is_wide_dtype(data.dtype):
        return binary(jax.lax.mul, data, _in_dtype(factor, data.dtype))
    native = _native_16bit_factor(data, factor)
    if native is not None:
        return binary(jax.lax.mul, data, native)
    wide = binary(jax.lax.mul, _in_dtype(data, np.float32), _in_dtype(factor, np.float32))
    return _in_dtype(wide, data.dtype)


def _in_dtype(x: Array, dtype: Any) -> Array:
    """``x`` in ``dtype`` (NumPy stays NumPy; a traced value gets one conversion, none if it has ``dtype``)."""
    if is_numpy(x):
        return np.asarray(x, dtype)
    return x if x.dtype == dtype else jax.lax.convert_element_type(x, dtype)


def saturated_cast(wide: Array, dtype: Any) -> Array:
    """Wide data cast to the narrow ``dtype``, clipped to its largest finite value (no inf; E4M3 has none)."""
    largest = float(jnp.finfo(dtype).max)
    return jnp.clip(wide, -largest, largest).astype(dtype)


def largest_magnitude(data: Array) -> Array:
    """The largest ``|data|`` of the whole tensor, in float32 (one reduction)."""
    return jnp.max(jnp.abs(data)).astype(np.float32)


VARIADIC_LIMIT = 4096


def _statistic_terms(data: Array, kind: str) -> tuple[Array, Callable]:
    """The terms whose reduction gives the statistic ``kind`` of ``data``, and their combiner."""
    lax = jax.lax
    if kind == "zero_fraction":
        return lax.convert_element_type(binary(lax.eq, data, 0), np.float32), lax.add
    if kind == "max":
        return lax.abs(lax.convert_element_type(data, np.float32)), lax.max
    if kind == "exact_mean_square":
        return lax.square(lax.convert_element_type(data, np.float32)), lax.add
    return _norm_terms(data, "l2"), lax.add


@functools.cache
def _combined(combiners: tuple[Callable, ...]) -> Callable:
    """One function per tuple of combiners: a new one per call would be a new jaxpr, recompiled by every ``jit``."""
    return lambda a, b: tuple(op(x, y) for op, x, y in zip(combiners, a, b))


def batched_statistics(datas: Sequence[Array], kinds: Sequence[str]) -> list[Array]:
    """The statistic ``kinds[i]`` of each ``datas[i]``; those of one small shape in one (variadic) reduction.

    ``"max"``: the largest magnitude, in float32, exact; ``"mean_square"``: the mean of the
    squares of :func:`_norm_terms`; ``"exact_mean_square"``: the mean of the plain float32
    squares (inf where their sum overflows, 0 where they all underflow: read beside the
    largest magnitude, which tells these apart, :func:`_mean_beside_largest`);
    ``"zero_fraction"``: the fraction of entries equal to 0. XLA compiles one variadic
    reduction as one kernel, where separate reductions are one kernel each. Tensors of more
    than :data:`VARIADIC_LIMIT` entries are reduced on their own: a variadic reduction holds
    all its operands in memory at once (the float32 moments of every same-shaped weight of a
    model), and XLA:CPU runs it as a sequential loop, which for a sum is about ten times
    slower than a sum of its own. Arrays sharded differently in their types are not reduced
    together (the partitioner would reshard one of them).
    """
    by_shape: dict[tuple, list[int]] = {}
    for i, d in enumerate(datas):
        alone = np.size(d) > VARIADIC_LIMIT
        by_shape.setdefault(("alone", i) if alone else (np.shape(d), str(_sharding_spec(d))), []).append(i)
    out: list[Array] = [None] * len(datas)
    for where in by_shape.values():
        terms, combiners = zip(*(_statistic_terms(datas[i], kinds[i]) for i in where))
        if len(where) == 1:
            axes = tuple(range(np.ndim(terms[0])))
            reduce = jax.lax.reduce_max if combiners[0] is jax.lax.max else jax.lax.reduce_sum
            totals = [reduce(terms[0], axes)]
        else:
            totals = jax.lax.reduce(
                tuple(terms),
                (np.float32(0),) * len(where),
                _combined(tuple(combiners)),
                tuple(range(np.ndim(datas[where[0]]))),
            )
        for i, total in zip(where, totals):
            out[i] = (
                total if kinds[i] == "max" else binary(jax.lax.mul, total, np.float32(1 / max(np.size(datas[i]), 1)))
            )
    return out


def narrow_limit(dtype: Any) -> np.float32:
    """Half the largest power of two of a narrow ``dtype`` (``2**14`` for float16): where guarded data stop."""
    return np.float32(2.0 ** (jnp.finfo(dtype).maxexp - 2))


def narrowed_within_range(x: ScaledArray, dtype: Any, lift: bool = False) -> ScaledArray:
    """``x`` (wide data) cast to the narrow ``dtype``, its scale raised where its largest entry would overflow.

    A statistic of a sample sets a unit-sized RMS; an entry more than about ``2**15`` times
    that RMS (a bias gradient where a few units carry everything) would become inf in
    float16. The largest magnitude of the whole tensor bounds the data at half the dtype's
    largest power of two (a power-of-two factor: exact), at the cost of one reduction.
    With ``lift``, data whose largest entry is below ``2**-8`` are also moved up until it is
    in ``[1, 2)`` (the scale lowered, kept a normal number), from the same reduction.
    """
    if np.size(x.data) == 0:
        return ScaledArray(x.data.astype(dtype), x.scale)
    limit = narrow_limit(dtype)
    peak = largest_magnitude(x.data)
    factor = jnp.where(jnp.isfinite(peak) & (peak > limit), pow2_round_up(peak / limit), np.float32(1))
    scale = as_scale(x.scale)
    if lift:
        small = jnp.isfinite(peak) & (peak > 0) & (peak < np.float32(2.0**-8))
        lifted = jnp.maximum(pow2_round_down(peak), (scale_bounds()[0] / scale).astype(np.float32))
        factor = jnp.where(small, lifted, factor)
    # Divided, not multiplied by ``1 / factor``: the same exact result, and faster on XLA:CPU.
    return ScaledArray((x.data / factor.astype(x.data.dtype)).astype(dtype), scale * factor.astype(scale.dtype))


def lowered_to_largest_entry(x: ScaledArray) -> ScaledArray:
    """``x`` with its scale lowered (never raised) until its largest data entry is in ``[1, 2)``.

    One reduction of the whole tensor. All-zero or non-finite data keep their scale; the
    scale stays a normal number.
    """
    peak = largest_magnitude(x.data)
    below_one = jnp.isfinite(peak) & (peak > 0) & (peak < 1)
    factor = jnp.where(below_one, pow2_round_down(peak), np.float32(1))
    scale = as_scale(x.scale)
    factor = jnp.maximum(factor, scale_bounds()[0] / scale).astype(scale.dtype)
    return ScaledArray(mul_data(x.data, 1 / factor), scale * factor)


def statistic_dtype(dtype) -> np.dtype:
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


def norm_function(norm: Norm) -> NormFn:
    if callable(norm):
        return norm
    if norm not in _NORMS:
        raise ValueError(
            f"Unknown norm {norm!r} for dynamic_rescale: use 'l1', 'l2', 'max', or a callable norm(data) -> scalar."
        )
    return _NORMS[norm]


def is_floating_array(x: Any) -> bool:
    return hasattr(x, "dtype") and hasattr(x, "shape") and is_floating_dtype(x.dtype)


def _pow2_max(dtype) -> float:
    """The largest power of two of ``dtype``."""
    return float(2.0 ** (jnp.finfo(dtype).maxexp - 1))


def min_scale_pow2(min_scale: float) -> float:
    """``min_scale`` checked and rounded up to a power of two, so factors stay powers of two."""
    value = float(min_scale)
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"dynamic_rescale: min_scale must be a positive finite number, got {min_scale!r}.")
    return float(2.0 ** np.ceil(np.log2(value)))


def rescale_factor(stat: Array, scale: Array, mode: Pow2RoundMode | None, min_scale: float | None) -> Array:
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


SAMPLE_AXIS_LIMIT = 32


def strided_sample(data: Array, max_size: int | None) -> Array:
    """At most about ``max_size`` elements of ``data``, and at most 32 along any axis (``None``: all).

    A tensor of at most ``max_size`` elements (not sharded in its type) is read whole, its
    axes split into axes of at most 32 (a bias or a gain of 64 to 1,024 entries, where a
    few units may carry the whole gradient: a strided sample could miss them, and reading
    them all costs the same). A larger one is sampled on a strided grid: each axis with its
    own stride (the largest axes first), so no reshape is needed and a sharded array stays
    sharded the same way. XLA
    fuses the slice, and the elementwise computation that produced ``data``, into the
    reduction that consumes the sample: a statistic of the sample reads only the sampled
    elements. At most 32 entries per axis keep that reduction one loop on XLA:CPU, which
    compiles a reduction with a longer axis as a tree of kernels that materialise what they
    read (the tensor itself, when it has other consumers): a rescaled tensor then costs one
    kernel instead of several (``benchmarks/xla_cpu_costs.py``).
    """
    if max_size is None:
        return data
    if data.size <= max_size and max(data.shape, default=0) > SAMPLE_AXIS_LIMIT and not _sharded_in_type(data):
        grid = _short_axes(data.size)
        if grid is not None:
            return data.reshape(grid)
    counts = [min(dim, SAMPLE_AXIS_LIMIT) for dim in data.shape]
    while int(np.prod(counts)) > max_size:
        axis = int(np.argmax(counts))
        counts[axis] = -(-counts[axis] // 2)
    if tuple(counts) == data.shape:
        return data
    strides = [-(-dim // count) if count else 1 for dim, count in zip(data.shape, counts)]
    for axis, devices in enumerate(_devices_along_axes(data)):
        if devices > 1:
            strides[axis] = _stride_within_shards(data.shape[axis] // devices, strides[axis])
    return jax.lax.slice(data, (0,) * data.ndim, data.shape, tuple(strides))


def _stride_within_shards(shard_size: int, stride: int) -> int:
    """The smallest divisor of ``shard_size`` that is at least ``stride``: every shard then gives
    the same number of sampled rows, so the sample's length along an axis sharded in the
    array's type is a multiple of the number of devices, as explicit sharding requires (a
    stride of 16 on 496 rows over 8 devices gives 31 rows, which it cannot type)."""
    return next(d for d in range(min(max(stride, 1), shard_size), shard_size + 1) if shard_size % d == 0)


def _sharding_spec(data: Array):
    return getattr(getattr(jax.typeof(data), "sharding", None), "spec", None)


def _sharded_in_type(data: Array) -> bool:
    """Whether ``data``'s type names a mesh axis (explicit sharding), where a reshape would need an output sharding."""
    spec = _sharding_spec(data)
    return spec is not None and any(axis is not None for axis in spec)


def _devices_along_axes(data: Array) -> list[int]:
    """For each axis of ``data``, the number of devices its type shards it over (1 where it is not sharded in type)."""
    sharding = getattr(jax.typeof(data), "sharding", None)
    spec = _sharding_spec(data)
    if spec is None:
        return [1] * data.ndim
    mesh_shape = dict(sharding.mesh.shape)
    sizes = []
    for axis in range(data.ndim):
        names = spec[axis] if axis < len(spec) else None
        names = () if names is None else (names,) if isinstance(names, str) else tuple(names)
        sizes.append(int(np.prod([mesh_shape[name] for name in names], dtype=np.int64)))
    return sizes


def _short_axes(size: int) -> tuple[int, ...] | None:
    """A shape of ``size`` elements whose axes are at most 32 (largest factors first); None if a prime factor exceeds 32."""
    axes = []
    while size > SAMPLE_AXIS_LIMIT:
        factor = next(f for f in range(SAMPLE_AXIS_LIMIT, 0, -1) if size % f == 0)
        if factor == 1:
            return None
        axes.append(factor)
        size //= factor
    return (*axes, size)


def rescale_scaled_array(x: ScaledArray, norm: Norm = "l2", sample_size: int | None = None) -> ScaledArray:
    """``x`` (a ``ScaledArray`` being evaluated by scalify) with the statistic of its data moved into its scale.

    The form of :func:`dynamic_rescale` that acts on the ``(data, scale)`` pair directly,
    for the automatic rescales of :class:`jax_scalify.RescalePolicy`: the same statistic,
    rounding and guards, without a ``jit`` equation around it. With ``sample_size`` the
    statistic is that of a strided sample of at most about that many elements
    (:func:`strided_sample`): enough to choose a power of two, at a fraction of the cost of
    reading the whole tensor, computed as in a batch (:func:`rescale_scaled_arrays`). A
    power-of-two scale stays one (so is the factor, unless rounding is ``NONE``).
    """
    if sample_size is not None:
        return rescale_scaled_arrays([x], norm, sample_size)[0]
    return _rescale_whole(x, norm)


def _rescale_whole(x: ScaledArray, norm: Norm) -> ScaledArray:
    """``x`` rescaled by the exact statistic of all its data, with the configured rounding."""
    data = jax.lax.stop_gradient(x.data)
    stat = norm_function(norm)(data.astype(statistic_dtype(data.dtype)))
    scale = as_scale(x.scale)
    return rebalanced(x, rescale_factor(stat, jnp.asarray(scale), get_scalify_config().rounding_mode, None))


_TERM_FLOOR, _TERM_CEILING = 2.0**-120, 2.0**100


def _norm_terms(data: Array, norm: str) -> Array:
    """The float32 terms of :func:`_one_pass_statistic` of ``data`` (squares for ``"l2"``, magnitudes for ``"l1"``).

    Data whose every square lies inside the clamp's range need no clamp (float16: within
    ``[2**-48, 2**32]``; FP8 narrower still), and their inf and nan stay what they are.
    Computed from ``data`` itself, a square needing no absolute value: a reduction of these
    terms beside the largest magnitude of the same data (:func:`batched_statistics`) shares
    no intermediate array with it, which XLA:CPU would otherwise write out and read back.
    """
    lax = jax.lax
    wide = lax.convert_element_type(data, np.float32)
    if _squares_within_term_range(data.dtype):
        return lax.square(wide) if norm == "l2" else lax.abs(wide)
    return _clamped_terms(wide, norm)


def _squares_within_term_range(dtype: Any) -> bool:
    """Whether every square of a finite, non-zero value of the floating ``dtype`` is within ``[2**-120, 2**100]``."""
    info = jnp.finfo(dtype)
    return 2 * int(info.maxexp) <= 100 and float(info.smallest_subnormal) ** 2 >= _TERM_FLOOR


def _clamped_terms(data: Array, norm: str) -> Array:
    """The terms of float32 ``data``, each clamped to ``[2**-120, 2**100]`` unless it is zero or not finite."""
    lax = jax.lax
    terms = lax.square(data) if norm == "l2" else lax.abs(data)
    floor = binary(lax.mul, lax.convert_element_type(binary(lax.ne, data, 0.0), data.dtype), _TERM_FLOOR)  # 0 for 0
    clamped = binary(lax.min, lax.max(terms, floor), _TERM_CEILING)
    return lax.select(lax.is_finite(data), clamped, terms)  # inf and nan data keep their scale


def _one_pass_mean(data: Array, norm: str) -> Array:
    """The mean of the terms of :func:`_norm_terms` (squares for ``"l2"``, magnitudes for ``"l1"``)."""
    return jnp.sum(_norm_terms(data, norm)) * np.float32(1 / max(data.size, 1))


def _one_pass_statistic(data: Array, norm: str) -> Array:
    """The statistic ``norm`` of ``data`` in float32 as one reduction, with no overflow or underflow.

    Each term of the sum, the square (``"l2"``) or the magnitude (``"l1"``) of an entry, is
    clamped to ``[2**-120, 2**100]`` unless the entry is zero or not finite (then the
    statistic is not finite either, and the scale is kept): a sum of up to 2**20 terms stays
    finite and none is flushed. The statistic is exact when every sampled entry is within
    ``[2**-60, 2**50]`` in magnitude (``"l1"``: ``[2**-120, 2**100]``; float16 and FP8 data
    always are); beyond, it is a bound that moves the data towards that range without
    overshooting unit size (a later rescale finishes). One reduction with nothing after it
    but scalar work is one kernel, fused with the sampling and the producer of ``data``, and
    on sharded data one all-reduce (a maximum followed by a normalised sum would be two
    dependent ones).
    """
    if norm == "max":
        return jnp.max(jnp.abs(data)).astype(np.float32)
    mean = _one_pass_mean(data, norm)
    return jnp.sqrt(mean) if norm == "l2" else mean


def _batch_statistics(samples: list[Array], norm: Norm, work, one_pass: bool) -> list[Array]:
    """The statistic of each sample.

    With ``one_pass`` (samples of the policy's statistics, float32) each is
    :func:`_one_pass_statistic`: one reduction per sample, which XLA fuses with the sampling,
    and whose all-reduces on sharded data it combines (:func:`_joined`); stacking the samples
    into one matrix would all-gather each sharded one. Otherwise each is the exact
    statistic of :func:`dynamic_rescale`.
    """
    if one_pass and not callable(norm) and np.dtype(work) == np.float32:
        return [_one_pass_statistic(d, norm) for d in samples]
    norm_fn = norm_function(norm)
    return [norm_fn(d.astype(work)) for d in samples]


def rescale_scaled_arrays(
    xs: list[ScaledArray],
    norm: Norm = "l2",
    sample_size: int | None = 1024,
    *,
    rounding_mode: Pow2RoundMode | None = None,
    min_scale: float | None = None,
    sparse_stay_down: bool = False,
    one_pass: bool | None = None,
) -> list[ScaledArray]:
    """:func:`rescale_scaled_array` of several ``ScaledArray`` at once, their statistics computed together.

    The statistics of the (sampled) data are computed together (:func:`_batch_statistics`),
    so that on sharded data their all-reduces are combined into a few; each factor is then
    computed on its tensor's scalars (:func:`_joined`). ``norm`` is ``"l1"``, ``"l2"``,
    ``"max"`` or a callable; ``rounding_mode`` defaults to the configured one. ``one_pass``
    (default: where the data are sampled) takes :func:`_one_pass_statistic` of float32 data:
    one reduction, exact for entries in ``[2**-60, 2**50]``.

    The policy's own case (sampled RMS, float32 scales, rounding up or down) rounds each
    statistic to a power of two in the kernel of its reduction (:func:`_pow2_rms_of_means`) and moves
    it into the scale in a dozen scalar operations (:func:`_moved_scales`), which XLA copies
    into every kernel that reads the new scale: fewer compiled instructions than rounding
    after the reduction. The scalar arithmetic of a batch takes :func:`_rescaled_rows`.
    """
    if not xs:
        return []
    config = get_scalify_config()
    mode = config.rounding_mode if rounding_mode is None else rounding_mode
    if (
        len(xs) < 2
        and sample_size is None
        and min_scale is None
        and rounding_mode is None
        and not callable(norm)
        and not one_pass
    ):
        return [_rescale_whole(xs[0], norm)]
    samples = [strided_sample(jax.lax.stop_gradient(x.data), sample_size) for x in xs]
    peaks = [_relative_peak(x) if sample_size is not None else None for x in xs]
    floored = [sparse_stay_down and sample_size is not None and _has_sparse_floor(x, d) for x, d in zip(xs, samples)]
    work = np.float64 if any(np.dtype(d.dtype) == np.float64 for d in samples) else np.float32
    if _rms_path(xs, norm, sample_size, min_scale, mode, work):
        up = mode == Pow2RoundMode.UP
        fractions = [d for d, z in zip(samples, floored) if z]
        stats = batched_statistics(
            samples + fractions, ["mean_square"] * len(samples) + ["zero_fraction"] * len(fractions)
        )
        means, zeros = stats[: len(samples)], iter(stats[len(samples) :])
        floors = [_sparse_floor(next(zeros)) if z else None for z in floored]
        bounds = [column for column in (_column_or_none(peaks), _column_or_none(floors)) if column is not None]
        has_peak, has_floor = any(p is not None for p in peaks), any(f is not None for f in floors)

        def moved(scale, mean, *bound):
            peak = bound[0] if has_peak else None
            floor = bound[-1] if has_floor else None
            return _moved_scales(scale, _pow2_rms_of_means(mean, up, peak, floor))

        return _rescaled_rows(xs, moved, means, *bounds)
    floors = [_sparse_floor(jnp.mean((d == 0).astype(np.float32))) if z else None for d, z in zip(samples, floored)]
    stats = _batch_statistics(samples, norm, work, one_pass=sample_size is not None if one_pass is None else one_pass)
    stats = [stat if peak is None else _at_least(stat, peak) for stat, peak in zip(stats, peaks)]
    stats = [stat if floor is None else _at_least(stat, floor) for stat, floor in zip(stats, floors)]
    scales = [jnp.asarray(as_scale(x.scale)) for x in xs]
    if len(xs) > 1 and min_scale is None and all(_exponent_path(t, s, mode) for t, s in zip(stats, scales)):
        return _moved_together(xs, stats, mode == Pow2RoundMode.UP)
    stats = _joined(stats)
    outs = []
    for stat, x in zip(stats, xs):
        scale = jnp.asarray(as_scale(x.scale))
        if min_scale is None and _exponent_path(stat, scale, mode):
            inverse, new_scale = _pow2_rescale_exponents(stat, scale, mode == Pow2RoundMode.UP)
        else:
            factor = rescale_factor(stat, scale, mode, min_scale)
            inverse, new_scale = 1 / factor, scale * factor
        outs.append(ScaledArray(mul_data(x.data, inverse), new_scale))
    return outs


def _moved_together(xs: list[ScaledArray], stats: list[Array], up: bool) -> list[ScaledArray]:
    """Each ``x`` with its statistic moved into its scale by :func:`_pow2_rescale_exponents`, as one batch."""
    return _rescaled_rows(xs, lambda scale, stat: _pow2_rescale_exponents(stat, scale, up), stats)


def _rescaled_rows(xs: Sequence[ScaledArray], fn: Callable, *columns: Sequence[Array]) -> list[ScaledArray]:
    """Each ``x`` with its data multiplied by ``inverse`` and ``new_scale`` as scale, ``(inverse, new_scale) = fn(scale, *row)``.

    ``fn`` is elementwise; :func:`~jax_scalify.core.pow2.map_scalars` applies it in the form
    each compiler wants for a batch of tensors.
    """
    scales = [jnp.asarray(as_scale(x.scale)) for x in xs]
    rows = map_scalars(fn, scales, *columns)
    return [ScaledArray(mul_data(x.data, inverse), new_scale) for x, (inverse, new_scale) in zip(xs, rows)]


def _column_or_none(bounds: list[Array | None]) -> list[Array] | None:
    """The per-tensor bounds (0, no bound, where a tensor has none), or None if none has one."""
    if all(b is None for b in bounds):
        return None
    return [np.float32(0) if b is None else jnp.asarray(b, np.float32) for b in bounds]


def _select(pred: Array, on_true: Array, on_false: float) -> Array:
    """``lax.select`` with the number ``on_false`` in ``on_true``'s shape and dtype (no ``jit`` equation)."""
    return jax.lax.select(pred, on_true, jax.lax.full_like(on_true, on_false))


def _joined(stats: list[Array]) -> list[Array]:
    """The statistics of a batch, each still a scalar of its own, each waiting for all of them.

    Each factor is computed on its tensor's scalars, which XLA fuses into the kernels
    applying the factor. Left at that, on sharded data each statistic's all-reduce would
    run on its own schedule instead of being combined with the batch's. Adding
    ``0 * (number of NaN statistics)``, exactly zero, keeps each factor waiting for the whole
    batch, so XLA combines the batch's all-reduces. On one device it costs a little compile
    time and saves about as much run time.
    """
    if len(stats) < 2:
        return stats
    stacked = jnp.stack(stats)
    join = np.asarray(0, stacked.dtype) * jnp.sum(jnp.isnan(stacked)).astype(stacked.dtype)
    return [stat + join for stat in stats]


_F32_EXPONENT_MASK = 0x7F800000
_F32_MANTISSA_BITS = np.int32(23)  # an int32 shift under jax_enable_x64 too (lax does not promote)
_F32_BIAS = 127


def _exponent_path(stats: Array, scales: Array, mode: Pow2RoundMode) -> bool:
    """Whether :func:`_pow2_rescale_exponents` applies: float32 statistics and scales, power-of-two rounding."""
    return (
        mode in (Pow2RoundMode.DOWN, Pow2RoundMode.UP)
        and np.dtype(stats.dtype) == np.float32
        and np.dtype(scales.dtype) == np.float32
    )


def _biased_exponent(x: Array) -> Array:
    """The exponent field of float32 ``x`` (0 for zero and subnormals, 255 for inf and nan), as int32."""
    lax = jax.lax
    return lax.shift_right_logical(
        binary(lax.bitwise_and, lax.bitcast_convert_type(x, jnp.int32), _F32_EXPONENT_MASK), _F32_MANTISSA_BITS
    )


def _from_biased_exponent(e: Array) -> Array:
    """``2**(e - 127)`` for int32 ``e`` in [1, 254]."""
    return jax.lax.bitcast_convert_type(jax.lax.shift_left(e, _F32_MANTISSA_BITS), jnp.float32)


def _pow2_rescale_exponents(stats: Array, scales: Array, up: bool, target: int = 0) -> tuple[Array, Array]:
    """``(1 / factors, scales * factors)`` of a batch rescale, computed on the float32 exponent fields.

    The same rule as :func:`rescale_factor` (the statistic rounded to a power of two moves
    into the scale; the new scale stays a normal float32; a zero, subnormal or non-finite
    statistic, or a scale that is 0, subnormal or inf, leaves the value as it is) in integer
    arithmetic: a few cheap operations without division, which XLA fuses into the kernels
    that consume the factors instead of compiling a chain of kernels of its own. With
    ``target``, the statistic moves to ``2**target`` in the data instead of to 1.
    """
    lax = jax.lax
    stat_bits = lax.bitcast_convert_type(stats, jnp.int32)
    e_stat = lax.shift_right_logical(stat_bits & _F32_EXPONENT_MASK, _F32_MANTISSA_BITS)
    e_scale = _biased_exponent(scales)
    if up:
        e_stat = e_stat + ((stat_bits & 0x007FFFFF) != 0).astype(jnp.int32)
    valid = (e_stat >= 1) & (e_stat <= 254) & (e_scale >= 1) & (e_scale <= 254)
    new_scale_exponent = lax.clamp(np.int32(1), e_scale + e_stat - (_F32_BIAS + target), np.int32(254))
    shift = _select(valid, lax.clamp(np.int32(-126), new_scale_exponent - e_scale, np.int32(126)), 0)
    return _from_biased_exponent(_F32_BIAS - shift), lax.select(valid, _from_biased_exponent(e_scale + shift), scales)


def _rms_path(xs, norm, sample_size, min_scale, mode, work) -> bool:
    """Whether the policy's statistic takes :func:`_pow2_rms_of_means` and :func:`_moved_by`: sampled RMS, float32 scales, power-of-two rounding."""
    return sample_size is not None and _pow2_rms_applies(xs, norm, min_scale, mode, work)


def _pow2_rms_applies(xs, norm, min_scale, mode, work) -> bool:
    """RMS statistic, float32 data and scales, rounding to a power of two, no minimum scale."""
    return (
        norm == "l2"
        and min_scale is None
        and mode in (Pow2RoundMode.DOWN, Pow2RoundMode.UP)
        and np.dtype(work) == np.float32
        and all(np.dtype(as_scale(x.scale).dtype) == np.float32 for x in xs)
    )


_F32_TINY = np.float32(2.0**-126)


def _relative_peak(x: ScaledArray) -> Array | None:
    """For sparse float16/FP8 data: the largest magnitude of the whole tensor over the largest the rescaled data may reach.

    A sample can miss the few entries that carry a tensor (the rows of an embedding table
    that a batch touched): moved to the size of the sampled entries, the others overflow.
    For data produced by a scatter into zeros (:func:`jax_scalify.core.sites.mark_sparse`),
    rescaled narrow data keep their largest entry at most half the dtype's largest power of
    two (``2**14`` for float16), at the cost of one reduction of the tensor. Dense data
    (every other value, where that reduction per rescale would be a large share of a step's
    run time) and wide data (float32, bfloat16: the range to hold any sampling miss) give
    ``None``.
    """
    if not (x.sparse and narrow_range(x.dtype)) or np.size(x.data) == 0:
        return None
    return largest_magnitude(jax.lax.stop_gradient(x.data)) * np.float32(1 / narrow_limit(x.dtype))


def _has_sparse_floor(x: ScaledArray, sample: Array) -> bool:
    """Whether :func:`_sparse_floor` applies: narrow data, a non-empty sample."""
    return narrow_range(x.dtype) and np.size(sample) > 0


def _sparse_floor(zero_fraction: Array) -> Array:
    """For narrow data whose sample is mostly zeros: 1 (the statistic may move the data down, not up); else 0.

    Such a value is sparse (a parameter that starts at zero and that only lookups update: a
    recommender's per-row bias), and its sample, holding the smallest of its few non-zero
    rows, would move the others past the dtype's range. Used for the values ``scalify``
    returns: a gradient needs its upward moves, and the gradient of a lookup has its own
    guard (:func:`_relative_peak`). Wide data have none (:func:`_has_sparse_floor`).
    """
    return jax.lax.convert_element_type(binary(jax.lax.gt, zero_fraction, 0.5), np.float32)


def _at_least(stat: Array, bound: Array) -> Array:
    """``max(stat, bound)`` where the statistic moves the data (positive and finite), else ``stat`` (the scale is kept)."""
    usable = (stat > 0) & jnp.isfinite(stat) & jnp.isfinite(bound)
    return jnp.where(usable, jnp.maximum(stat, bound.astype(stat.dtype)), stat)


def _pow2_rms_of_means(mean: Array, up: bool, peak: Array | None = None, floor: Array | None = None) -> Array:
    """The root mean square rounded to a power of two from the mean of the clamped squares; 1 where it is 0 or not finite.

    Elementwise: one scalar, or a batch's vector. The mean (:func:`_one_pass_statistic`,
    :func:`batched_statistics`) is rounded to a power of
    two with an even exponent, ``2**(2k)`` with ``k = floor(log2(mean) / 2)`` (``up``:
    ``ceil``), which is ``floor(log2(rms))`` (``ceil``) exactly, and the square root of that
    is ``2**k``, exact. The square root comes last on purpose: XLA computes it once, with
    the reduction, instead of copying the rounding into every kernel that reads the factor
    (as it does with cheap scalar operations). A mean below ``2**-126`` is taken as
    ``2**-126`` (an RMS below ``2**-63`` moves the data towards unit size without reaching
    it), so ``k`` is in ``[-63, 64]``. With a ``peak`` (:func:`_relative_peak`), the factor
    is at least ``peak`` rounded up to a power of two.
    """
    lax = jax.lax
    usable = lax.bitwise_and(lax.gt(mean, np.float32(0)), lax.lt(mean, np.float32(np.inf)))
    exponent = lax.sub(_biased_exponent(lax.max(mean, _F32_TINY)), np.int32(_F32_BIAS))
    if up:  # ceil(log2(mean)): one more unless the mean is a power of two
        inexact = lax.ne(lax.bitwise_and(lax.bitcast_convert_type(mean, jnp.int32), np.int32(0x007FFFFF)), np.int32(0))
        exponent = lax.add(exponent, lax.convert_element_type(inexact, jnp.int32))
        exponent = lax.add(exponent, np.int32(1))
    half = lax.shift_right_arithmetic(exponent, np.int32(1))  # floor(e / 2); ceil(e / 2) with the + 1 above
    even_power = _from_biased_exponent(lax.add(lax.add(half, half), np.int32(_F32_BIAS)))
    if peak is not None:  # callers keep it at most 2**60: its square is a normal float32
        bound = pow2_round_up(peak)
        bound = _select(lax.lt(peak, np.float32(np.inf)), lax.mul(bound, bound), 0)
        even_power = lax.max(even_power, bound)
    if floor is not None:  # 0 or 1: a power of two's square
        even_power = lax.max(even_power, floor)
    return lax.sqrt(_select(usable, even_power, 1))


def _moved_by(x: ScaledArray, factor: Array) -> ScaledArray:
    """``x`` with the power of two ``factor`` (in ``[2**-63, 2**64]``) moved from its data into its scale.

    The new scale is kept within float32's normal range (the factor is clipped where it
    would leave it), and a scale that is 0, subnormal or not finite is left as it is.
    """
    inverse, new_scale = _moved_scales(jnp.asarray(as_scale(x.scale)), factor)
    return ScaledArray(mul_data(x.data, inverse), new_scale)


def _moved_scales(scale: Array, factor: Array) -> tuple[Array, Array]:
    """``(1 / factor, new scale)`` of :func:`_moved_by`, elementwise (one scalar, or a batch's vector)."""
    lax = jax.lax
    usable = lax.bitwise_and(lax.ge(scale, _F32_TINY), lax.lt(scale, np.float32(np.inf)))
    new_scale = lax.min(lax.max(lax.mul(scale, factor), _F32_TINY), np.float32(2.0**127))
    as_int = lambda v: lax.bitcast_convert_type(v, jnp.int32)
    inverse = lax.bitcast_convert_type(
        lax.add(lax.sub(as_int(scale), as_int(new_scale)), np.int32(_F32_BIAS << 23)), jnp.float32
    )
    return _select(usable, inverse, 1), lax.select(usable, new_scale, scale)


def rescaled_into_narrow(x: ScaledArray, dtype: Any, norm: Norm, sample_size: int | None = None) -> ScaledArray:
    """``x`` (wide data) with the statistic of all its data moved into its scale, cast to the narrow ``dtype`` without overflow.

    For values computed in float32 to be stored in float16/FP8 (the backward sums of
    :func:`jax_scalify.core.sites.rescaled_into`). Their largest entry must be
    bounded anyway, which reads the whole tensor; the mean square of all of it comes from
    the same reduction (:func:`batched_statistics`) and, unlike a sample, cannot miss the few
    entries that carry the tensor (a sampled RMS far below the tensor's leaves narrow data
    that the products after the sum overflow). The largest entry is kept at most half the
    dtype's largest power of two. Zero data and data holding inf or nan keep their scale.
    The squares are plain, with no clamp per entry: the largest magnitude guards the
    statistic (:func:`_mean_beside_largest`), and plain squares are what XLA reads straight
    from the producer of ``x`` (a clamp per entry makes XLA write out a float32 copy of the
    terms). Other statistics and roundings take the sampled rescale of the policy, then the
    bound.
    """
    mode = get_scalify_config().rounding_mode
    if not (_pow2_rms_applies([x], norm, None, mode, np.float32) and np.size(x.data) > 0):
        return narrowed_within_range(rescale_scaled_arrays([x], norm, sample_size)[0], dtype)
    data = jax.lax.convert_element_type(jax.lax.stop_gradient(x.data), np.float32)
    mean, largest = batched_statistics([data, data], ["exact_mean_square", "max"])
    mean = _mean_beside_largest(mean, largest)
    peak = binary(jax.lax.min, binary(jax.lax.mul, largest, float(1 / narrow_limit(dtype))), 2.0**60)
    out = _moved_by(x, _pow2_rms_of_means(mean, mode == Pow2RoundMode.UP, peak))
    return ScaledArray(out.data.astype(dtype), out.scale)


def _mean_beside_largest(mean: Array, largest: Array) -> Array:
    """The ``"exact_mean_square"`` of data made ready for :func:`_pow2_rms_of_means` by the data's largest magnitude.

    0 (the scale is kept) where ``largest`` is 0 or not finite. Otherwise at least
    ``2**-126``: squares that all underflowed (data below ``2**-63``) move the data up by
    ``2**63``, towards unit size; a sum of squares beyond float32's range leaves the factor
    to the bound on the largest entry.
    """
    lax = jax.lax
    nonzero_and_finite = lax.bitwise_and(lax.gt(largest, np.float32(0)), lax.lt(largest, np.float32(np.inf)))
    finite_mean = _select(lax.lt(mean, np.float32(np.inf)), mean, 0)
    return _select(nonzero_and_finite, lax.max(finite_mean, _F32_TINY), 0)


STORAGE_TOP_EXPONENT = 14


def _storage_target(dtype: Any) -> int:
    return min(int(np.log2(narrow_limit(dtype))), STORAGE_TOP_EXPONENT)


def _storable(x: ScaledArray) -> bool:
    """Float32 data, a float32 scalar scale, at least one entry: what the batched exponent path takes."""
    return (
        np.size(x.data) > 0
        and np.ndim(x.scale) == 0
        and np.dtype(x.data.dtype) == np.float32
        and np.dtype(as_scale(x.scale).dtype) == np.float32
    )


def narrowed_for_storage(
    xs: Sequence[ScaledArray], dtypes: Sequence[Any], unit_rms: Sequence[ScaledArray] = ()
) -> tuple[list[ScaledArray], list[ScaledArray]]:
    """Each ``x`` (float32 data) cast to its ``dtype``, its largest entry moved to ``(2**(t-1), 2**t]``; and ``unit_rms`` rescaled.

    For values stored and read back, never computed on in ``dtype`` (optimizer state).
    ``2**t`` is :func:`narrow_limit` of ``dtype``, at most ``2**14`` (float16 and E5M2:
    ``2**14``, E4M3: ``2**7``): every entry keeps as many binades above the dtype's
    subnormals as it can without overflow. (Placed by its root mean square, an entry more
    than ``2**16`` times the RMS would overflow float16, and every entry would sit
    ``2**14 * RMS / max`` times nearer the subnormals.) The statistic is the largest
    magnitude, exact for every float32 value. All-zero data get scale 0 (asserted zero),
    so "all zero" can be read from the scale. Non-finite or float32-subnormal data, and a
    scale that is 0, subnormal or inf, keep their scale.

    Each of ``unit_rms`` (float32 data that are computed on next: an optimizer's updates)
    gets its root mean square as scale, rounded with the configured mode; the mean of the
    clamped squares of :func:`_one_pass_statistic` is exact for entries in
    ``[2**-60, 2**50]``. The statistics of small tensors of one shape are one reduction
    (:func:`batched_statistics`); the exponent arithmetic is :func:`_rescaled_rows`.
    """
    mode = get_scalify_config().rounding_mode
    batched = [i for i, x in enumerate(xs) if _storable(x)]
    unit = [i for i, x in enumerate(unit_rms) if _storable(x) and mode in (Pow2RoundMode.DOWN, Pow2RoundMode.UP)]
    stored = [x if _storable(x) else narrowed_within_range(x, dtypes[i]) for i, x in enumerate(xs)]
    rescaled = list(unit_rms)
    if len(unit) < len(unit_rms):
        others = sorted(set(range(len(unit_rms))) - set(unit))
        for i, x in zip(others, rescale_scaled_arrays([unit_rms[i] for i in others], "l2", None, one_pass=True)):
            rescaled[i] = x
    datas = [jax.lax.stop_gradient(xs[i].data) for i in batched] + [
        jax.lax.stop_gradient(unit_rms[i].data) for i in unit
    ]
    stats = batched_statistics(datas, ["max"] * len(batched) + ["mean_square"] * len(unit))
    if batched:
        targets = [np.int32(_storage_target(dtypes[i])) for i in batched]
        moved = _rescaled_rows([xs[i] for i in batched], _moved_to_storage, stats[: len(batched)], targets)
        for k, x in zip(batched, moved):
            stored[k] = ScaledArray(x.data.astype(dtypes[k]), x.scale)
    if unit:
        up = mode == Pow2RoundMode.UP
        moved = _rescaled_rows(
            [unit_rms[i] for i in unit],
            lambda scale, mean: _moved_scales(scale, _pow2_rms_of_means(mean, up)),
            stats[len(batched) :],
        )
        for k, x in zip(unit, moved):
            rescaled[k] = x
    return stored, rescaled


def _moved_to_storage(scale: Array, peak: Array, target: Array) -> tuple[Array, Array]:
    """``(inverse, new_scale)`` putting the largest entry ``peak`` in ``(2**(target-1), 2**target]``; scale 0 for zero data."""
    inverse, new_scale = _pow2_rescale_exponents(peak, scale, up=True, target=target)
    return inverse, _select(jax.lax.ne(peak, jnp.zeros_like(peak)), new_scale, 0)


def rebalanced(x: ScaledArray, factor: Array) -> ScaledArray:
    """``x`` with its data divided by the power of two ``factor`` and its scale multiplied by it (exact)."""
    factor = as_scale(factor)
    return ScaledArray(mul_data(x.data, 1 / factor), as_scale(x.scale) * factor)
