"""The data model: ``ScaledArray``, a pair ``(data, scale)`` whose value is ``data * scale``."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .config import get_scalify_config
from .pow2 import pow2_decompose

Array = Any
DTypeLike = Any

_NOT_OUTSIDE_SCALIFY = (
    "ScaledArray does not support {what} outside jsa.scalify. Wrap the function that uses it "
    "with @jsa.scalify, or convert it first with x.to_array() / jsa.asarray(tree)."
)


def _is_array_like(x) -> bool:
    return hasattr(x, "dtype") and hasattr(x, "shape")


def is_floating_dtype(dtype) -> bool:
    """True for every floating dtype, FP8 and bfloat16 included."""
    return jnp.issubdtype(dtype, jnp.floating)


@jax.tree_util.register_pytree_node_class
class ScaledArray:
    """An array represented as ``data * scale``.

    ``data`` carries the shape and dtype (possibly FP16 or FP8); ``scale`` is a floating
    scalar (float32 by default) and in general a power of two, so that ``data`` stays near
    unit size while the value can be far outside the data dtype's range. ``scale`` may be
    any floating array broadcastable to ``data``, but the scale rules assume a scalar.

    A ``ScaledArray`` is a pytree with children ``(data, scale)``, so it passes through
    ``jax.jit``, ``jax.tree`` functions and Optax unchanged. It has no arithmetic of its
    own: computations on it happen inside :func:`jax_scalify.scalify`.
    """

    __slots__ = ("data", "scale")
    __array_priority__ = 100  # make `np.ndarray + ScaledArray` defer to our error message

    def __init__(self, data: Array, scale: Array):
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
                        f"shape {np.shape(data)}. Use a scalar scale (the usual case) or one that "
                        "broadcasts against the data."
                    ) from None
        self.data = data
        self.scale = scale

    # Pytree protocol. Unflattening bypasses the checks: JAX rebuilds pytrees with
    # placeholders (None, object(), tracers of other shapes) that are not arrays.
    def tree_flatten(self):
        return (self.data, self.scale), None

    @classmethod
    def tree_unflatten(cls, aux_data, children):
        obj = object.__new__(cls)
        obj.data, obj.scale = children
        return obj

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

    def to_array(self, dtype: DTypeLike = None) -> Array:
        """The value ``data * scale`` as a plain array of ``dtype`` (default: the data dtype).

        The product is formed in the wider of the data and scale dtypes, so a value outside
        the data dtype's range is right whenever ``dtype`` can hold it.
        """
        dtype = self.dtype if dtype is None else dtype
        npapi = np if isinstance(self.data, np.ndarray) and isinstance(self.scale, (np.ndarray, np.generic)) else jnp
        widest = max(jnp.finfo(self.data.dtype).bits, jnp.finfo(self.scale.dtype).bits, 32)
        work = jnp.float64 if widest == 64 else jnp.float32
        value = npapi.asarray(self.data).astype(work) * npapi.asarray(self.scale).astype(work)
        return value.astype(dtype)

    def astype(self, dtype: DTypeLike) -> "ScaledArray":
        """Cast the data to ``dtype``; the scale is kept, so the value is unchanged up to rounding."""
        if not is_floating_dtype(dtype):
            raise TypeError(
                f"Cannot cast a ScaledArray to the non-floating dtype {np.dtype(dtype)}: its scale "
                "would be lost. Call x.to_array(dtype) for a plain array of that dtype."
            )
        return ScaledArray(self.data.astype(dtype), self.scale)

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.to_array(), dtype=dtype)

    def __repr__(self) -> str:
        return f"ScaledArray(data={self.data!r}, scale={self.scale!r})"

    def __jax_array__(self):
        raise TypeError(_NOT_OUTSIDE_SCALIFY.format(what="being passed to a JAX function"))

    def _no_arithmetic(self, *args, **kwargs):
        raise TypeError(_NOT_OUTSIDE_SCALIFY.format(what="arithmetic"))

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _no_arithmetic
    __truediv__ = __rtruediv__ = __matmul__ = __rmatmul__ = __pow__ = __neg__ = _no_arithmetic
    __lt__ = __le__ = __gt__ = __ge__ = __getitem__ = _no_arithmetic


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
        return ScaledArray(data, scale)
    return ScaledArray(*_unit_rms_split(x, npapi, scale_dtype))


def _unit_rms_split(x: Array, npapi, scale_dtype) -> tuple[Array, Array]:
    """``(x / s, s)`` with ``s = pow2_round_down(rms(x))``: data of RMS in ``[1, 2)``.

    For a scalar this is the exact mantissa / power-of-two split. All-zero and non-finite
    inputs keep scale 1 (a 0 or inf scale would poison the rules downstream).
    """
    x = npapi.asarray(x)
    work = x.astype(np.float64 if x.dtype == np.float64 else np.float32)
    rms = npapi.sqrt(npapi.mean(npapi.square(work)))
    scale = pow2_decompose(rms)[0]
    scale = npapi.where(npapi.isfinite(scale) & (scale > 0), scale, npapi.ones_like(scale))
    return (work / scale).astype(x.dtype), scale.astype(scale_dtype)


def as_scaled_array(tree: Any, scale: Array | None = None) -> Any:
    """Make every floating leaf of ``tree`` a ``ScaledArray`` with the same value.

    - with ``scale`` given, floating arrays become ``ScaledArray(value / scale, scale)``;
    - without it, the scale is the power of two just below the RMS of the array, so the data
      have an RMS in ``[1, 2)`` (the unit-scaling assumption every scale rule relies on).
      For a 0-d array this is the exact split into a mantissa in ``[1, 2)`` and a power of
      two. All-zero or non-finite arrays get scale 1. Pass ``scale=1.0`` to keep the data
      equal to the values;
    - only floating arrays are touched: integer, boolean and PRNG-key arrays, ``ScaledArray``
      leaves and every non-array leaf (Python numbers, functions, strings, ``None``) are
      returned unchanged, so an Equinox module, an Optax state (its integer step count stays
      an integer) or a Flax NNX state (``nnx.state(model)``, written back with
      ``nnx.update``) can be converted whole. A Python float stays a Python float, which
      ``scalify`` treats as a constant; to scale a number, pass it as an array
      (``np.float32(x)``).

    Scales have the configured scale dtype (float32 by default).
    """
    return jax.tree.map(lambda x: _as_scaled_leaf(x, scale), tree, is_leaf=is_scaled_leaf)


def asarray(tree: Any, dtype: DTypeLike = None) -> Any:
    """The inverse of :func:`as_scaled_array`: every ``ScaledArray`` becomes ``data * scale``.

    Args:
        tree: a pytree with ``ScaledArray`` or plain leaves.
        dtype: if given, the dtype of the converted scaled leaves and of plain floating leaves.
    """

    def convert(x):
        if isinstance(x, ScaledArray):
            return x.to_array(dtype)
        if dtype is not None and _is_array_like(x) and is_floating_dtype(x.dtype):
            return jnp.asarray(x, dtype=dtype)
        return x

    return jax.tree.map(convert, tree, is_leaf=is_scaled_leaf)
