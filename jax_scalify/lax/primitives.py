"""The scaling primitives: ``set_scaling``, ``get_data_scale``, ``stop_scaling``, ``rebalance``.

Each is a real JAX primitive, the identity on values outside ``scalify`` (``get_data_scale``
returns ``(x, 1)``), so a model that calls them computes the same thing with or without
scalify (the paper's model-invariance guarantee) and works under ``jax.jit``, ``jax.grad``
and ``jax.vmap``. Under ``scalify`` their rules act on the ``(data, scale)`` pair.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ..core.array import ScaledArray, is_floating_dtype, unscaled
from ..core.config import get_scalify_config
from ..core.registry import ScaledPrimitiveType, Site, register_scaled_op
from ..core.scaling import as_scale, mul_data
from ..core.sites import mark_rescaled

Array = Any


def _check_floating(name: str, x) -> None:
    if not is_floating_dtype(jnp.result_type(x)):
        raise TypeError(f"jsa.lax.{name} expects a floating array, got dtype {jnp.result_type(x)}.")


def _checked_scale(name: str, scale) -> Array:
    scale = jnp.asarray(scale)
    if scale.ndim != 0 or not is_floating_dtype(scale.dtype):
        raise TypeError(f"jsa.lax.{name}: the scale must be a floating scalar, got {scale.dtype}{list(scale.shape)}.")
    return scale.astype(get_scalify_config().scale_dtype)


def _batch_scale_to_scalar(scale, bdim):
    """Any positive scale keeps the value; under vmap one scale for the whole batch is the largest."""
    return scale if bdim is None else jnp.max(scale, axis=bdim)


def _instantiate(tangent, primal):
    return ad.instantiate_zeros(tangent) if isinstance(tangent, ad.Zero) else tangent


def _define_identity_with_scale_operand(prim: Primitive) -> None:
    """Register ``prim(x, scale)`` as the identity on ``x`` outside scalify.

    Evaluation, lowering, JVP, transpose and batching all pass ``x`` through; the scalar
    scale operand gets no gradient, and under ``vmap`` a batched scale becomes its maximum.
    """
    prim.def_abstract_eval(lambda x, scale: x)
    prim.def_impl(lambda x, scale: x)
    mlir.register_lowering(prim, mlir.lower_fun(lambda x, scale: x, multiple_results=False))
    ad.primitive_jvps[prim] = lambda primals, tangents: (prim.bind(*primals), _instantiate(tangents[0], primals[0]))
    ad.primitive_transposes[prim] = lambda ct, x, scale: [ct, None]
    batching.primitive_batchers[prim] = lambda args, dims: (
        prim.bind(args[0], _batch_scale_to_scalar(args[1], dims[1])),
        dims[0],
    )


# --- set_scaling -----------------------------------------------------------------------------
set_scaling_p = Primitive("set_scaling")


def set_scaling(x: Array, scale: Array) -> Array:
    """Give ``x`` the scale ``scale`` (a floating scalar, in general a power of two).

    Under scalify the result is a ``ScaledArray`` with that scale and the same value (the data
    is rebalanced), even when ``x`` was unscaled. A zero scale asserts that ``x`` is zero.
    Outside scalify it is the identity.
    """
    _check_floating("set_scaling", x)
    return set_scaling_p.bind(x, _checked_scale("set_scaling", scale))


_define_identity_with_scale_operand(set_scaling_p)


@register_scaled_op(set_scaling_p, scaled_type=ScaledPrimitiveType.ALWAYS_SCALE)
def scaled_set_scaling(x: ScaledArray, scale: Array) -> ScaledArray:
    """Scale set to the given one, data rebalanced (a zero scale gives zero data).

    The rescale policy leaves the result's scale as it is: a scale the user set stands.
    """
    scale = as_scale(unscaled(scale))
    inv = jnp.where(scale == 0, jnp.zeros_like(scale), 1 / jnp.where(scale == 0, 1, scale))
    data = mul_data(x.data, as_scale(x.scale) * inv)
    return mark_rescaled(ScaledArray(data, scale), explicit=True)


# --- get_data_scale --------------------------------------------------------------------------
get_data_scale_p = Primitive("get_data_scale")
get_data_scale_p.multiple_results = True


def get_data_scale(x: Array) -> tuple[Array, Array]:
    """Unbundle ``x`` into ``(data, scale)``.

    Under scalify these are the ``ScaledArray``'s data and scale (plain arrays); an unscaled
    ``x`` gives ``(x, 1)``. Outside scalify: ``(x, 1)``. The scale has the configured scale
    dtype.
    """
    _check_floating("get_data_scale", x)
    return tuple(get_data_scale_p.bind(x, scale_dtype=np.dtype(get_scalify_config().scale_dtype)))


def _get_data_scale_impl(x, *, scale_dtype):
    return x, jnp.ones((), scale_dtype)


get_data_scale_p.def_impl(_get_data_scale_impl)
get_data_scale_p.def_abstract_eval(lambda x, *, scale_dtype: (x, jax.core.ShapedArray((), scale_dtype)))
mlir.register_lowering(get_data_scale_p, mlir.lower_fun(_get_data_scale_impl, multiple_results=True))


def _get_data_scale_jvp(primals, tangents, *, scale_dtype):
    (x,), (tx,) = primals, tangents
    data, scale = get_data_scale_p.bind(x, scale_dtype=scale_dtype)
    return (data, scale), (_instantiate(tx, x), ad.Zero(jax.core.ShapedArray((), scale_dtype)))


def _get_data_scale_transpose(cts, x, *, scale_dtype):
    ct_data, _ = cts
    return [None if isinstance(ct_data, ad.Zero) else ct_data]


ad.primitive_jvps[get_data_scale_p] = _get_data_scale_jvp
ad.primitive_transposes[get_data_scale_p] = _get_data_scale_transpose
batching.primitive_batchers[get_data_scale_p] = lambda args, dims, *, scale_dtype: (
    get_data_scale_p.bind(args[0], scale_dtype=scale_dtype),
    (dims[0], None),
)


@register_scaled_op(get_data_scale_p, scaled_type=ScaledPrimitiveType.ALWAYS_SCALE)
def scaled_get_data_scale(x: ScaledArray, *, scale_dtype) -> tuple[Array, Array]:
    """Returns the data and the scale as plain arrays."""
    return x.data, jnp.asarray(x.scale).astype(scale_dtype)


# --- stop_scaling ----------------------------------------------------------------------------
stop_scaling_p = Primitive("stop_scaling")


def stop_scaling(x: Array, dtype: Any = None) -> Array:
    """The plain value of ``x`` (``data * scale``), cast to ``dtype`` if given.

    Use it where a computation must see real values (e.g. before a loss printed to the
    user). Outside scalify it is the identity (or a cast).
    """
    _check_floating("stop_scaling", x)
    dtype = np.dtype(jnp.result_type(x) if dtype is None else dtype)
    return stop_scaling_p.bind(x, dtype=dtype)


def _stop_scaling_impl(x, *, dtype):
    return x.astype(dtype)


stop_scaling_p.def_impl(_stop_scaling_impl)
stop_scaling_p.def_abstract_eval(lambda x, *, dtype: jax.core.ShapedArray(x.shape, dtype))
mlir.register_lowering(stop_scaling_p, mlir.lower_fun(_stop_scaling_impl, multiple_results=False))
ad.primitive_jvps[stop_scaling_p] = lambda primals, tangents, *, dtype: (
    stop_scaling_p.bind(primals[0], dtype=dtype),
    _instantiate(tangents[0], primals[0]).astype(dtype),
)
ad.primitive_transposes[stop_scaling_p] = lambda ct, x, *, dtype: [ct.astype(x.aval.dtype)]
batching.primitive_batchers[stop_scaling_p] = lambda args, dims, *, dtype: (
    stop_scaling_p.bind(args[0], dtype=dtype),
    dims[0],
)


@register_scaled_op(stop_scaling_p, site=Site.VALUE)
def scaled_stop_scaling(x: ScaledArray, *, dtype) -> Array:
    """Plain output: the value ``data * scale`` in the requested dtype."""
    return x.to_array(dtype)


# --- rebalance -------------------------------------------------------------------------------
rebalance_p = Primitive("rebalance")


def rebalance(x: Array, factor: Array) -> Array:
    """Move the power-of-two ``factor`` from the data to the scale: data / factor, scale * factor.

    The value is unchanged. Under scalify an unscaled ``x`` is treated as scale 1. Outside
    scalify it is the identity.
    """
    _check_floating("rebalance", x)
    return rebalance_p.bind(x, _checked_scale("rebalance", factor))


_define_identity_with_scale_operand(rebalance_p)


@register_scaled_op(rebalance_p, scaled_type=ScaledPrimitiveType.ALWAYS_SCALE)
def scaled_rebalance(x: ScaledArray, factor: Array) -> ScaledArray:
    """Data divided by the factor, scale multiplied by it."""
    factor = as_scale(unscaled(factor))
    return ScaledArray(mul_data(x.data, 1 / factor), as_scale(x.scale) * factor)


__all__ = [
    "get_data_scale",
    "get_data_scale_p",
    "rebalance",
    "rebalance_p",
    "scaled_get_data_scale",
    "scaled_rebalance",
    "scaled_set_scaling",
    "scaled_stop_scaling",
    "set_scaling",
    "set_scaling_p",
    "stop_scaling",
    "stop_scaling_p",
]
