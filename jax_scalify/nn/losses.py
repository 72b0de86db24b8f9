"""Losses with custom scale rules: ``cross_entropy``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..core.array import ScaledArray, is_floating_dtype
from ..core.custom_scale import custom_scale
from ..core.pow2 import pow2_decompose
from ._util import pow2_scale, scalar_scale, scaled_output, widen

Array = Any


def _picked(log_probs: Array, labels: Array) -> Array:
    return jnp.take_along_axis(log_probs, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]


@custom_scale
def _cross_entropy(logits: Array, labels: Array) -> Array:
    log_probs = jax.nn.log_softmax(widen(logits), axis=-1)
    return (-jnp.mean(_picked(log_probs, labels))).astype(logits.dtype)


_cross_entropy.__name__ = "cross_entropy"


@_cross_entropy.defscale
def _cross_entropy_rule(logits: ScaledArray, labels: Array) -> ScaledArray:
    scale = scalar_scale("cross_entropy", logits)
    data = widen(logits.data)
    diff = data - jnp.max(data, axis=-1, keepdims=True)
    lse = jnp.log(jnp.sum(jnp.exp(diff * scale), axis=-1))
    loss = jnp.mean(lse - _picked(diff, labels) * scale)
    out_scale, mantissa = pow2_decompose(loss)
    finite = jnp.isfinite(loss) & (loss != 0)
    # The exact split mantissa * 2**e; zero, inf and nan keep scale 1 (the data carry them).
    return scaled_output(jnp.where(finite, mantissa, loss), logits.dtype, pow2_scale(jnp.where(finite, out_scale, 1)))


def cross_entropy(logits: Array, labels: Array) -> Array:
    """Softmax cross-entropy with integer labels, averaged over all leading (batch) axes.

    ``-mean(log_softmax(logits, axis=-1)[..., label])``, computed in float32 (the result is
    cast to ``logits``'s dtype); ``logits`` has shape ``(..., classes)`` and ``labels`` the
    leading shape ``(...)``, integers in ``[0, classes)``.

    Scale rule: the log-softmax is computed in float32 on the shifted values
    ``(data - max(data)) * scale`` (the logits' scale only multiplies them), and the scalar
    loss is split exactly into a mantissa in ``[1, 2)`` (the data) and a power of two (the
    scale), as ``jsa.as_scaled_array`` does for a scalar: a loss of any size is held with
    the full precision of the data dtype. Gradients differentiate the plain function.
    """
    if not is_floating_dtype(jnp.result_type(logits)):
        raise TypeError(f"jsa.nn.cross_entropy: logits must be floating, got {jnp.result_type(logits)}.")
    if jnp.issubdtype(jnp.result_type(labels), jnp.floating) or jnp.ndim(labels) != jnp.ndim(logits) - 1:
        raise TypeError(
            "jsa.nn.cross_entropy expects integer labels of shape logits.shape[:-1], got "
            f"{jnp.result_type(labels)}{list(jnp.shape(labels))} for logits of shape {list(jnp.shape(logits))}. "
            "For one-hot or soft targets use -jnp.sum(targets * jsa.nn.log_softmax(logits), -1)."
        )
    return _cross_entropy(logits, labels)
