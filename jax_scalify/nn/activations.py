"""Activations with custom scale rules: ``relu``, ``gelu``, ``silu``, ``softmax``, ``log_softmax``, ``logsumexp``.

Every function here is a :class:`jax_scalify.custom_scale` function: outside ``scalify`` it
is the ``jax.nn`` function of the same name (same values, same derivative, works under
``jit``, ``vmap`` and ``grad``); under ``scalify`` its forward is computed by the scale rule
documented in its docstring. Gradients taken inside ``scalify`` differentiate the plain
function with the generic rules.

Two families (the Scalify paper, appendix C):

- *near-identity maps* (``relu``, ``gelu``, ``silu``): ``f(x) = x * gate(x)`` with a gate in
  ``[0, 1]``, so ``f(x) ~ x`` for large positive ``x`` and ``f(x) ~ x / 2`` or ``0``
  elsewhere. The output keeps ``x``'s scale: the data keep their size and no new scale has
  to be chosen. The gate is computed on the value ``data * scale`` in float32 (it saturates
  to 0 or 1, so an underflowing or overflowing value gives the right gate), and the output
  data are ``data * gate``: one rounding to the data dtype, no intermediate that can leave
  the range of a narrow format;
- *shift-invariant maps* (``softmax``, ``log_softmax``, ``logsumexp``): computed in float32
  on the max-subtracted values ``(data - max(data)) * scale``; see each function for its
  output scale.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core.array import ScaledArray
from ..core.custom_scale import custom_scale
from ._util import Axis, axes_size, largest_pow2, max_with_one, normalize_axes, scalar_scale, scaled_output, widen

Array = Any


# --- near-identity maps: keep x's scale --------------------------------------------------------
def _gated(name: str, x: ScaledArray, gate: Callable[[Array], Array]) -> ScaledArray:
    """``data * gate(value)`` with ``x``'s scale; the gate evaluated on the float32 value."""
    scale = scalar_scale(name, x)
    data = widen(x.data)
    return scaled_output(data * gate(data * scale), x.dtype, x.scale)


@custom_scale
def relu(x: Array) -> Array:
    """``max(x, 0)`` (:func:`jax.nn.relu`, with its derivative 0 at 0).

    Scale rule: ``relu(data)`` with ``x``'s scale. Exact: relu commutes with multiplication
    by a positive scale, so nothing is rounded.
    """
    return jax.nn.relu(x)


@relu.defscale
def _relu_rule(x: ScaledArray) -> ScaledArray:
    return ScaledArray(jnp.maximum(x.data, jnp.zeros((), x.dtype)), x.scale)


def _gelu_tanh_gate(value: Array) -> Array:
    c = np.sqrt(2 / np.pi).astype(value.dtype)
    return 0.5 * (1.0 + jnp.tanh(c * (value + 0.044715 * (value**3))))


def _gelu_erf_gate(value: Array) -> Array:
    return 0.5 * lax.erfc(-value * np.sqrt(0.5).astype(value.dtype))


def _plain_gelu(x: Array, approximate: bool) -> Array:
    return jax.nn.gelu(x, approximate=approximate)


_gelu = custom_scale(_plain_gelu, static_argnums=(1,))
_gelu.__name__ = "gelu"


@_gelu.defscale
def _gelu_rule(x: ScaledArray, approximate: bool) -> ScaledArray:
    return _gated("gelu", x, _gelu_tanh_gate if approximate else _gelu_erf_gate)


def gelu(x: Array, approximate: bool = True) -> Array:
    """GELU, :func:`jax.nn.gelu`: ``x * Phi(x)`` (``approximate=True``: the tanh formula).

    Scale rule: output scale = ``x``'s scale, data = ``data * Phi(value)`` with the gate
    ``Phi`` (``0.5 * (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3)))`` or ``0.5 * erfc(-v / sqrt 2)``)
    computed on the float32 value. Why: GELU is ~identity for large ``x`` and ~``x/2`` near 0,
    so the output is as large as the input. Precision: the gate is a float32 function of the
    value, and the product is rounded once to the data dtype, so in float32 the result is
    the plain one up to round-off, and in float16/FP8 it is better than the plain function
    (which would evaluate the gate in the narrow format). Large negative inputs give data
    that underflow to 0, as the value would.
    """
    return _gelu(x, bool(approximate))


@custom_scale
def silu(x: Array) -> Array:
    """SiLU (swish), :func:`jax.nn.silu`: ``x * sigmoid(x)``.

    Scale rule: output scale = ``x``'s scale, data = ``data * sigmoid(value)``, the sigmoid
    computed on the float32 value. Same reasoning and precision as :func:`gelu`.
    """
    return jax.nn.silu(x)


@silu.defscale
def _silu_rule(x: ScaledArray) -> ScaledArray:
    return _gated("silu", x, jax.nn.sigmoid)


# --- shift-invariant maps --------------------------------------------------------------------
def softmax_multiplier(n: int, dtype: Any) -> int:
    """``2**floor(log2 n)``, capped at the largest power of two of ``dtype`` (1 for ``n <= 1``)."""
    k = 1 << (max(int(n), 1).bit_length() - 1)
    return int(min(k, largest_pow2(dtype)))


def _shifted_data(name: str, x: ScaledArray, axes: tuple[int, ...]) -> tuple[Array, Array]:
    """``(data - max(data), scale)`` in the work dtype; ``(data - max) * scale`` is ``x - max(x)``."""
    scale = scalar_scale(name, x)
    data = widen(x.data)
    return data - jnp.max(data, axes, keepdims=True), scale


def _plain_softmax(x: Array, axes: tuple[int, ...]) -> Array:
    return jax.nn.softmax(x, axis=axes)


_softmax = custom_scale(_plain_softmax, static_argnums=(1,))
_softmax.__name__ = "softmax"


@_softmax.defscale
def _softmax_rule(x: ScaledArray, axes: tuple[int, ...]) -> ScaledArray:
    diff, scale = _shifted_data("softmax", x, axes)
    unnormalised = jnp.exp(diff * scale)
    probs = unnormalised / jnp.sum(unnormalised, axes, keepdims=True)
    k = softmax_multiplier(axes_size(x.shape, axes), x.dtype)
    return scaled_output(probs * np.asarray(k, probs.dtype), x.dtype, np.float32(1.0 / k))


def softmax(x: Array, axis: Axis = -1) -> Array:
    """Softmax along ``axis`` (an int, a tuple, or None for all axes), :func:`jax.nn.softmax`.

    Scale rule: softmax is invariant to shifts and its input's scale only multiplies the
    shifted values, so it is computed in float32 on ``(data - max(data)) * scale`` (no
    overflow, as in the plain function). The output is ``p`` in ``[0, 1]`` summing to 1
    along the axis: its natural size is ``1/n`` (``n`` the number of elements along the
    axis), so the output scale is ``1/k`` with ``k = 2**floor(log2 n)`` and the data are
    ``k * p``: their mean along the axis is ``k/n`` in ``(1/2, 1]`` (unit scale), their
    maximum is at most ``k <= n``. Compared with scale 1 this moves the data up by
    ``log2 k`` binades: small probabilities do not underflow in float16/FP8, and the matmul
    that usually follows (attention ``p @ v``) gets unit-scale data both for flat
    (``p ~ 1/n``) and peaked distributions. ``k`` is capped at the largest power of two of
    the data dtype (256 for ``float8_e4m3fn``) so that ``k * p <= k`` always fits. The
    values are exact in float32: only a power of two separates them from the plain result.
    """
    return _softmax(x, normalize_axes("softmax", axis, jnp.ndim(x)))


def _plain_log_softmax(x: Array, axes: tuple[int, ...]) -> Array:
    return jax.nn.log_softmax(x, axis=axes)


_log_softmax = custom_scale(_plain_log_softmax, static_argnums=(1,))
_log_softmax.__name__ = "log_softmax"


@_log_softmax.defscale
def _log_softmax_rule(x: ScaledArray, axes: tuple[int, ...]) -> ScaledArray:
    diff, scale = _shifted_data("log_softmax", x, axes)
    lse = jnp.log(jnp.sum(jnp.exp(diff * scale), axes, keepdims=True))
    out_scale = max_with_one(x.scale)
    ratio, inv = scale / out_scale.astype(scale.dtype), 1 / out_scale.astype(scale.dtype)
    return scaled_output(diff * ratio - lse * inv, x.dtype, out_scale)


def log_softmax(x: Array, axis: Axis = -1) -> Array:
    """Log-softmax along ``axis``, :func:`jax.nn.log_softmax`: ``x - max(x) - log(sum(exp(x - max(x))))``.

    Scale rule: computed in float32 on the shifted values ``(data - max(data)) * scale``.
    The output is ``x - max(x)`` (size: the input's scale ``s``) minus a log-sum-exp term in
    ``[0, log n]`` (size about 1), so the output scale is ``max(s, 1)``. The output data are
    formed as ``(data - max) * (s / out_scale) - lse / out_scale`` with power-of-two
    ratios, so a huge scale cannot overflow the float32 intermediate. In float32 the
    values are the plain ones exactly (powers of two commute with rounding).
    """
    return _log_softmax(x, normalize_axes("log_softmax", axis, jnp.ndim(x)))


def _plain_logsumexp(x: Array, axes: tuple[int, ...], keepdims: bool) -> Array:
    return jax.nn.logsumexp(x, axis=axes, keepdims=keepdims)


_logsumexp = custom_scale(_plain_logsumexp, static_argnums=(1, 2))
_logsumexp.__name__ = "logsumexp"


@_logsumexp.defscale
def _logsumexp_rule(x: ScaledArray, axes: tuple[int, ...], keepdims: bool) -> ScaledArray:
    scale = scalar_scale("logsumexp", x)
    data = widen(x.data)
    top = jnp.max(data, axes, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, jnp.zeros_like(top))  # as jax.nn.logsumexp does
    lse = jnp.log(jnp.sum(jnp.exp((data - top) * scale), axes, keepdims=keepdims))
    if not keepdims:
        top = jnp.squeeze(top, axes)
    out_scale = max_with_one(x.scale)
    ratio, inv = scale / out_scale.astype(scale.dtype), 1 / out_scale.astype(scale.dtype)
    return scaled_output(top * ratio + lse * inv, x.dtype, out_scale)


def logsumexp(x: Array, axis: Axis = None, keepdims: bool = False) -> Array:
    """``log(sum(exp(x)))`` along ``axis`` (default: all axes), :func:`jax.nn.logsumexp`.

    Scale rule: ``max(x) + log(sum(exp(x - max(x))))`` computed in float32 with the maximum
    and the shifts taken on the data (``max(x) = max(data) * s``). The output is about
    ``max(x)`` (size ``s``) plus a term in ``[0, log n]`` (size about 1), so the output
    scale is ``max(s, 1)`` and the data are ``max(data) * (s / out_scale) + lse / out_scale``
    (power-of-two ratios: no overflow of the float32 value, exact in float32). A non-finite
    maximum is replaced by 0 before the shift, as in :func:`jax.nn.logsumexp`.
    """
    return _logsumexp(x, normalize_axes("logsumexp", axis, jnp.ndim(x)), bool(keepdims))
