"""Optimizer state stored in FP16 or FP8 with power-of-two scales, for any Optax transformation.

:func:`scale_state` wraps an Optax ``GradientTransformation`` (Adam, AdamW, AdaBelief, Lion,
SGD with momentum, chains, schedules, ``inject_hyperparams`` ...) without changing it or
its hyperparameters:

- the state is stored as ``ScaledArray(data, scale)`` leaves whose data has the storage
  dtype (float16 by default), the largest entry at the top of its range;
- the inner update runs on plain float32 values (``data * scale`` of the stored state and
  of the gradients), so ``eps = 1e-8`` or ``1e-16`` and the bias corrections are what they
  are in FP32, and no scale arithmetic runs beside Optax's;
- the new state is narrowed again, its largest entry at the top of the range (one reduction
  per array, those of small arrays of one shape together); the outgoing updates get their
  RMS as scale (one reduction each), so the parameters' scales follow their data whatever
  the gradients' propagated scales were.

Example (scaled FP16 weights, gradients and Adam moments)::

    import jax, jax.numpy as jnp, optax
    import jax_scalify as jsa

    tx = jsa.optim.scale_state(optax.adamw(1e-3), jnp.float16)
    params = jsa.tree.astype(jsa.as_scaled_array(params32), jnp.float16)
    opt_state = tx.init(params)

    @jax.jit
    @jsa.scalify
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .core.array import ScaledArray, asarray, is_concrete, is_floating_dtype, is_scaled_leaf, unscaled
from .core.custom_scale import custom_scale
from .core.interpreter import is_tracing_user_code, scalify
from .core.measure import Norm, narrowed_for_storage
from .core.pow2 import binary, pow2_twice_reciprocal
from .core.scaling import select
from .core.sites import mark_rescaled
from .lax.primitives import rebalance, set_scaling, stop_scaling
from .ops.rescaling import dynamic_rescale

PyTree = Any
DTypeLike = Any
KeyPath = tuple

WORK_DTYPE = np.dtype(np.float32)


def _field_names(path: KeyPath) -> list[str]:
    """The names of the state fields (Optax's namedtuple attributes) on the path to a leaf, outermost first."""
    return [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]


def _is_divisor(path: KeyPath) -> bool:
    return any(name in DIVISOR_FIELDS for name in _field_names(path))


class _Storage(NamedTuple):
    """How the state is stored: the dtype of each floating leaf and the rescale statistic."""

    dtype: np.dtype
    field_dtypes: Mapping[str, np.dtype]
    rescale: Norm | None

    def dtype_at(self, path: KeyPath) -> np.dtype:
        """The storage dtype of the leaf at ``path``: the first state field named in ``field_dtypes``."""
        for name in _field_names(path):
            if name in self.field_dtypes:
                return self.field_dtypes[name]
        return self.dtype


SECOND_MOMENT_FIELDS = ("nu",)  # Optax's name for Adam's, AdamW's, AdaBelief's second moment
# The state fields Optax's transformations divide by (second moments, sums of squares): a
# stored 0 there turns a small first moment into a huge step (_plain_zeros_to_smallest_subnormal).
DIVISOR_FIELDS = ("nu", "nu_max", "sum_of_squares", "v_row", "v_col", "v", "e_g")
MIN_SECOND_MOMENT_MANTISSA_BITS = 10


def _warn_if_second_moment_too_narrow(state: PyTree, storage: _Storage) -> None:
    """A second moment's EMA (``b2 = 0.999``) moves by 0.1% a step: below 10 mantissa bits it stalls."""
    narrow = set()

    def check(path, x):
        dtype = storage.dtype_at(path)
        if _is_narrowed(x) and any(n in SECOND_MOMENT_FIELDS for n in _field_names(path)):
            if jnp.finfo(dtype).nmant < MIN_SECOND_MOMENT_MANTISSA_BITS:
                narrow.add(np.dtype(dtype).name)

    jax.tree_util.tree_map_with_path(check, state)
    if narrow:
        warnings.warn(
            f"jsa.optim.scale_state: the second moment (nu) is stored in {', '.join(sorted(narrow))}. "
            "Its EMA with b2 = 0.999 changes by about 0.1% a step, below the rounding step of formats "
            "with fewer than 10 mantissa bits, so it stalls (measured: bfloat16 +33% bias, FP8 -85%, "
            "E4M3 also flushes small entries to zero, giving huge steps). Store it in float16: "
            "field_dtypes={'nu': jnp.float16}.",
            stacklevel=3,
        )


# Mechanic (optax.contrib.mechanize) keeps EMAs with betas up to 0.999999 and the initial
# parameters, whose difference from the current ones it uses: below float32 they stall.
MECHANIC_FIELDS = ("r", "m", "v", "s", "x0")


def _warn_if_mechanic_state_too_narrow(state: PyTree, storage: _Storage) -> None:
    """Mechanic's own state stored below float32 trains nothing (measured): say so and how to store it."""
    narrow = set()

    def check(x):
        if isinstance(x, optax.contrib.MechanicState):
            for name in MECHANIC_FIELDS:
                for path, leaf in jax.tree_util.tree_flatten_with_path(getattr(x, name))[0]:
                    dtype = storage.dtype_at((jax.tree_util.GetAttrKey(name), *path))
                    if _is_narrowed(leaf) and np.dtype(dtype).itemsize < WORK_DTYPE.itemsize:
                        narrow.add(np.dtype(dtype).name)
        return x

    jax.tree.map(check, state, is_leaf=lambda x: isinstance(x, optax.contrib.MechanicState))
    if narrow:
        warnings.warn(
            f"jsa.optim.scale_state: optax.contrib.mechanize's own state is stored in {', '.join(sorted(narrow))}. "
            "Its EMAs (betas up to 0.999999) move below the rounding step of 16-bit formats and it uses the "
            "difference between the parameters and a stored copy of the initial ones, so it stalls: measured "
            "on an MLP, the loss stays at its initial value unless r, m, v, s and x0 are all float32. Store "
            "them so: field_dtypes={name: jnp.float32 for name in ('r', 'm', 'v', 's', 'x0')} (the wrapped "
            "optimizer's moments can stay float16).",
            stacklevel=3,
        )


def _floating_dtype(dtype: DTypeLike, what: str) -> np.dtype:
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"jsa.optim.scale_state: {what} must be a floating dtype, got {dtype!r}.") from None
    if not is_floating_dtype(dtype) or dtype.itemsize > 4:
        raise TypeError(
            f"jsa.optim.scale_state: {what} must be a floating dtype of at most 32 bits "
            f"(jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float32), got {dtype}. "
            "Integer state such as step counts is never cast: it keeps its own dtype."
        )
    return dtype


def _is_narrowed(x: Any) -> bool:
    """Floating arrays of at least one dimension are stored scaled; scalars and the rest are left alone."""
    return hasattr(x, "dtype") and is_floating_dtype(x.dtype) and np.ndim(x) > 0


def _is_floating(x: Any) -> bool:
    return hasattr(x, "dtype") and is_floating_dtype(x.dtype)


def _widen(tree: PyTree) -> PyTree:
    """Floating leaves cast to float32 (scaled ones keep their scale); others untouched."""
    return jax.tree.map(lambda x: x.astype(WORK_DTYPE) if _is_floating(x) else x, tree)


def _compiled_when_concrete(fn):
    """``fn`` under ``jax.jit`` when every leaf of its argument is a concrete array, else ``fn`` itself.

    ``init`` is usually called eagerly, before the first step: run op by op, its storing
    (a statistic, a rescale and a cast per state tensor) would compile one small program per
    operation and shape. A tree with other leaves (Python objects a custom state keeps) or
    traced ones (``init`` inside a trace) goes through ``fn`` as it is.
    """
    compiled = jax.jit(fn)

    def run(tree: PyTree) -> PyTree:
        return compiled(tree) if all(map(is_concrete, jax.tree.leaves(tree))) else fn(tree)

    return run


@_compiled_when_concrete
def _widened_values(params: PyTree) -> PyTree:
    """Float32 values of ``params`` (scaled leaves as ``data * scale``), what ``inner.init`` sees."""
    return _widen(asarray(params))


def _plain_zeros_to_smallest_subnormal(x: Any, dtype: np.dtype) -> Any:
    """``x`` with its zeros replaced by ``dtype``'s smallest subnormal: a floor under a widened divisor.

    Applied when widening rather than when storing: any later rescale of the stored data
    (the rescale policy's, on the returned state) may round a stored floor to 0 again. Why
    the floor: ``scale_state``'s docstring, "Small entries". Only zeros move, so signs are
    kept: Optax's divisors are non-negative (there this is ``max(x, tiny)``), and a signed
    field that merely shares a divisor's name (SM3's momentum ``nu``, Adan's ``v``) changes
    by at most the rounding error of float16 data at that scale.

    An all-zero tensor keeps its zeros: they are values, not underflows (a moment that a
    conditional update left at zero, as SAM's adversarial steps leave Adam's), and its scale,
    which no value set, would make the floor arbitrary.
    """
    return _zeros_floored(x, dtype, jnp.any(x != 0))


def _zeros_floored(x: Any, dtype: np.dtype, has_values: Any) -> Any:
    """The zeros of ``x`` raised to ``dtype``'s smallest subnormal where ``has_values``, else kept."""
    tiny = jnp.asarray(jnp.finfo(dtype).smallest_subnormal, x.dtype)
    return jnp.where(x == 0, jnp.where(has_values, tiny, jnp.zeros((), x.dtype)), x)


_zeros_to_smallest_subnormal = custom_scale(_plain_zeros_to_smallest_subnormal, static_argnums=(1,))


@_zeros_to_smallest_subnormal.defscale
def _zeros_to_smallest_subnormal_rule(x: ScaledArray, dtype: np.dtype) -> ScaledArray:
    """On the stored data (in units of its scale), which is where ``dtype`` rounded; the scale is kept.

    A stored tensor is all zeros exactly when its scale is 0 (:func:`_store`): no reduction.
    """
    return ScaledArray(_zeros_floored(x.data, dtype, x.scale != 0), x.scale)


def _values(tree: PyTree) -> PyTree:
    """Floating leaves as plain float32 values (``data * scale``); others untouched. Runs under scalify.

    The inner transformation computes in float32, whose range holds every value a
    narrow scaled leaf holds: on plain values its arithmetic is exactly Optax's in float32,
    with no scale arithmetic beside it.
    """
    return jax.tree.map(lambda x: stop_scaling(x, WORK_DTYPE) if _is_floating(x) else x, tree)


def _state_values(state: PyTree) -> PyTree:
    """The stored state as float32 values, the fields Optax divides by kept off zero (see above)."""

    def widen(path, x):
        if not _is_floating(x):
            return x
        if _is_narrowed(x) and _is_divisor(path) and np.dtype(x.dtype).itemsize < WORK_DTYPE.itemsize:
            x = _zeros_to_smallest_subnormal(x.astype(WORK_DTYPE), np.dtype(x.dtype))
        return stop_scaling(x, WORK_DTYPE)

    return jax.tree_util.tree_map_with_path(widen, state)


_stored = custom_scale(
    lambda xs, dtypes, updates: ([x.astype(d) for x, d in zip(xs, dtypes)], updates), static_argnums=(1,)
)


@_stored.defscale
def _stored_rule(xs: list[ScaledArray], dtypes: tuple[np.dtype, ...], updates: list[ScaledArray]) -> tuple:
    """:func:`~jax_scalify.core.measure.narrowed_for_storage`: the state at the top of its dtype's range, the updates at unit RMS."""
    stored, rescaled = narrowed_for_storage(xs, dtypes, updates)
    return [mark_rescaled(x) for x in stored], rescaled


def _store(state: PyTree, storage: _Storage, updates: PyTree = None) -> tuple[PyTree, PyTree]:
    """Narrow every array leaf of a float32 state for storage, and rescale the float32 ``updates``. Runs under scalify.

    The state's largest entries and the updates' root mean squares are measured together
    (:func:`~jax_scalify.core.measure.narrowed_for_storage`): one reduction per array, those
    of small arrays of one shape together. Floating scalars stay plain. ``rescale=None``: everything at
    scale 1; other statistics than ``"l2"``: the updates through ``dynamic_rescale``.
    """
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    leaves = [stop_scaling(x) if _is_floating(x) and not _is_narrowed(x) else x for _, x in paths_leaves]
    where = [i for i, x in enumerate(leaves) if _is_narrowed(x)]
    dtypes = tuple(np.dtype(storage.dtype_at(paths_leaves[i][0])) for i in where)
    update_leaves, update_def = jax.tree.flatten(updates)
    moved = [i for i, u in enumerate(update_leaves) if _is_narrowed(u)]
    one = np.float32(1)
    if storage.rescale is None:
        stored = [rebalance(leaves[i], one).astype(d) for i, d in zip(where, dtypes)]
        rescaled = [rebalance(update_leaves[i], one) for i in moved]
    else:  # promoted to scaled arrays, so that the rule applies
        joint = storage.rescale == "l2" and all(np.dtype(update_leaves[i].dtype) == WORK_DTYPE for i in moved)
        together = [rebalance(update_leaves[i], one) for i in moved] if joint else []
        stored, rescaled = _stored([rebalance(leaves[i], one) for i in where], dtypes, together)
        if not joint:
            rescaled = dynamic_rescale([update_leaves[i] for i in moved], storage.rescale)
    for i, x in zip(where, stored):
        leaves[i] = x
    for i, x in zip(moved, rescaled):
        update_leaves[i] = x
    return jax.tree.unflatten(treedef, leaves), jax.tree.unflatten(update_def, update_leaves)


def _assert_zero_or_unit(x: Any) -> Any:
    """Scale 0 for an all-zero array ("asserted zero": a sum takes the other operand's scale), else 1."""
    if not _is_narrowed(x):
        return x
    x = x.astype(WORK_DTYPE)
    return set_scaling(x, jnp.where(jnp.any(x != 0), 1.0, 0.0).astype(WORK_DTYPE))


def _check_inner(inner: Any) -> None:
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise TypeError(
            "jsa.optim.scale_state wraps an Optax GradientTransformation (an object with init and "
            f"update, e.g. optax.adam(1e-3)), got {type(inner).__name__}."
        )


def _check_stored(state: PyTree, storage: _Storage, outside_scalify: bool) -> None:
    """The state must come from this transformation's ``init`` (or a previous ``update``)."""

    def check(path, x):
        where = jax.tree_util.keystr(path)
        if _is_floating(x) and np.ndim(x) == 0 and jnp.finfo(x.dtype).bits < 32:
            raise ValueError(
                f"jsa.optim.scale_state: the optimizer state leaf {where} is a {x.dtype} scalar. The "
                "state's floating scalars (hyperparameters of optax.inject_hyperparams, step sizes) are "
                "kept in float32, and a cast rounds them (b2 = 0.999 becomes 0.9990234375 in float16). "
                "Pass the state returned by tx.init(params) as it is: cast the parameters, not the "
                "optimizer state (jsa.tree.astype on the whole state casts its scalars too)."
            )
        if not _is_narrowed(x):
            return
        expected = storage.dtype_at(path)
        if outside_scalify and not isinstance(x, ScaledArray):
            raise ValueError(
                f"jsa.optim.scale_state: the optimizer state leaf {where} is a plain {x.dtype} array; "
                "pass the state returned by the wrapped transformation's init (tx.init(params)), not the "
                "inner optimizer's."
            )
        if np.dtype(x.dtype) != expected:
            raise ValueError(
                f"jsa.optim.scale_state: the optimizer state leaf {where} has dtype {x.dtype}, expected "
                f"the storage dtype {expected}; pass the state returned by the wrapped transformation's "
                "init (tx.init(params)), not the inner optimizer's."
            )

    jax.tree_util.tree_map_with_path(check, state, is_leaf=is_scaled_leaf)


def _check_compensated(state: PyTree, params: PyTree | None) -> None:
    if not isinstance(state, CompensatedState):
        raise ValueError(
            "jsa.optim.scale_state: the optimizer state is not a CompensatedState; pass the state returned "
            "by this transformation's init (tx.init(params)), not the inner optimizer's, or wrap with "
            "compensate=False to keep the inner state's structure."
        )
    if params is None:
        raise ValueError(
            "jsa.optim.scale_state: update needs the parameters: tx.update(grads, opt_state, params). "
            "It carries forward the part of each update that float16 (or other narrow) parameters round "
            "away (compensate=True). With float32 parameters, scale_state(..., compensate=False) does "
            "without them."
        )


def _cast_like(new: PyTree, old: PyTree) -> PyTree:
    """Updates cast back to the dtypes of the incoming updates (what ``optax.apply_updates`` expects)."""
    try:
        return jax.tree.map(lambda u, g: u.astype(g.dtype) if _is_floating(u) and _is_floating(g) else u, new, old)
    except ValueError:  # the inner transformation changed the tree structure: leave it to it
        return new


class CompensatedState(NamedTuple):
    """The state of :func:`scale_state` with ``compensate=True``.

    Attributes:
        inner: the wrapped transformation's state, stored scaled.
        residual: per parameter, the part of the updates that the parameter's dtype could
            not take yet (``params + updates`` rounds it away); added to the next update.

    Other attributes are read from ``inner``, so code written for the wrapped state keeps
    working: ``opt_state.hyperparams["learning_rate"]`` of ``optax.inject_hyperparams``,
    ``opt_state.inner_state`` of ``optax.MultiSteps``.
    """

    inner: PyTree
    residual: PyTree

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return getattr(self.inner, name)
        except AttributeError:
            raise AttributeError(
                f"'CompensatedState' object has no attribute {name!r}, nor has the state it wraps "
                f"({type(self.inner).__name__}): jsa.optim.scale_state's state holds the wrapped "
                "transformation's state in .inner and the carried update remainders in .residual."
            ) from None


def _is_narrow_param(p: Any) -> bool:
    return _is_floating(p) and np.dtype(p.dtype).itemsize < WORK_DTYPE.itemsize


def _plain_carry(update: jax.Array, residual: jax.Array, param: jax.Array, residual_dtype: np.dtype) -> tuple:
    """``(applied, residual')``: the update ``param + applied`` takes exactly, and what is left of it.

    ``target`` is ``param + update + residual`` rounded once to the parameter's dtype; the
    returned update is ``target - param`` (a difference of neighbours on the parameter's
    grid: exact), so ``optax.apply_updates`` lands on ``target``, and the rest is carried to
    the next step instead of being rounded away step after step.
    """
    total = update.astype(WORK_DTYPE) + residual.astype(WORK_DTYPE)
    target = (param.astype(WORK_DTYPE) + total).astype(param.dtype)
    applied = (target.astype(WORK_DTYPE) - param.astype(WORK_DTYPE)).astype(update.dtype)
    return applied, (total - applied.astype(WORK_DTYPE)).astype(residual_dtype)


_carry = custom_scale(_plain_carry, static_argnums=(3,))


@_carry.defscale
def _carry_rule(
    update: ScaledArray, residual: ScaledArray, param: ScaledArray, residual_dtype: np.dtype
) -> tuple[ScaledArray, Any]:
    """On the data, in units of the parameter's scale (its grid), where its dtype rounds.

    The applied update is on the parameter's grid: its data are ``target - param`` in units
    of the parameter's scale (exact where an entry moves by at most half its size, as
    updates do; otherwise the cast's rounding stays in the residual), its scale is the
    parameter's, and it says so (``grid_of``): the sum in ``optax.apply_updates`` then aligns
    nothing and lands on ``target``. A parameter with scale 0 (asserted zero)
    takes the grid of the update's scale, which the sum then takes too. The residual, at most
    half a unit in the last place of the parameter, is stored at ``scale(param) *
    eps(param.dtype) / 2`` (static scales: no statistic).
    """
    lax = jax.lax
    f32 = lambda x: lax.convert_element_type(x, WORK_DTYPE)  # noqa: E731
    add, sub, mul = (functools.partial(binary, op) for op in (lax.add, lax.sub, lax.mul))
    one = np.float32(1)
    update_scale = select(binary(lax.gt, f32(update.scale), 0.0), f32(update.scale), one)
    has_grid = binary(lax.gt, f32(param.scale), 0.0)
    grid = select(has_grid, f32(param.scale), update_scale)
    total = add(mul(f32(update.data), f32(update.scale)), mul(f32(residual.data), f32(residual.scale)))
    param_units = mul(f32(param.data), select(has_grid, one, np.float32(0)))  # scale 0: the value is 0
    target_units = lax.convert_element_type(add(param_units, _over(total, grid)), param.dtype)
    applied_data = lax.convert_element_type(sub(f32(target_units), param_units), update.dtype)
    applied = ScaledArray.unchecked(applied_data, grid, grid_of=param.scale)
    left = sub(total, mul(f32(applied_data), grid))
    if np.ndim(left) == 0:
        return applied, lax.convert_element_type(left, residual_dtype)
    unit = mul(grid, float(jnp.finfo(param.dtype).eps))  # an ulp of parameter data in [1, 2)
    residual_scale = lax.clamp(jnp.finfo(WORK_DTYPE).tiny, mul(unit, 0.5), jnp.finfo(WORK_DTYPE).max)
    residual = ScaledArray(lax.convert_element_type(_over(left, residual_scale), residual_dtype), residual_scale)
    return applied, mark_rescaled(residual)  # its bound is its scale


def _over(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``x / scale`` for a power-of-two ``scale``, as ``x * (2 / scale) * 0.5`` with ``2 / scale`` from its bits.

    Exact (``2 / scale`` is normal for every normal scale), and no scalar division: XLA
    compiles one as a kernel of its own.
    """
    return binary(jax.lax.mul, binary(jax.lax.mul, x, pow2_twice_reciprocal(scale)), 0.5)


def _compensated_leaf(update: Any, residual: Any, param: Any, dtype: np.dtype) -> tuple[Any, Any]:
    """:func:`_carry` where the parameter is narrower than float32; other leaves unchanged."""
    if update is None or not _is_narrow_param(param) or not _is_floating(update):
        return update, residual
    return _carry(update, residual, param, np.dtype(dtype) if _is_narrowed(residual) else WORK_DTYPE)


def _carried(params: PyTree, residual: PyTree) -> PyTree:
    """The parameters in float32 with their residuals added: where float32 training would have them.

    The inner transformation sees these (weight decay, Prodigy's distance from the initial
    parameters), not the rounded weights.
    """
    if params is None:
        return None
    return jax.tree.map(
        lambda p, r: _values(p) + _values(r) if _is_narrow_param(p) else _values(p),
        params,
        residual,
        is_leaf=lambda x: x is None,
    )


def _compensated(updates: PyTree, residual: PyTree, params: PyTree, storage: _Storage) -> tuple[PyTree, PyTree]:
    """:func:`_compensated_leaf` for every parameter (runs under scalify)."""
    is_none = lambda x: x is None  # noqa: E731
    treedef = jax.tree.structure(updates, is_leaf=is_none)
    residual_key = jax.tree_util.GetAttrKey("residual")
    pairs = jax.tree_util.tree_map_with_path(
        lambda path, u, r, p: _compensated_leaf(u, r, p, storage.dtype_at((residual_key, *path))),
        updates,
        residual,
        params,
        is_leaf=is_none,
    )
    pairs = treedef.flatten_up_to(pairs)
    return treedef.unflatten([a for a, _ in pairs]), treedef.unflatten([r for _, r in pairs])


def scale_state(
    inner: optax.GradientTransformation,
    dtype: DTypeLike = jnp.float16,
    *,
    field_dtypes: Mapping[str, DTypeLike] | None = None,
    rescale: Norm | None = "l2",
    compensate: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Store the state of ``inner`` in ``dtype`` with power-of-two scales; update it in float32.

    ``inner`` is used unchanged, with its own hyperparameters (``eps``, schedules, weight
    decay): there is nothing to retune. The returned transformation:

    - ``init(params)``: returns ``CompensatedState(inner=..., residual=...)`` (the inner
      state alone with ``compensate=False``). Runs ``inner.init`` on the float32 values of ``params`` (plain
      arrays or ``ScaledArray`` leaves). Every floating state array of at least one
      dimension becomes a ``ScaledArray`` with ``dtype`` data, its largest entry in
      ``(2**(t-1), 2**t]`` with ``2**t`` half the largest power of two of ``dtype``
      (``2**14`` for float16, ``2**7`` for E4M3; ``2**14`` for wider dtypes); an
      all-zero array (a fresh moment) gets scale 0, "asserted zero" (its value is 0, and
      a sum with it takes the other operand's scale). Integer leaves (step counts), floating scalars (injected
      hyperparameters) and other leaves are kept as they are, never cast.
    - ``update(updates, state, params, **extra_args)``: reads the stored state and the
      gradients as plain float32 values, runs ``inner.update`` on them (``extra_args`` are
      passed on if ``inner`` takes them), then stores each new state array as ``init``
      does (a stored zero of a divisor such as ``nu`` is widened as ``dtype``'s smallest
      subnormal: below). The updates get their statistic ``rescale`` (root mean square
      by default) as scale and come back in the
      dtypes of the incoming ``updates``, as ScaledArrays if those were, and, for weights
      narrower than float32, hold what the weights can take (the rest is carried: "Weights
      narrower than float32" below). It works inside
      a ``jsa.scalify`` step (the usual case) and outside one: with plain gradients the
      updates come back as plain arrays, so the state can be narrow in an otherwise
      unscaled training loop (plain FP16 weights and gradients with ``optax.adam`` then
      train like FP32).

    Why each step is needed: in FP16 ``eps = 1e-8`` is 0 and ``mu / (sqrt(nu) + eps)`` is
    ``0 / 0`` wherever a gradient entry is zero, so the arithmetic is float32; float32
    holds every value of a narrow scaled leaf, so it runs on plain values, where scale
    rules would only add scalar work. Each new state array is stored with its largest
    entry at the top of the storage dtype's range: nothing overflows, and every entry keeps
    the most binades above the subnormals that one scale per tensor allows (placed by its
    RMS, an entry ``2**16`` times the RMS would overflow float16, and the rest would sit
    nearer the subnormals). The stored data are only read back into float32, never computed
    on. The updates, which ``params + updates`` computes on, get a unit RMS instead: SGD
    and Lion pass the gradients' magnitude on to them, and at a scale that did not follow
    their data ``params + update`` would drift the parameters' scale step after step.

    Small entries: one scale per tensor gives float16 data 38 binades below the largest
    entry, and a second moment spans the square of its gradient's range (gradients 2**-19
    below their tensor's largest put ``nu`` below float16's smallest subnormal, where it is
    stored as 0). A 0 beside a first moment that is not makes Adam step by ``mu / eps``.
    The fields Optax divides by (``nu``, ``nu_max``, ``sum_of_squares``, Adafactor's
    ``v_row``/``v_col``/``v``, AdaDelta's ``e_g``) therefore have their stored zeros widened
    to the storage dtype's smallest subnormal (in units of their scale): ``nu`` is
    overestimated there and the step is smaller than float32's, while a first moment rounded to 0 gives a step of 0. In the
    rest of the subnormal range rounding to nearest may lower ``nu`` by up to a third, a
    step up to ``sqrt(1.5)`` times float32's on those entries. Only zeros move, so a signed
    field that shares a divisor's name (SM3's momentum ``nu``, Adan's ``v``) keeps its signs.

    Weights narrower than float32 (``compensate=True``, the default): a float16 weight moves
    in steps of its unit in the last place, ``2**-11`` of its size; ``params + updates`` rounds
    any smaller update away, step after step (a small learning rate, or a rate that starts
    small as ``optax.contrib.prodigy``'s, then barely trains). So the state keeps, per
    parameter, a residual: the part of the updates the weight has not taken yet (at most half a
    unit in its last place, stored in ``dtype`` at a static scale). Each update adds it and
    returns exactly what the weight can take (``optax.apply_updates`` then lands on the
    correctly rounded sum); the rest is carried. The inner transformation sees the weights with
    their residuals added, in float32 (weight decay, Prodigy's distance from the initial
    weights). It costs one ``dtype`` array per parameter, requires ``params`` in ``update``
    (as ``apply_updates`` is used with it), and changes nothing for float32 weights (their residual stays zero: pass
    ``compensate=False`` to drop it and keep the inner state's structure).

    Optimizers whose state must stay float32: ``optax.contrib.mechanize`` keeps EMAs with
    betas up to 0.999999 and a copy of the initial parameters; any of its own fields below
    float32 and it does not train (``init`` warns and gives the ``field_dtypes`` to use).
    Matrix statistics that are inverted or raised to a negative power (Shampoo's ``G G^T``
    and ``G^T G`` with their inverse fourth roots, a transformation of the user's own):
    float16 rounds each entry by about ``2**-11`` of the largest, comparable to the smallest
    eigenvalues, which the inverse root weights most; store them in float32 by the names the
    state uses (``field_dtypes={"stat_left": jnp.float32, "stat_right": jnp.float32}``). No
    warning: the fields are the user's own.

    Line searches (``optax.lbfgs``, ``scale_by_zoom_linesearch``, ``scale_by_backtracking_linesearch``)
    keep the objective's value as a float32 scalar of the state, as every floating scalar is
    kept. ``optax.value_and_grad_from_state`` chooses between it and a fresh loss in a
    ``lax.cond``, whose branches must have one dtype: compute the loss in float32
    (``.astype(jnp.float32)``), or JAX stops with "cond branches must have equal output
    types". So written, L-BFGS in FP16 follows FP32.

    FP8 and bfloat16: store only first moments below float16 precision
    (``field_dtypes={"mu": jnp.float8_e4m3fn, "trace": jnp.float8_e4m3fn}``). A first moment's
    EMA (``b1 = 0.9``) moves by 10% a step, about FP8's rounding step, and stays within about
    10% of the float32 EMA. A second moment's (``b2 = 0.999``) moves by 0.1%, below the rounding
    step of any format with fewer than 10 mantissa bits, so rounded to nearest it stalls
    (``python -m experiments.optim_state --ema`` measures both), and E4M3 flushes its small
    entries to zero next to a non-zero ``mu``, where ``mu / (sqrt(0) + eps)`` blows up.
    ``init`` warns when ``nu`` is stored so.

    Args:
        inner: any Optax gradient transformation.
        dtype: the storage dtype of floating state arrays (float16, bfloat16, an FP8 type, or
            float32 to keep the values exact).
        field_dtypes: per state field dtypes, by field name of Optax's state namedtuples,
            e.g. ``{"mu": jnp.float8_e4m3fn}`` stores Adam's first moment in E4M3 and the
            rest in ``dtype``. A leaf takes the dtype of the outermost field on its path
            that is named here.
        rescale: the statistic of the outgoing updates moved into their scale: ``"l2"``
            (root mean square, one reduction of clamped terms, exact for entries in
            ``[2**-60, 2**50]``, measured with the state), or ``"l1"``, ``"max"``, a callable
            ``norm(data) -> scalar`` (exact, through ``jsa.ops.dynamic_rescale``); or None
            to store the updates and the state at scale 1 (the active rescale policy's
            ``outputs`` site may still move them; unsafe below float32).
        compensate: carry the part of each update that weights narrower than float32 round
            away to the next update (below); ``update`` then needs ``params``.

    Returns:
        An ``optax.GradientTransformationExtraArgs``.
    """
    _check_inner(inner)
    storage = _Storage(
        dtype=_floating_dtype(dtype, "dtype"),
        field_dtypes={
            str(name): _floating_dtype(d, f"field_dtypes[{name!r}]") for name, d in (field_dtypes or {}).items()
        },
        rescale=rescale,
    )
    if rescale is not None and not callable(rescale) and rescale not in ("l1", "l2", "max"):
        raise ValueError(
            f"jsa.optim.scale_state: rescale must be 'l2', 'l1', 'max', a callable norm(data) -> scalar, "
            f"or None; got {rescale!r}."
        )
    inner = optax.with_extra_args_support(inner)

    @_compiled_when_concrete
    @scalify
    def init_stored(state):
        return _store(jax.tree.map(_assert_zero_or_unit, state), storage)[0]

    @scalify
    def update_stored(updates, state, params, extra_args):
        inner_state, params32 = (
            (state.inner, _carried(params, state.residual)) if compensate else (state, _values(params))
        )
        new_updates, new_state = inner.update(_values(updates), _state_values(inner_state), params32, **extra_args)
        new_state, new_updates = _store(new_state, storage, new_updates)
        new_updates = _cast_like(new_updates, updates)
        if not compensate:
            return new_updates, new_state
        new_updates, residual = _compensated(new_updates, state.residual, params, storage)
        return new_updates, CompensatedState(new_state, residual)

    def init_fn(params: PyTree) -> PyTree:
        params = _widened_values(params)
        state = inner.init(params)
        if compensate:
            state = CompensatedState(state, jax.tree.map(jnp.zeros_like, params))
        _warn_if_second_moment_too_narrow(state, storage)
        _warn_if_mechanic_state_too_narrow(state, storage)
        return init_stored(state)

    def update_fn(updates: PyTree, state: PyTree, params: PyTree | None = None, **extra_args) -> tuple[PyTree, PyTree]:
        outside = not is_tracing_user_code()
        _check_stored(state, storage, outside)
        if compensate:
            _check_compensated(state, params)
        new_updates, new_state = update_stored(updates, state, params, extra_args)
        if outside and not any(isinstance(u, ScaledArray) for u in jax.tree.leaves(updates, is_leaf=is_scaled_leaf)):
            new_updates = jax.tree.map(unscaled, new_updates, is_leaf=is_scaled_leaf)  # plain in, plain out
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


__all__ = ["CompensatedState", "scale_state"]
