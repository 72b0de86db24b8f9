"""Names of ``jax_scalify.core`` in jax-scalify 0.1, kept importable with their meaning.

They serve code and tests written for the 0.1 release (``from jax_scalify.core import Array,
make_scaled_scalar, is_static_zero, ...``). New code has better tools for most of them: see
``docs/migration.md`` for each difference of behaviour and the reason for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .array import ScaledArray
from .pow2 import Pow2RoundMode, is_numpy, pow2_decompose

Array = jax.Array
"""A JAX array (in 0.1 an alias of ``jax.Array`` too)."""

ArrayTypes = (jax.Array,)
"""Tuple for ``isinstance`` checks of JAX arrays (tracers are ``jax.Array`` instances)."""

DTypeLike = Any
Shape = Sequence[int]
Sharding = jax.sharding.Sharding


def get_numpy_api(x: Any) -> Any:
    """``numpy`` for NumPy arrays and scalars (folded at trace time), ``jax.numpy`` for JAX arrays.

    Raises a ``TypeError`` for anything else.
    """
    if isinstance(x, (np.ndarray, np.number)):
        return np
    if isinstance(x, jax.Array):
        return jnp
    raise TypeError(f"get_numpy_api: expected a NumPy or JAX array, got {type(x).__name__}.")


def get_scale_dtype(x: Any) -> np.dtype:
    """The dtype of ``x``'s scale: ``x.scale.dtype`` for a ``ScaledArray``, else ``x.dtype``.

    In 0.1 a plain array's implicit scale had the array's dtype; in this release the scales
    that scalify creates have the configured scale dtype (float32 by default), see
    :class:`jax_scalify.ScalifyConfig`.
    """
    if isinstance(x, ScaledArray):
        return np.dtype(x.scale.dtype)
    return np.dtype(x.dtype)


def make_scaled_scalar(value: Any, scale_dtype: DTypeLike = None) -> ScaledArray:
    """A 0-d ``ScaledArray`` from one floating value: data in ``[1, 2)``, scale a power of two.

    The split is exact (``value == data * scale``). A Python float becomes float32 first.

    Args:
        value: a floating scalar (Python float, NumPy or JAX 0-d array).
        scale_dtype: dtype of the scale (default: the value's dtype, as in 0.1).
    """
    if isinstance(value, float):
        value = np.float32(value)
    if not hasattr(value, "dtype"):
        value = np.asarray(value)
    if np.ndim(value) != 0 or not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(f"make_scaled_scalar expects a floating scalar, got {value!r}.")
    scale, mantissa = pow2_decompose(value, scale_dtype=scale_dtype or value.dtype, mode=Pow2RoundMode.DOWN)
    return ScaledArray(mantissa, scale)


def _static_mask(x: Any, predicate) -> np.ndarray:
    """Elementwise ``predicate`` where ``x`` is known now (NumPy), False where it is not."""
    if is_numpy(x):
        return predicate(np.asarray(x))
    return np.zeros(np.shape(x), np.bool_)


def is_static_zero(x: Any) -> np.ndarray:
    """Boolean NumPy mask of the elements known to be zero at trace time.

    A NumPy array or scalar is checked by value; a ``ScaledArray`` is zero where its data is
    a known zero or its scale is a known 0; a JAX array gives all False (not known).
    """
    if isinstance(x, ScaledArray):
        data = _static_mask(x.data, lambda v: v == 0)
        scale = _static_mask(x.scale, lambda v: v == 0)
        return np.logical_or(data, scale)
    return _static_mask(x, lambda v: v == 0)


def is_static_anyscale(x: Any) -> np.ndarray:
    """Boolean NumPy mask of the elements known at trace time to be ``0`` or ``±inf``.

    These values keep their value under any scale (see ``jax_scalify.extend.any_scale_array``).
    """

    def anyscale(v):
        return (v == 0) | np.isinf(v)

    if isinstance(x, ScaledArray):
        return np.logical_or(_static_mask(x.data, anyscale), _static_mask(x.scale, anyscale))
    return _static_mask(x, anyscale)


def is_static_one_scalar(x: Any) -> bool:
    """True if ``x`` is known at trace time to be the single value 1 (a ``ScaledArray`` as 1 * 1)."""
    if isinstance(x, (bool, int, float)):
        return x == 1
    if isinstance(x, ScaledArray):
        return np.size(x.data) == 1 and is_static_one_scalar(x.data) and is_static_one_scalar(x.scale)
    if is_numpy(x) and np.size(x) == 1:
        return bool(np.asarray(x).reshape(()) == 1)
    return False


def safe_div(lhs: Any, rhs: Any) -> Any:
    """``lhs / rhs`` for scalars, with 0 where ``rhs`` is 0 (NumPy in, NumPy out)."""
    if is_numpy(lhs) and is_numpy(rhs):
        lhs, rhs = np.asarray(lhs), np.asarray(rhs)
        return np.divide(lhs, rhs, out=np.zeros(np.broadcast_shapes(lhs.shape, rhs.shape), rhs.dtype), where=rhs != 0)
    return jnp.where(rhs == 0, jnp.zeros_like(rhs), lhs / jnp.where(rhs == 0, jnp.ones_like(rhs), rhs))


def safe_reciprocal(x: Any) -> Any:
    """``1 / x`` for scalars, with 0 where ``x`` is 0 (NumPy in, NumPy out)."""
    one = np.ones((), np.asarray(x).dtype) if is_numpy(x) else jnp.ones_like(x)
    return safe_div(one, x)


__all__ = [
    "Array",
    "ArrayTypes",
    "DTypeLike",
    "Shape",
    "Sharding",
    "get_numpy_api",
    "get_scale_dtype",
    "is_static_anyscale",
    "is_static_one_scalar",
    "is_static_zero",
    "make_scaled_scalar",
    "safe_div",
    "safe_reciprocal",
]
