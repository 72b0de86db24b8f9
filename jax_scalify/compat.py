"""jax-scalify 0.1's names kept only so that code written for 0.1 runs unchanged: the one list of them.

``NAMES_0_1`` maps each namespace of 0.1 to the names it keeps for 0.1 alone; the namespace
holds them as attributes set from here (``from jax_scalify.core import make_scaled_scalar``,
``jsa.lax.scaled_add`` ...), but they are not in its ``__all__``. New code uses the current
API instead: the package's names, ``jsa.ops.debug_callback``, the scaling primitives in
``jsa.lax``, the registry in ``jax_scalify.extend``; 0.1's rule functions
(``jsa.lax.scaled_add`` ...) are in their modules (``jax_scalify.lax.rules_arithmetic`` ...).
See ``docs/migration.md`` for each difference of behaviour and the reason for it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .core import (
    Pow2RoundMode,
    ScaledArray,
    ScalifyConfig,
    as_scaled_array,
    asarray,
    is_scaled_leaf,
    scaled_array,
    scalify,
)
from .core.pow2 import is_numpy, pow2_decompose
from .core.registry import ScaledPrimitiveType, find_registered_scaled_op, register_scaled_lax_op, register_scaled_op
from .lax.primitives import get_data_scale_p, set_scaling_p, stop_scaling_p
from .lax.rules_arithmetic import (
    scaled_add,
    scaled_convert_element_type,
    scaled_div,
    scaled_eq,
    scaled_ge,
    scaled_gt,
    scaled_le,
    scaled_lt,
    scaled_max,
    scaled_min,
    scaled_mul,
    scaled_ne,
    scaled_reduce_precision,
    scaled_select_n,
    scaled_stop_gradient,
    scaled_sub,
)
from .lax.rules_layout import (
    scaled_broadcast_in_dim,
    scaled_concatenate,
    scaled_pad,
    scaled_reshape,
    scaled_rev,
    scaled_slice,
    scaled_transpose,
)
from .lax.rules_linalg import scaled_conv_general_dilated, scaled_dot_general
from .lax.rules_reduce import (
    scaled_argmax,
    scaled_argmin,
    scaled_reduce_max,
    scaled_reduce_min,
    scaled_reduce_prod,
    scaled_reduce_sum,
    scaled_reduce_window_max,
    scaled_reduce_window_min,
    scaled_reduce_window_sum,
)
from .lax.rules_unary import (
    scaled_abs,
    scaled_cos,
    scaled_exp,
    scaled_integer_pow,
    scaled_is_finite,
    scaled_log,
    scaled_neg,
    scaled_sign,
    scaled_sin,
    scaled_sqrt,
)
from .ops import debug_callback

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


_CORE_0_1 = (
    # 0.1's types and helpers, defined here
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
    # the package's names, which 0.1 also had in core
    "Pow2RoundMode",
    "ScaledArray",
    "ScalifyConfig",
    "as_scaled_array",
    "asarray",
    "is_scaled_leaf",
    "scaled_array",
    "scalify",
    # the registry, for rule authors in jax_scalify.extend now; debug_callback is in jsa.ops
    "ScaledPrimitiveType",
    "find_registered_scaled_op",
    "register_scaled_lax_op",
    "register_scaled_op",
    "debug_callback",
)

_LAX_0_1 = (
    # the scaling primitives' JAX primitives
    "get_data_scale_p",
    "set_scaling_p",
    "stop_scaling_p",
    # 0.1's rule functions (every rule is in its module: jax_scalify.lax.rules_arithmetic ...)
    "scaled_abs",
    "scaled_add",
    "scaled_argmax",
    "scaled_argmin",
    "scaled_broadcast_in_dim",
    "scaled_concatenate",
    "scaled_conv_general_dilated",
    "scaled_convert_element_type",
    "scaled_cos",
    "scaled_div",
    "scaled_dot_general",
    "scaled_eq",
    "scaled_exp",
    "scaled_ge",
    "scaled_gt",
    "scaled_integer_pow",
    "scaled_is_finite",
    "scaled_le",
    "scaled_log",
    "scaled_lt",
    "scaled_max",
    "scaled_min",
    "scaled_mul",
    "scaled_ne",
    "scaled_neg",
    "scaled_pad",
    "scaled_reduce_max",
    "scaled_reduce_min",
    "scaled_reduce_precision",
    "scaled_reduce_prod",
    "scaled_reduce_sum",
    "scaled_reduce_window_max",
    "scaled_reduce_window_min",
    "scaled_reduce_window_sum",
    "scaled_reshape",
    "scaled_rev",
    "scaled_select_n",
    "scaled_sign",
    "scaled_sin",
    "scaled_slice",
    "scaled_sqrt",
    "scaled_stop_gradient",
    "scaled_sub",
    "scaled_transpose",
)

NAMES_0_1: dict[str, tuple[str, ...]] = {
    "jax_scalify": ("debug_callback",),
    "jax_scalify.core": _CORE_0_1,
    "jax_scalify.lax": _LAX_0_1,
}
"""Each 0.1 namespace and the names it keeps for 0.1 only (its current API is its ``__all__``)."""


def _install() -> None:
    """Each 0.1 name set as an attribute of its namespace (not in its ``__all__``).

    This module is the package's last import and sets the names from above, so that no
    layer below imports it.
    """
    for namespace, names in NAMES_0_1.items():
        module = sys.modules[namespace]
        for name in names:
            setattr(module, name, globals()[name])


_install()


__all__ = sorted({name for names in NAMES_0_1.values() for name in names})
