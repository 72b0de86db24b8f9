"""Normalisation layers with custom scale rules: ``layer_norm``, ``rms_norm``, ``layer_norm_grad_rescale``.

A normalisation divides its input by its own spread, so the input's scale cancels out: the
rules normalise the *data* and never form the value ``data * scale``. The only place the
scale is left is ``eps``, which is added to the variance of the value: in data units it is
``eps / scale**2``. The normalised output has RMS at most 1 (exactly ``sigma / sqrt(sigma^2
+ eps)`` per normalised slice), so its natural scale is 1; it is moved below 1 only when
``eps`` dominates (input values below ``sqrt(eps)``), so that the data stay unit-RMS in
float16 and FP8 even then. The gain and bias are applied afterwards with the library's
``mul`` and ``add`` rules.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.array import ScaledArray
from ..core.custom_scale import custom_scale
from ..core.interpreter import scalify
from ..core.measure import Norm
from ..core.pow2 import pow2_round_up
from ..ops.rescaling import dynamic_rescale_grad
from ..policy import STATIC_POLICY
from ._util import Axis, normalize_axes, pow2_scale, scalar_scale, scaled_output, widen

Array = Any


def _affine(y: Array, gain: Array | None, bias: Array | None) -> Array:
    """``y * gain + bias`` (either may be None); plain JAX, also run under ``scalify`` by the rules."""
    if gain is not None:
        y = y * gain
    if bias is not None:
        y = y + bias
    return y


# The gain and bias with the mul and add rules (one trace cache); no automatic rescale inside a rule.
_scaled_affine = scalify(_affine, policy=STATIC_POLICY)


def _plain_normalise(x: Array, axes: tuple[int, ...], eps: float, center: bool) -> Array:
    """``(x - mean) / sqrt(var + eps)`` (or ``x / sqrt(mean(x^2) + eps)``), statistics in float32."""
    xw = widen(x)
    if center:
        xw = xw - jnp.mean(xw, axes, keepdims=True)
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(xw), axes, keepdims=True) + np.asarray(eps, xw.dtype))
    return (xw * inv).astype(jnp.result_type(x))


def _normalise_rule(name: str, x: ScaledArray, axes: tuple[int, ...], eps: float, center: bool) -> ScaledArray:
    """The normalisation on the data: unit-RMS data, scale 1 unless ``eps`` dominates.

    With ``c`` the (centred) data, ``sigma^2 = mean(c^2)`` and ``e = sqrt(eps) / scale`` (the
    square root of ``eps`` in data units), the output value is ``c / hypot(sigma, e)``
    (``hypot`` cannot overflow). Its RMS per slice is ``g = sigma / hypot(sigma, e) <= 1``;
    the output scale (one for the whole tensor) is the power of two just above the largest
    ``g`` (1 unless ``eps`` dominates every slice) and the data are
    ``c / (hypot(sigma, e) * out_scale)``: RMS at most 1 per slice, in ``(1/2, 1]`` for the
    largest.
    """
    scale = scalar_scale(name, x)
    data = widen(x.data)
    if center:
        data = data - jnp.mean(data, axes, keepdims=True)
    sigma = jnp.sqrt(jnp.mean(jnp.square(data), axes, keepdims=True))
    root_eps = np.sqrt(np.asarray(eps, np.float64)).astype(data.dtype) / scale
    denom = jnp.hypot(sigma, root_eps)
    ratio = jnp.where(denom > 0, sigma / jnp.where(denom > 0, denom, 1), 0)
    g_max = jnp.max(ratio) if ratio.size else jnp.zeros((), ratio.dtype)
    out_scale = pow2_round_up(g_max)
    out_scale = jnp.where(jnp.isfinite(out_scale) & (out_scale > 0), out_scale, jnp.ones_like(out_scale))
    return scaled_output(data / (denom * out_scale), x.dtype, pow2_scale(out_scale))


def _check_eps(name: str, eps: float) -> float:
    eps = float(eps)
    if not (np.isfinite(eps) and eps >= 0):
        raise ValueError(f"jsa.nn.{name}: eps must be a finite number >= 0, got {eps!r}.")
    return eps


def _plain_layer_norm(x: Array, gain: Array | None, bias: Array | None, axes: tuple[int, ...], eps: float) -> Array:
    return _affine(_plain_normalise(x, axes, eps, center=True), gain, bias)


_layer_norm = custom_scale(_plain_layer_norm, static_argnums=(3, 4))
_layer_norm.__name__ = "layer_norm"


@_layer_norm.defscale
def _layer_norm_rule(x: ScaledArray, gain, bias, axes: tuple[int, ...], eps: float) -> ScaledArray:
    y = _normalise_rule("layer_norm", x, axes, eps, center=True)
    return _scaled_affine(y, gain, bias)


def layer_norm(
    x: Array, scale: Array | None = None, bias: Array | None = None, axis: Axis = -1, eps: float = 1e-5
) -> Array:
    """LayerNorm: ``(x - mean) / sqrt(var + eps) * scale + bias``, statistics over ``axis``.

    Outside scalify this is :func:`jax.nn.standardize` (``algorithm="stable"``) followed by
    the gain and bias, with the mean and variance computed in float32 for narrower inputs
    (the normalised value is cast back to ``x``'s dtype before the gain).

    Args:
        x: the input.
        scale: optional gain, broadcastable to ``x`` (e.g. shape ``(x.shape[-1],)`` for
            ``axis=-1``); a ``ScaledArray`` or a plain array under scalify.
        bias: optional bias, broadcastable to ``x``.
        axis: the normalised axes (an int, a tuple, or None for all axes).
        eps: added to the variance of the value.

    Scale rule: the input's scale cancels out of the normalisation, so the data are
    centred and normalised in float32 with ``eps / scale**2`` in place of ``eps``; the
    output has scale 1 and data of RMS 1 per slice. When ``eps`` dominates (input values
    below ``sqrt(eps)``) a slice's output RMS is ``g < 1``: the scale is then the power of
    two just above the largest ``g``, so the data stay unit-RMS (largest slice RMS in
    ``(1/2, 1]``) in float16 and FP8 too. Then ``* scale + bias`` use
    the ``mul`` and ``add`` rules (output scale ``s_gain``, then
    ``pow2(sqrt(s^2 + s_bias^2))``). In float32 the values match the plain function to
    round-off, for any input scale.
    """
    eps = _check_eps("layer_norm", eps)
    return _layer_norm(x, scale, bias, normalize_axes("layer_norm", axis, jnp.ndim(x)), eps)


def _plain_rms_norm(x: Array, gain: Array | None, axes: tuple[int, ...], eps: float) -> Array:
    return _affine(_plain_normalise(x, axes, eps, center=False), gain, None)


_rms_norm = custom_scale(_plain_rms_norm, static_argnums=(2, 3))
_rms_norm.__name__ = "rms_norm"


@_rms_norm.defscale
def _rms_norm_rule(x: ScaledArray, gain, axes: tuple[int, ...], eps: float) -> ScaledArray:
    y = _normalise_rule("rms_norm", x, axes, eps, center=False)
    return y if gain is None else _scaled_affine(y, gain, None)


def rms_norm(x: Array, scale: Array | None = None, axis: Axis = -1, eps: float = 1e-6) -> Array:
    """RMSNorm: ``x / sqrt(mean(x**2) + eps) * scale``, the mean over ``axis``.

    Outside scalify: ``jax.nn.standardize(x, axis, mean=0, epsilon=eps)`` times the gain,
    the mean square computed in float32 for narrower inputs.

    Args:
        x: the input.
        scale: optional gain, broadcastable to ``x``.
        axis: the normalised axes (an int, a tuple, or None for all axes).
        eps: added to the mean square of the value.

    Scale rule: as :func:`layer_norm` without centring: the data are normalised in float32
    with ``eps / scale**2``, output scale 1 and unit-RMS data (``eps``-dominated inputs
    move their RMS into the scale), then the gain's ``mul`` rule.
    """
    eps = _check_eps("rms_norm", eps)
    return _rms_norm(x, scale, normalize_axes("rms_norm", axis, jnp.ndim(x)), eps)


def layer_norm_grad_rescale(
    x: Array,
    scale: Array | None = None,
    bias: Array | None = None,
    axis: Axis = -1,
    eps: float = 1e-5,
    norm: Norm = "l2",
) -> Array:
    """:func:`layer_norm` whose input gradient is dynamically rescaled (Scalify paper, algorithm 5).

    The forward is exactly :func:`layer_norm`. In the backward pass the cotangent of ``x``
    goes through :func:`jax_scalify.ops.dynamic_rescale_grad` (``norm``: ``"l2"`` by
    default): the gradient of a normalisation is divided by the input's spread, which the
    static unit-scaling rules cannot predict, so its scale is re-estimated from the
    measured statistic. A no-op on values, with or without scalify.
    """
    return layer_norm(dynamic_rescale_grad(x, norm), scale, bias, axis, eps)
