"""Casts and precision reductions that act on one pass only (forward or backward).

They build FP8 recipes where the forward and the backward use different formats (E4M3
activations and weights, E5M2 gradients). Each takes and returns a single floating array
(apply ``jax.tree.map`` for pytrees). Under scalify the data is cast or rounded and the
scale kept, so the value is kept up to the rounding of the format.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.array import is_floating_dtype

Array = Any
DTypeLike = Any


def _check(name: str, x: Array, dtype: DTypeLike) -> np.dtype:
    if not hasattr(x, "dtype") or not is_floating_dtype(x.dtype):
        raise TypeError(
            f"jsa.ops.{name} expects a floating array, got {getattr(x, 'dtype', type(x).__name__)}. "
            "Apply it to each floating leaf (jax.tree.map) rather than to a whole pytree."
        )
    if not is_floating_dtype(dtype):
        raise TypeError(f"jsa.ops.{name} needs a floating dtype, got {np.dtype(dtype)}.")
    return np.dtype(dtype)


def cast_on_forward(x: Array, dtype: DTypeLike) -> Array:
    """Cast ``x`` to ``dtype`` in the forward pass; the cotangent is cast back to ``x.dtype``.

    This is ``lax.convert_element_type``, whose transpose already casts the cotangent back.
    Under scalify the data is cast and the scale kept.
    """
    dtype = _check("cast_on_forward", x, dtype)
    return jax.lax.convert_element_type(x, dtype)


def cast_on_backward(x: Array, dtype: DTypeLike) -> Array:
    """Identity in the forward pass; the cotangent is cast to ``dtype`` in the backward pass.

    The cotangent flowing back into the producer of ``x`` then has ``dtype`` (e.g. E5M2
    gradients into the backward matmuls of a linear layer). Under scalify the cotangent's
    data is cast and its scale kept.

    Caveat (JAX): the cotangent of ``x`` really has ``dtype``, so whatever consumes it in the
    backward pass must accept that dtype. ``dot_general`` and ``conv`` do (their transposes
    are mixed-precision matmuls, e.g. E5M2 x E4M3 -> float32), so apply it to the output of
    a matmul. Element-wise transposes (``mul``, ``add``) fail on mixed dtypes, and if ``x``
    has several uses JAX cannot add cotangents of different dtypes (an ``AssertionError``
    naming both avals). ``jax.grad`` with respect to ``x`` itself returns a ``dtype``
    gradient.
    """
    dtype = _check("cast_on_backward", x, dtype)

    @jax.custom_vjp
    def identity(a):
        return a

    identity.defvjp(lambda a: (a, None), lambda _, ct: (jax.lax.convert_element_type(ct, dtype),))
    return identity(x)


def _bits(dtype: np.dtype) -> tuple[int, int]:
    info = jnp.finfo(dtype)
    return int(info.nexp), int(info.nmant)


def _reduce_precision(x: Array, dtype: np.dtype) -> Array:
    exponent_bits, mantissa_bits = _bits(dtype)
    return jax.lax.reduce_precision(x, exponent_bits=exponent_bits, mantissa_bits=mantissa_bits)


_RP_NOTE = """
    ``jax.lax.reduce_precision`` keeps the exponent and mantissa widths of ``dtype`` in IEEE
    style (bias ``2**(e-1) - 1``, top exponent for inf/nan) and rounds to nearest even.
    Within the normal range of ``dtype`` it rounds exactly like ``x.astype(dtype)`` for
    ``float8_e4m3fn``, ``float8_e5m2``, ``float16`` and ``bfloat16``, with two differences
    from a real cast: values below the smallest normal become 0 (XLA emulates no
    subnormals), and for ``float8_e4m3fn`` values above 240 become inf (a cast reaches 448).
    Formats with another exponent bias (``*fnuz``) are not emulated faithfully. Use
    :func:`cast_on_forward` for an actual cast.
"""


def reduce_precision_on_forward(x: Array, dtype: DTypeLike) -> Array:
    """Round ``x`` to the precision of ``dtype`` in the forward pass; identity on the cotangent.

    The dtype of ``x`` is kept. Under scalify the data is rounded and the scale kept.
    """
    dtype = _check("reduce_precision_on_forward", x, dtype)

    @jax.custom_vjp
    def rounded(a):
        return _reduce_precision(a, dtype)

    rounded.defvjp(lambda a: (_reduce_precision(a, dtype), None), lambda _, ct: (ct,))
    return rounded(x)


def reduce_precision_on_backward(x: Array, dtype: DTypeLike) -> Array:
    """Identity in the forward pass; the cotangent is rounded to the precision of ``dtype``.

    The cotangent keeps its dtype (compare :func:`cast_on_backward`), so this works
    wherever ``x`` is used. Under scalify the cotangent's data is rounded and its scale kept.
    """
    dtype = _check("reduce_precision_on_backward", x, dtype)

    @jax.custom_vjp
    def identity(a):
        return a

    identity.defvjp(lambda a: (a, None), lambda _, ct: (_reduce_precision(ct, dtype),))
    return identity(x)


reduce_precision_on_forward.__doc__ += _RP_NOTE
reduce_precision_on_backward.__doc__ += _RP_NOTE


__all__ = ["cast_on_backward", "cast_on_forward", "reduce_precision_on_backward", "reduce_precision_on_forward"]
