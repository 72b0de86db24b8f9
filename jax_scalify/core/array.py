"""The data model: ``ScaledArray``, a pair ``(data, scale)`` whose value is ``data * scale``."""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .config import Pow2RoundMode, get_scalify_config
from .pow2 import binary, map_scalars, pow2_exponent, pow2_round_up

Array = Any
DTypeLike = Any

_JAX_FUNCTION_OUTSIDE_SCALIFY = (
    "A ScaledArray was passed to a JAX function outside jsa.scalify. Wrap the function with "
    "@jsa.scalify, or convert it first with jsa.asarray(x) (x a ScaledArray or a pytree). Transformations "
    "go inside scalify: jsa.scalify(jax.grad(f)), jsa.scalify(jax.vmap(f)), not "
    "jax.grad(f) or jax.vmap(f) applied to ScaledArrays (they would see data and scale as "
    "two unrelated arrays)."
)
_NOT_OUTSIDE_SCALIFY = (
    "ScaledArray does not support {what} outside jsa.scalify. Wrap the function that uses it "
    "with @jsa.scalify, or convert it first with jsa.asarray(x) (x a ScaledArray or a pytree)."
)


# jax.Array's public methods and properties that ScaledArray does not define (x.sum(), x.T,
# x.reshape(...)): outside scalify they raise the error above instead of a bare AttributeError.
_JAX_ARRAY_ATTRIBUTES = frozenset(name for name in dir(jax.Array) if not name.startswith("_"))


def _not_outside_scalify(what: str):
    """A ``ScaledArray`` method that raises the error saying ``what`` needs scalify."""

    def method(self, *args, **kwargs):
        raise TypeError(_NOT_OUTSIDE_SCALIFY.format(what=what))

    return method


class _EvaluationState(threading.local):
    def __init__(self):
        self.depth = 0


_evaluation = _EvaluationState()


@contextlib.contextmanager
def evaluating_rules() -> Iterator[None]:
    """Scope in which the scalify interpreter evaluates a jaxpr with the scale rules.

    Inside it, ``ScaledArray``s are the rules' intermediate values: their scales are not
    checked (an intermediate scale may overflow to ``inf``) and nested ``scalify`` calls
    take their inputs as they are.
    """
    _evaluation.depth += 1
    try:
        yield
    finally:
        _evaluation.depth -= 1


def is_evaluating_rules() -> bool:
    """Whether the scalify interpreter is evaluating a jaxpr (see :func:`evaluating_rules`)."""
    return _evaluation.depth > 0


class ScaleFacts(NamedTuple):
    """What is known about a ``ScaledArray`` beyond its data and scale: the static part of its pytree.

    Being pytree aux data, these facts cross ``jax.jit``, ``cond``, ``custom_vjp`` and
    ``shard_map`` boundaries with the value, and JAX's own treedef comparison tells two
    values with different facts apart (loop rules rebuild their carries from data and
    scale: a fact holds for one iteration's value, not for the loop's). That the scale is a
    power of two is not among them: it is a contract for every scale (see
    :func:`jax_scalify.core.pow2.scales_are_pow2`).

    - ``any_scale``: the value is a constant 0 or ±inf, the same at every scale, so rules
      that align scales let it adopt the others' scale (``max(x, 0)`` keeps ``x``'s scale);
    - ``stacked``: the value is a stack (axis 0) of slices that were produced with one
      scale each (the outputs of a ``scan``); ``slices`` holds ``(slice_data, slice_scales)``
      besides the rebalanced ``(data, scale)``, so that a later scan over it can give every
      iteration its slice at its own scale;
    - ``rescaled``: the scale was just chosen from the data with the policy's statistic (or
      from a bound of the op): a policy site leaves it as it is, re-estimating moves nothing;
    - ``pinned``: the user set the scale (``jsa.lax.set_scaling``): no policy site moves it
      (an explicit ``jsa.ops.dynamic_rescale`` still does);
    - ``sparse``: the data may sit in a few entries (a scatter into zeros, the gradient of a
      lookup): a sample can miss them, so a policy rescale of narrow data bounds the largest
      entry too.
    """

    any_scale: bool = False
    stacked: bool = False
    rescaled: bool = False
    pinned: bool = False
    sparse: bool = False


_PLAIN_FACTS = ScaleFacts()


def _is_array_like(x) -> bool:
    return hasattr(x, "dtype") and hasattr(x, "shape")


def is_floating_dtype(dtype) -> bool:
    """True for every floating dtype, FP8 and bfloat16 included."""
    return jnp.issubdtype(dtype, jnp.floating)


def narrow_range(dtype) -> bool:
    """True for float dtypes with a smaller exponent range than float32 (float16, FP8)."""
    return jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp


def is_concrete(x: Any) -> bool:
    """A value known now (NumPy, or a JAX array that is not a tracer)."""
    if isinstance(x, (np.ndarray, np.generic)):
        return True
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def _local(x: Any) -> Any:
    """``x``, or for a JAX array spread over several processes this process's first block."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x.addressable_data(0)  # the other blocks are checked by their processes
    return x


def _host_values(x: Any) -> np.ndarray:
    return np.asarray(_local(x))


def _scale_problem(values: np.ndarray, require_pow2: bool = True) -> str | None:
    """Why ``values`` cannot be a scale (None if they can), under the rounding mode in force.

    Allowed: ``0`` (the value is asserted to be zero; the rules keep it so) and positive
    powers of two (any positive finite number without ``require_pow2``, or under
    ``Pow2RoundMode.NONE``, where the rules themselves compute scales that are no powers of two).
    """
    values = np.asarray(values, np.float64)
    if np.any(np.isnan(values)) or np.any(np.isinf(values)):
        return "is not finite"
    if np.any(values < 0):
        return "is negative (the rules assume a positive scale: put the sign in the data)"
    if not require_pow2 or get_scalify_config().rounding_mode == Pow2RoundMode.NONE:
        return None
    mantissa, _ = np.frexp(values)
    if np.any((values != 0) & (mantissa != 0.5)):
        return "is not a power of two"
    return None


def _scale_error(where: str, scale_values: np.ndarray, problem: str) -> ValueError:
    shown = scale_values.reshape(-1)[:4].tolist()
    return ValueError(
        f"{where} scale {shown if scale_values.size > 1 else scale_values.item()!r} {problem}. A scale "
        "must be 0 (the value is zero) or a positive power of two: let jsa.as_scaled_array(value) "
        "choose it, give yours as jsa.as_scaled_array(value, scale=s) (rounded up to a power of two, "
        "the value kept), round it with jsa.core.pow2_round_down(scale), or, to use scales that are no "
        "powers of two on purpose, work under jsa.ScalifyConfig(rounding_mode=jsa.Pow2RoundMode.NONE) "
        "(then any positive finite scale is allowed)."
    )


def check_scale_values(scale: Array, where: str = "ScaledArray") -> None:
    """Raise a ``ValueError`` saying what to do if the concrete ``scale`` is not a valid scale.

    Traced scales are not checked (their values are unknown). See :class:`ScaledArray`.
    """
    if not is_concrete(scale):
        return
    values = _host_values(scale)
    problem = _scale_problem(values)
    if problem is not None:
        raise _scale_error(where, values, problem)


@jax.tree_util.register_pytree_with_keys_class
class ScaledArray:
    """An array represented as ``data * scale``.

    ``data`` carries the shape and dtype (possibly FP16 or FP8); ``scale`` is a floating
    scalar (float32 by default), so that ``data`` stays near unit size while the value can be
    far outside the data dtype's range.

    Validation, where the scale is concrete (NumPy or a JAX array, not a tracer): the scale
    must be a positive power of two, or ``0``, which asserts that the value is zero whatever
    the (finite) data: every rule gives what plain JAX gives on ``to_array()``'s zeros (and
    ``0 * u`` does not pull a sum's scale down); a negative, non-finite or
    other scale raises a ``ValueError`` saying what to do. Under
    ``jsa.ScalifyConfig(rounding_mode=jsa.Pow2RoundMode.NONE)`` the rules compute scales
    that are no powers of two, so any positive finite scale is allowed there. A scale may
    have any shape that broadcasts to the data (e.g. per-channel scales, for storage and
    ``to_array``), but :func:`jax_scalify.scalify` accepts only scalar scales: every scale
    rule assumes one. The same checks run on the inputs of ``scalify``, which catches
    scales broken by plain ``jax.tree`` functions (they rebuild a ``ScaledArray`` without
    calling this constructor; see ``docs/pytrees.md``). A traced scale (under ``jax.jit``)
    cannot be checked; ``scalify`` makes an invalid one NaN, so its value is NaN rather
    than wrong. ``jsa.as_scaled_array(value, scale=s)`` takes any positive scale and rounds it.

    A ``ScaledArray`` is a pytree with children ``(data, scale)`` (key paths ``.data`` and
    ``.scale``; a checkpoint restored without a target holds ``{"data", "scale"}``), so it passes through
    ``jax.jit``, ``jax.tree`` functions and Optax unchanged. Inside ``scalify`` a value may
    also carry :class:`ScaleFacts` (``any_scale``, ``slices``), what the rules know about it
    beyond data and scale; they are the pytree's aux data, and ``scalify`` returns values
    without them. Within one trace a value may also be on another's grid: ``grid_of`` is a
    scale object ``s`` such that this value's scale equals ``s`` wherever ``s`` is not 0 (the
    update ``jsa.optim.scale_state`` computes on its parameter's grid), so a sum with the value
    whose scale is ``s`` aligns nothing. It refers to a traced scale, so it is not aux data:
    a pytree boundary drops it, and such a sum then aligns at run time. It has no arithmetic of its
    own: computations on it happen inside :func:`jax_scalify.scalify`. A concrete 0-d one
    converts with ``float()``, ``int()`` and ``bool()``.
    """

    __slots__ = ("data", "scale", "any_scale", "slices", "rescaled", "pinned", "sparse", "grid_of")
    __array_priority__ = 100  # make `np.ndarray + ScaledArray` defer to our error message

    def __init__(
        self, data: Array, scale: Array, *, any_scale: bool = False, slices: tuple[Array, Array] | None = None
    ):
        if _is_array_like(data) and not is_floating_dtype(data.dtype):
            raise TypeError(
                f"ScaledArray data must be floating, got dtype {data.dtype}. Integer and boolean "
                "arrays need no scale: keep them as plain arrays (jsa.as_scaled_array does so)."
            )
        if isinstance(scale, (float, int)) and not isinstance(scale, bool):
            scale = np.asarray(scale, get_scalify_config().scale_dtype)
        if _is_array_like(scale):
            if not is_floating_dtype(scale.dtype):
                raise TypeError(
                    f"ScaledArray scale must be a floating array, got dtype {scale.dtype}. "
                    "Pass a float scale, e.g. np.float32(1.0)."
                )
            if _is_array_like(data):
                try:
                    np.broadcast_shapes(np.shape(scale), np.shape(data))
                except ValueError:
                    raise ValueError(
                        f"ScaledArray scale of shape {np.shape(scale)} is not broadcastable to data of "
                        f"shape {np.shape(data)}. Use a scalar scale: jsa.scalify's scale rules need one "
                        "(jsa.as_scaled_array(value) picks it)."
                    ) from None
            if not is_evaluating_rules():
                check_scale_values(scale)
        self.data = data
        self.scale = scale
        self.any_scale = bool(any_scale)
        self.slices = None if slices is None else tuple(slices)
        self.rescaled = self.pinned = self.sparse = False
        self.grid_of = None

    @classmethod
    def unchecked(
        cls,
        data: Array,
        scale: Array,
        *,
        any_scale: bool = False,
        slices: tuple[Array, Array] | None = None,
        rescaled: bool = False,
        pinned: bool = False,
        sparse: bool = False,
        grid_of: Array | None = None,
    ) -> ScaledArray:
        """``ScaledArray(data, scale)`` without any check, for code that computed the scale itself.

        Scale rules, runtime callbacks and deserialisation use it: an intermediate scale may
        legitimately overflow to ``inf`` or, under ``Pow2RoundMode.NONE``, be no power of two.
        """
        obj = object.__new__(cls)
        obj.data, obj.scale = data, scale
        obj.any_scale, obj.slices = any_scale, slices
        obj.rescaled, obj.pinned, obj.sparse = rescaled, pinned, sparse
        obj.grid_of = grid_of
        return obj

    @property
    def facts(self) -> ScaleFacts:
        """What is known about this value besides data and scale (see :class:`ScaleFacts`)."""
        return ScaleFacts(self.any_scale, self.slices is not None, self.rescaled, self.pinned, self.sparse)

    def plain(self) -> ScaledArray:
        """The same data and scale without any :class:`ScaleFacts` nor ``grid_of`` (what a rule's output starts from)."""
        if self.facts == _PLAIN_FACTS and self.grid_of is None:
            return self
        return ScaledArray.unchecked(self.data, self.scale)

    def marked(self, *, rescaled: bool = False, pinned: bool = False, sparse: bool = False) -> ScaledArray:
        """The same value with the given marks of :class:`ScaleFacts` added (a new object)."""
        return ScaledArray.unchecked(
            self.data,
            self.scale,
            any_scale=self.any_scale,
            slices=self.slices,
            rescaled=self.rescaled or rescaled,
            pinned=self.pinned or pinned,
            sparse=self.sparse or sparse,
            grid_of=self.grid_of,
        )

    # Pytree protocol. Unflattening bypasses the checks: JAX rebuilds pytrees with
    # placeholders (None, object(), tracers of other shapes) that are not arrays. The facts
    # are the aux data (None when there are none, as for every ScaledArray a user makes).
    def tree_flatten(self):
        facts = self.facts
        if facts == _PLAIN_FACTS:
            return (self.data, self.scale), None
        return (self.data, self.scale, *(self.slices or ())), facts

    def tree_flatten_with_keys(self):
        children, facts = self.tree_flatten()
        names = ("data", "scale", "slice_data", "slice_scales")[: len(children)]
        return [(jax.tree_util.GetAttrKey(name), child) for name, child in zip(names, children)], facts

    @classmethod
    def tree_unflatten(cls, aux_data, children):
        facts = aux_data or _PLAIN_FACTS
        data, scale, *slices = children
        return cls.unchecked(
            data,
            scale,
            any_scale=facts.any_scale,
            slices=tuple(slices) if facts.stacked else None,
            rescaled=facts.rescaled,
            pinned=facts.pinned,
            sparse=facts.sparse,
        )

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        return len(self.data.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.data.shape))

    @property
    def aval(self) -> jax.core.ShapedArray:
        """Abstract value of the data: what the array looks like to the traced function."""
        return jax.core.ShapedArray(self.shape, self.dtype)

    @property
    def value_dtype(self) -> np.dtype:
        """The dtype of a readout (``to_array()``, ``np.asarray(x)``, ``jsa.asarray``): float32, or
        float64 where the data or the scale is float64.

        The product ``data * scale`` in float32 holds every value of float16, bfloat16 and FP8
        data at a float32 scale, which the data dtype itself would turn into inf or 0. It
        depends on the dtypes only, never on the values, so it is the same under ``jax.jit``.
        """
        widest = max(jnp.finfo(self.data.dtype).bits, jnp.finfo(self.scale.dtype).bits)
        return np.dtype(np.float64 if widest == 64 else np.float32)

    def to_array(self, dtype: DTypeLike = None) -> Array:
        """The value ``data * scale`` as a plain array of ``dtype`` (default: :attr:`value_dtype`).

        The product is formed in :attr:`value_dtype`, then cast to ``dtype``: pass
        ``x.to_array(x.dtype)`` for an array of the data dtype (values outside its range then
        become inf or 0, as in plain code of that dtype).
        """
        work = self.value_dtype
        dtype = work if dtype is None else dtype
        if isinstance(self.data, np.ndarray) and isinstance(self.scale, (np.ndarray, np.generic)):
            return (self.data.astype(work) * np.asarray(self.scale).astype(work)).astype(dtype)
        convert = jax.lax.convert_element_type
        return convert(binary(jax.lax.mul, convert(self.data, work), convert(self.scale, work)), dtype)

    def astype(self, dtype: DTypeLike) -> ScaledArray:
        """Cast the data to ``dtype``; the scale is kept, so the value is unchanged up to rounding."""
        if not is_floating_dtype(dtype):
            name = dtype if jnp.issubdtype(dtype, jax.dtypes.extended) else np.dtype(dtype)
            raise TypeError(
                f"Cannot cast a ScaledArray to the non-floating dtype {name}: its scale "
                "would be lost. Call jsa.asarray(x, dtype) for a plain array of that dtype."
            )
        return ScaledArray(self.data.astype(dtype), self.scale, any_scale=self.any_scale)

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.to_array(), dtype=dtype)

    def __repr__(self) -> str:
        facts = ", any_scale=True" if self.any_scale else ""
        facts += ", slices=..." if self.slices is not None else ""
        return f"ScaledArray(data={self.data!r}, scale={self.scale!r}{facts})"

    def _host_value(self, what: str, scalar: bool = True) -> np.ndarray:
        """The value on the host, in :attr:`value_dtype`: wide enough for any scale."""
        if (scalar and self.ndim != 0) or not (is_concrete(self.data) and is_concrete(self.scale)):
            kind = "traced" if not is_concrete(self.data) else f"of shape {self.shape}"
            raise TypeError(
                f"{what} needs a concrete {'0-d ' if scalar else ''}ScaledArray, got one {kind}. Convert "
                "with jsa.asarray(x) (inside jax.jit, return it or use jax.debug.print)."
            )
        return np.asarray(self.to_array())

    def __float__(self) -> float:
        return float(self._host_value("float()"))

    def __int__(self) -> int:
        return int(self._host_value("int()"))

    def __bool__(self) -> bool:
        return bool(self._host_value("bool()"))

    def __format__(self, format_spec: str) -> str:
        """As ``jax.Array``: a 0-d array formats as its value (``f"{loss:.4f}"``), others as NumPy does."""
        if not format_spec:
            return repr(self)
        return format(self._host_value(f"format spec {format_spec!r}", scalar=self.ndim == 0)[()], format_spec)

    def item(self, *args) -> float:
        """The value of one element as a Python float, as ``jax.Array.item`` (``loss.item()``)."""
        return self._host_value("item()", scalar=False).item(*args)

    def tolist(self) -> Any:
        """The values as nested Python lists of floats, as ``jax.Array.tolist``."""
        return self._host_value("tolist()", scalar=False).tolist()

    def block_until_ready(self) -> ScaledArray:
        """Wait for the data and the scale to be computed, as ``jax.Array.block_until_ready``."""
        jax.block_until_ready((self.data, self.scale))
        return self

    def __jax_array__(self):
        raise TypeError(_JAX_FUNCTION_OUTSIDE_SCALIFY)

    def __getattr__(self, name: str):
        # Called only for attributes the class does not define. An AttributeError (with the
        # explanation), so that hasattr(x, "sum") stays False for duck-typing code.
        if name in _JAX_ARRAY_ATTRIBUTES:
            raise AttributeError(
                _NOT_OUTSIDE_SCALIFY.format(what=f"the jax.Array attribute .{name}")
                + f" Inside a scalified function x.{name} is the jax.Array one, applied to the value; "
                "a plain jax.jit does not make it one (use jax.jit(jsa.scalify(f)))."
            )
        raise AttributeError(f"'ScaledArray' object has no attribute {name!r}")

    def __len__(self) -> int:
        """The length of the first axis, as ``len`` of a ``jax.Array`` (metadata, like ``shape``)."""
        if self.ndim == 0:
            raise TypeError("len() of a 0-d ScaledArray (as of a 0-d jax.Array)")
        return self.shape[0]

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _not_outside_scalify("arithmetic")
    __truediv__ = __rtruediv__ = __matmul__ = __rmatmul__ = __pow__ = __neg__ = _not_outside_scalify("arithmetic")
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __rpow__ = _not_outside_scalify("arithmetic")
    __abs__ = __pos__ = _not_outside_scalify("arithmetic")
    __lt__ = __le__ = __gt__ = __ge__ = _not_outside_scalify("comparisons")
    __getitem__ = _not_outside_scalify("indexing (x[...], also Flax's variable[...])")


def check_scalify_inputs(leaves: list, tree: Any = None, nested: bool = False) -> None:
    """Check the ``ScaledArray`` leaves that :func:`jax_scalify.scalify` receives.

    Scales must be scalars (every scale rule assumes one; checked under ``jax.jit`` too) and
    data floating arrays; concrete scales must hold valid values (see :class:`ScaledArray`),
    fetched from the device in one transfer. This catches ``ScaledArray``s that plain
    ``jax.tree`` functions rebuilt without the constructor's checks. ``tree`` (the pytree
    the leaves come from) only serves to name the culprit in the error. ``nested``: the call
    comes from code that an outer ``scalify`` is tracing, where ``jax.vmap``/``jax.grad``
    tracers are the outer function's own (and legitimate).
    """
    scaled = [(i, x) for i, x in enumerate(leaves) if isinstance(x, ScaledArray)]
    for i, x in scaled:
        transform = None if nested or is_evaluating_rules() else _outer_transformation(x.scale)
        if transform:
            raise TypeError(
                f"jsa.scalify: the ScaledArray at {_leaf_name(tree, i)} is traced by {transform} applied "
                "outside scalify, which treats its data and scale as two independent arrays (the "
                "derivative or batch of a scale means nothing). Put the transformation inside: "
                "jsa.scalify(jax.grad(f)) or jsa.scalify(jax.vmap(f)), then jax.jit around it."
            )
        if not _is_array_like(x.data) or not is_floating_dtype(x.data.dtype):
            raise TypeError(
                f"jsa.scalify: the ScaledArray at {_leaf_name(tree, i)} has data of type "
                f"{getattr(x.data, 'dtype', type(x.data).__name__)}; it must be a floating array. "
                "jax.tree.map maps a ScaledArray's data and scale separately: to build a tree of one "
                "value per array (an Equinox filter spec, a mask), map with is_leaf=jsa.is_scaled_leaf "
                "or build it from the unscaled tree; to cast, use x.astype(dtype) or jsa.tree.astype."
            )
        if not _is_array_like(x.scale) or not is_floating_dtype(x.scale.dtype):
            raise TypeError(
                f"jsa.scalify: the ScaledArray at {_leaf_name(tree, i)} has a scale of type "
                f"{getattr(x.scale, 'dtype', type(x.scale).__name__)}; it must be a floating scalar."
            )
        if np.ndim(x.scale) != 0:
            raise ValueError(
                f"jsa.scalify: the ScaledArray at {_leaf_name(tree, i)} has a scale of shape "
                f"{np.shape(x.scale)}; the scale rules need a scalar scale per array. Convert it with "
                "jsa.as_scaled_array(jsa.asarray(x, jnp.float32)) (one power-of-two scale for the array), "
                "or keep per-channel scales outside scalify and multiply them in as plain arrays."
            )
    if is_evaluating_rules():  # an inner scalify evaluated by the interpreter: internal values
        return
    concrete = [(i, x.scale) for i, x in scaled if is_concrete(x.scale)]
    if not concrete:
        return
    require_pow2 = get_scalify_config().rounding_mode != Pow2RoundMode.NONE
    numpy_ok = all(
        _scale_problem(np.asarray(s)) is None for _, s in concrete if isinstance(s, (np.ndarray, np.generic))
    )
    on_device = [_local(s) for _, s in concrete if isinstance(s, jax.Array)]
    # One fused check on the device and one boolean back, rather than a transfer per scale;
    # evaluated now even where an outer jax.jit traces (a ScaledArray constant closed over).
    with jax.ensure_compile_time_eval():
        valid = not on_device or bool(_device_scales_valid(require_pow2, *on_device))
    if numpy_ok and valid:
        return
    for i, scale in concrete:  # rare: find the culprit on the host for the message
        values = _host_values(scale)
        problem = _scale_problem(values)
        if problem is not None:
            raise _scale_error(f"jsa.scalify: the ScaledArray at {_leaf_name(tree, i)}:", values, problem)


def conform_traced_scales(leaves: list) -> list:
    """The leaves that ``scalify`` receives, every traced scale made NaN if one is not a valid scale.

    The counterpart under ``jax.jit`` of :func:`check_scalify_inputs`' check of concrete
    scales: a traced scale's value is unknown when ``scalify`` traces, so it cannot raise.
    If a scale is not 0 or a positive power of two (positive and finite under
    ``Pow2RoundMode.NONE``), every scale of its dtype becomes NaN, so the step's values are
    NaN instead of silently wrong, and the rules' power-of-two contract holds (NaN is
    allowed). The scales are tested together, one reduction per scale dtype whose verdict
    every scale reads, and the data are not touched (measured in ``docs/pytrees.md``). The
    verdict is applied by :func:`~jax_scalify.core.pow2.map_scalars`: on XLA:CPU each scale
    stays an input of its own, so kernels of same-shaped blocks stay identical.
    """
    where = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, ScaledArray) and not is_concrete(x.scale) and np.ndim(x.scale) == 0
    ]
    if not where or is_evaluating_rules():
        return leaves
    require_pow2 = get_scalify_config().rounding_mode != Pow2RoundMode.NONE
    by_dtype: dict[np.dtype, list[int]] = {}
    for i in where:
        by_dtype.setdefault(np.dtype(leaves[i].scale.dtype), []).append(i)
    out = list(leaves)
    for indices in by_dtype.values():
        scales = [leaves[i].scale for i in indices]
        all_valid = _scale_bits_valid(jnp.stack(scales), require_pow2)
        checked = map_scalars(functools.partial(_nan_unless, all_valid), scales)
        for i, (scale,) in zip(indices, checked):
            x = leaves[i]
            out[i] = ScaledArray.unchecked(x.data, scale, any_scale=x.any_scale, slices=x.slices)
    return out


def _nan_unless(valid: Array, scale: Array) -> tuple[Array]:
    return (jax.lax.select(valid, scale, jnp.full(jnp.shape(scale), np.nan, scale.dtype)),)


def _scale_bits_valid(scale: Array, require_pow2: bool) -> Array:
    """True if every element of ``scale`` is +-0 or positive finite (and a power of two if ``require_pow2``).

    Reads the bit pattern with integer operations only: comparisons of floats would treat
    subnormal scales as zero on backends that flush them.
    """
    info = jnp.finfo(scale.dtype)
    uint = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[np.dtype(scale.dtype).itemsize]
    bits = jax.lax.bitcast_convert_type(scale, uint)
    nbits, nmant = 8 * np.dtype(scale.dtype).itemsize, info.nmant
    magnitude = bits & uint((1 << (nbits - 1)) - 1)
    negative = (bits >> (nbits - 1)) != 0
    exponent = magnitude >> nmant
    mantissa = magnitude & uint((1 << nmant) - 1)
    exponent_all_ones = uint((1 << (nbits - 1 - nmant)) - 1)
    zero = magnitude == 0
    finite_positive = ~negative & (exponent != exponent_all_ones)
    if not require_pow2:
        valid = zero | finite_positive
    else:
        normal_pow2 = (exponent != 0) & (mantissa == 0)
        subnormal_pow2 = (exponent == 0) & (jax.lax.population_count(mantissa) == 1)
        valid = zero | (finite_positive & (normal_pow2 | subnormal_pow2))
    return jnp.all(valid)


@functools.partial(jax.jit, static_argnums=0)
def _device_scales_valid(require_pow2: bool, *scales: Array) -> Array:
    return jnp.all(jnp.stack([_scale_bits_valid(s, require_pow2) for s in scales]))


# Tracer types (by name: their classes are not public JAX API) of the transformations that must
# go inside scalify. Tracers of jax.jit / jax.make_jaxpr are fine: scalify composes with them.
_INNER_ONLY_TRACERS = {
    "JVPTracer": "jax.grad/jax.jvp",
    "LinearizeTracer": "jax.grad/jax.vjp",
    "BatchTracer": "jax.vmap",
}


def _outer_transformation(x: Any) -> str | None:
    if not isinstance(x, jax.core.Tracer):
        return None
    return _INNER_ONLY_TRACERS.get(type(x).__name__)


def _is_restored_scaled_array(x: Any) -> bool:
    """A dict ``{"data": array, "scale": floating scalar}``: a ``ScaledArray`` restored without its type."""
    if not (isinstance(x, dict) and set(x) == {"data", "scale"}):
        return False
    data, scale = x["data"], x["scale"]
    return (
        _is_array_like(data)
        and _is_array_like(scale)
        and np.ndim(scale) == 0
        and is_floating_dtype(scale.dtype)
        and is_floating_dtype(data.dtype)
    )


def warn_restored_scaled_arrays(tree: Any) -> None:
    """Warn about dicts in ``tree`` that look like ``ScaledArray``s restored without their type.

    ``orbax.checkpoint``'s restore without a target returns each ``ScaledArray`` as
    ``{"data": ..., "scale": ...}`` (its pytree keys); passed to a scalified step, such a
    dict is two independent arrays, and the step fails far from the cause or, where it
    only maps over leaves (an optimizer update), updates the scale as if it were a value.
    A warning, not an error: a model may have parameters named so.
    """
    paths = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: is_scaled_leaf(x) or _is_restored_scaled_array(x)
    )[0]
    for path, leaf in paths:
        if _is_restored_scaled_array(leaf):
            warnings.warn(
                f"jsa.scalify: the input at {_path_name(tree, path)} is a dict with keys 'data' and 'scale', as "
                "orbax.checkpoint's restore without a target returns a ScaledArray. Restore with "
                "the abstract target tree (docs/pytrees.md, Checkpoints), or rebuild it with "
                "jsa.ScaledArray(**d) (jax.tree.map(lambda d: jsa.ScaledArray(**d), tree, "
                "is_leaf=lambda x: isinstance(x, dict) and set(x) == {'data', 'scale'})).",
                stacklevel=5,
            )
            return


def _leaf_name(tree: Any, index: int) -> str:
    """``args[0]['w']``-style name of the ``index``-th leaf (ScaledArray kept whole) of ``tree``."""
    if tree is None:
        return f"input leaf {index}"
    paths = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_scaled_leaf)[0]
    return _path_name(tree, paths[index][0])


def _path_name(tree: Any, path: tuple) -> str:
    """``args[0]['w']``-style name of ``path`` in ``tree`` (an ``(args, kwargs)`` pair or any pytree)."""
    if isinstance(tree, tuple) and len(tree) == 2 and path:
        head = "args" if getattr(path[0], "idx", None) == 0 else "kwargs"
        return head + jax.tree_util.keystr(path[1:])
    return "input " + jax.tree_util.keystr(path)


def is_scaled_leaf(x: Any) -> bool:
    """``is_leaf`` predicate for ``jax.tree`` functions that keeps a ``ScaledArray`` whole."""
    return isinstance(x, ScaledArray)


def scaled_array(data: Array, scale: Array, dtype: DTypeLike = None, npapi=jnp) -> ScaledArray:
    """Make a ``ScaledArray`` from array-likes, like ``jnp.array``.

    Args:
        data: the data, converted with ``npapi.asarray(data, dtype)``.
        scale: the scale; a Python number becomes the configured scale dtype (float32 by
            default), an array keeps its floating dtype.
        dtype: dtype of the data (default: inferred from ``data``).
        npapi: ``jax.numpy`` (default) or ``numpy``.
    """
    data = npapi.asarray(data, dtype=dtype)
    if isinstance(scale, (float, int)):
        scale = npapi.asarray(scale, dtype=get_scalify_config().scale_dtype)
    else:
        scale = npapi.asarray(scale)
    return ScaledArray(data, scale)


def _as_scaled_leaf(x: Any, scale: Array | None) -> Any:
    if isinstance(x, ScaledArray) or not _is_array_like(x) or isinstance(x, (type, np.dtype)):
        return x  # Python numbers, functions, strings, dtypes ... pass through, as eqx.partition would
    if not is_floating_dtype(x.dtype):
        return x
    scale_dtype = get_scalify_config().scale_dtype
    npapi = np if isinstance(x, (np.ndarray, np.generic)) else jnp
    if scale is not None:
        scale = npapi.asarray(scale).astype(scale_dtype)
        data = (npapi.asarray(x).astype(np.float32) / scale.astype(np.float32)).astype(x.dtype)
        return ScaledArray.unchecked(data, scale)  # scale checked and rounded by as_scaled_array
    return ScaledArray(*_unit_rms_split(x, npapi, scale_dtype))


def _unit_rms_split(x: Array, npapi, scale_dtype) -> tuple[Array, Array]:
    """``(x / s, s)`` with ``s`` the power of two just below ``rms(x)``: data of RMS in ``[1, 2)``.

    The RMS is taken relative to the largest magnitude (``x`` is first divided by the power of
    two below it), so squaring neither underflows nor overflows anywhere in the float range.
    ``s`` is clamped to the normal range of ``scale_dtype`` (only float64 data can reach
    beyond float32's). For a scalar this is the exact mantissa / power-of-two split.
    All-zero inputs get scale 0 (the value is asserted zero, so that ``b * m + (1 - b) * g``
    on a fresh moment takes the scale of ``g``); empty and non-finite inputs keep scale 1 (an
    inf scale would turn zero data into nan).
    """
    x = npapi.asarray(x)
    work = x.astype(np.float64 if x.dtype == np.float64 else np.float32)
    if x.size == 0:
        return x, npapi.ones((), scale_dtype)
    peak = npapi.max(npapi.abs(work))
    usable = npapi.isfinite(peak) & (peak > 0)
    peak_exponent = pow2_exponent(npapi.where(usable, peak, npapi.ones_like(peak)))
    relative = npapi.ldexp(work, -peak_exponent)  # |relative| < 2: exact, no underflow of squares
    relative_rms = npapi.sqrt(npapi.mean(npapi.square(relative)))
    exponent = peak_exponent + pow2_exponent(relative_rms)
    info = jnp.finfo(scale_dtype)
    exponent = npapi.clip(exponent, info.minexp, info.maxexp - 1)
    scale = npapi.ldexp(npapi.ones((), work.dtype), exponent)
    scale = npapi.where(usable, scale, npapi.where(peak == 0, npapi.zeros_like(scale), npapi.ones_like(scale)))
    data = npapi.ldexp(work, -npapi.where(usable, exponent, 0))
    return data.astype(x.dtype), scale.astype(scale_dtype)


def as_scaled_array(tree: Any, scale: Array | None = None) -> Any:
    """Make every floating leaf of ``tree`` a ``ScaledArray`` with the same value.

    - with ``scale`` given, floating arrays become ``ScaledArray(value / s, s)``, where ``s``
      is ``scale`` rounded up to a power of two (``0.1`` gives ``0.125``; a power of two is
      kept): the value is unchanged up to the rounding of the data, whose magnitudes are at
      most those that ``value / scale`` would have (the rounding never pushes them toward
      overflow). Unlike ``ScaledArray(data, scale)``, whose value a rounded scale would
      change, this promises the value, so any positive finite ``scale`` is accepted (also a
      traced one, rounded under ``jax.jit``); 0, negative and non-finite scales raise;
    - without it, the scale is the power of two just below the RMS of the array, so the data
      have an RMS in ``[1, 2)`` (the unit-scaling assumption every scale rule relies on).
      For a 0-d array this is the exact split into a mantissa in ``[1, 2)`` and a power of
      two. All-zero arrays get scale 0 (asserted zero: a fresh Adam moment takes the scale
      of the first gradient added to it), non-finite ones scale 1. Pass ``scale=1.0`` to keep the data
      equal to the values;
    - only floating arrays are touched: integer, boolean and PRNG-key arrays, ``ScaledArray``
      leaves and every non-array leaf (Python numbers, functions, strings, ``None``) are
      returned unchanged, so an Equinox module, an Optax state (its integer step count stays
      an integer) or a Flax NNX state (``nnx.state(model)``, written back with
      ``nnx.update``) can be converted whole. A Python float stays a Python float, which
      ``scalify`` treats as a constant; to scale a number, pass it as an array
      (``np.float32(x)``).

    Scales have the configured scale dtype (float32 by default); under
    ``Pow2RoundMode.NONE`` a given ``scale`` is kept as it is.
    """
    if scale is not None:
        scale = _given_scale(scale)
        return jax.tree.map(lambda x: _as_scaled_leaf(x, scale), tree, is_leaf=is_scaled_leaf)
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_scaled_leaf)
    device = [i for i, x in enumerate(leaves) if _is_device_floating_array(x)]
    splits = _unit_rms_splits(get_scalify_config().scale_dtype, *[leaves[i] for i in device]) if device else []
    split = dict(zip(device, splits))
    out = [ScaledArray(*split[i]) if i in split else _as_scaled_leaf(x, None) for i, x in enumerate(leaves)]
    return jax.tree.unflatten(treedef, out)


def _is_device_floating_array(x: Any) -> bool:
    """A concrete JAX array of a floating dtype (not a tracer, not a ``ScaledArray``)."""
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and is_floating_dtype(x.dtype)


@functools.partial(jax.jit, static_argnums=0)
def _unit_rms_splits(scale_dtype, *xs: Array) -> list[tuple[Array, Array]]:
    """:func:`_unit_rms_split` of every concrete JAX array of a tree, in one compiled program.

    One compilation for the whole tree: computed op by op, each array's operations would be
    compiled again for every distinct shape.
    """
    return [_unit_rms_split(x, jnp, scale_dtype) for x in xs]


def _given_scale(scale: Any) -> Array:
    """``as_scaled_array``'s ``scale`` checked (positive and finite, where concrete) and rounded up to a power of two."""
    npapi = jnp if isinstance(scale, jax.Array) else np
    scale = npapi.asarray(scale).astype(get_scalify_config().scale_dtype)
    if is_concrete(scale):
        values = _host_values(scale)
        problem = _scale_problem(values, require_pow2=False)
        if problem is not None:
            raise _scale_error("jsa.as_scaled_array:", values, problem)
        if np.any(values == 0):
            raise ValueError(
                "jsa.as_scaled_array: scale 0 would divide the values by zero. Give a positive "
                "scale, or leave scale=None to pick the power of two below each array's RMS."
            )
    if get_scalify_config().rounding_mode == Pow2RoundMode.NONE:
        return scale
    return pow2_round_up(scale)


def asarray(tree: Any, dtype: DTypeLike = None) -> Any:
    """The inverse of :func:`as_scaled_array`: every ``ScaledArray`` becomes ``data * scale``.

    Each value is given in :attr:`ScaledArray.value_dtype`, float32 for float16, bfloat16
    and FP8 data at a float32 scale (float64 where data or scale are float64), as
    ``np.asarray(x)``, ``x.to_array()`` and ``float(x)`` give it: float16 data at a scale of
    ``2**-30`` hold values near ``1e-9`` and at a scale of ``2**17`` values near ``1.6e5``,
    which a float16 array would flush to 0 or turn into inf. The dtype depends on the dtypes
    only, so it is the same under ``jax.jit``.

    Args:
        tree: a pytree with ``ScaledArray`` or plain leaves.
        dtype: if given, the dtype of the converted scaled leaves and of plain floating leaves
            (plain leaves are otherwise returned as they are).
    """

    def convert(x):
        if isinstance(x, ScaledArray):
            return x.to_array(dtype)
        if dtype is not None and _is_array_like(x) and is_floating_dtype(x.dtype):
            return jnp.asarray(x, dtype=dtype)
        return x

    return jax.tree.map(convert, tree, is_leaf=is_scaled_leaf)


def unscaled(x: Any) -> Any:
    """The plain value of one leaf in its traced dtype: ``data * scale`` cast to the data dtype
    for a ``ScaledArray`` (what an equation evaluated on plain values expects), anything else as it is."""
    return x.to_array(x.dtype) if isinstance(x, ScaledArray) else x
