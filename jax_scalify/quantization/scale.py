"""Power-of-two scales and their OCP MX E8M0 encoding.

E8M0 (OCP Microscaling Formats spec v1.0) is an 8-bit unsigned exponent with bias 127: the
byte ``e`` stands for ``2**(e - 127)``, from ``2**-127`` (``0x00``) to ``2**127``
(``0xFE``); ``0xFF`` is NaN; there is no zero, no infinity and no sign. JAX has the
matching dtype ``jnp.float8_e8m0fnu``, which :func:`as_e8m0` returns (view it with
``jax.lax.bitcast_convert_type(e, jnp.uint8)`` for the raw exponent bytes).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.array import ScaledArray, is_floating_dtype

Array = Any
DTypeLike = Any

E8M0 = jnp.float8_e8m0fnu


def _check_floating(name: str, x: Array) -> Array:
    x = jnp.asarray(x)
    if not is_floating_dtype(x.dtype):
        raise TypeError(f"jsa.quantization.{name} expects a floating array, got dtype {x.dtype}.")
    return x


_UINT = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}
_IEEE = ("float16", "bfloat16", "float32", "float64")


@jax.jit
def _truncate_ieee(x: Array) -> Array:
    """Bit-level truncation for IEEE-style formats (sign, exponent, mantissa; top exponent inf/nan)."""
    nbits, nmant = x.dtype.itemsize * 8, int(jnp.finfo(x.dtype).nmant)
    uint = _UINT[x.dtype.itemsize]
    const = lambda v: jnp.asarray(v, uint)  # noqa: E731
    bits = jax.lax.bitcast_convert_type(x, uint)
    sign = bits & const(1 << (nbits - 1))
    magnitude = bits ^ sign
    exponent = magnitude >> const(nmant)
    normal = magnitude & ~const((1 << nmant) - 1)  # mantissa bits cleared
    # Subnormal: keep the highest set bit (clz is nbits for 0, and the shift then gives 0).
    subnormal = jnp.left_shift(const(1), const(nbits - 1) - jax.lax.clz(magnitude))
    subnormal = jnp.where(magnitude == 0, const(0), subnormal)
    special = exponent == const((1 << (nbits - 1 - nmant)) - 1)  # inf and nan: unchanged
    magnitude = jnp.where(special, magnitude, jnp.where(exponent == 0, subnormal, normal))
    return jax.lax.bitcast_convert_type(sign | magnitude, x.dtype)


def pow2_truncate(x: Array) -> Array:
    """Round each element down in magnitude to a power of two, keeping the sign.

    The mantissa is truncated: ``pow2_truncate(x) == sign(x) * 2**floor(log2|x|)``, exactly,
    subnormals included (computed on the bits). ``±0``, ``±inf`` and ``nan`` are returned
    unchanged; the dtype is kept (FP8 formats are truncated through float32, exactly). A
    ``ScaledArray`` (outside scalify) has its data truncated and its scale, a power of two,
    kept: the value is truncated the same way. Inside a scalified function apply it to
    plain values (e.g. a scale from ``jsa.lax.get_data_scale``): its bit operations have
    no scale rules.
    """
    if isinstance(x, ScaledArray):
        return ScaledArray(pow2_truncate(x.data), x.scale)
    x = _check_floating("pow2_truncate", x)
    if x.dtype.name in _IEEE:
        return _truncate_ieee(x)
    return _truncate_ieee(x.astype(jnp.float32)).astype(x.dtype)


def as_e8m0(x: Array) -> Array:
    """Encode positive power-of-two scales as E8M0 (``jnp.float8_e8m0fnu``).

    Powers of two from ``2**-127`` to ``2**127`` are encoded exactly. Other values are
    rounded down to a power of two (like :func:`pow2_truncate` and the MX shared-exponent
    rule ``floor(log2(amax))``; a plain ``x.astype(jnp.float8_e8m0fnu)`` rounds to
    nearest instead). Out of the format:

    - ``0`` and positive values below ``2**-127`` saturate to ``2**-127`` (``0x00``): E8M0
      has no zero, and a tiny scale keeps zero data zero where NaN would poison it;
    - negative values, ``inf``, ``nan`` and values of ``2**128`` or more (float64 input)
      give NaN (``0xFF``).
    """
    return _encode_e8m0(_check_floating("as_e8m0", x))


@jax.jit
def _encode_e8m0(x: Array) -> Array:
    if x.dtype == jnp.float64:
        x = pow2_truncate(x)  # exact truncation before the (rounding) cast to float32
    x32 = x.astype(jnp.float32)
    exponent = jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(x32, jnp.uint32), jnp.uint32(23))
    exponent = exponent & jnp.uint32(0xFF)  # the biased float32 exponent: the E8M0 byte
    nan = jnp.isnan(x32) | (x32 < 0)
    byte = jnp.where(nan, jnp.uint32(0xFF), exponent).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(byte, E8M0)


def from_e8m0(x: Array, dtype: DTypeLike = jnp.float32) -> Array:
    """Decode E8M0 scales to floating values ``2**(e - 127)`` in ``dtype``.

    Args:
        x: ``jnp.float8_e8m0fnu`` values, or ``uint8`` exponent bytes.
        dtype: the output dtype. Scales outside its range become 0 or inf (e.g. below
            ``2**-24`` or from ``2**16`` up in float16); ``0xFF`` gives NaN.
    """
    x = jnp.asarray(x)
    if x.dtype == jnp.uint8:
        x = jax.lax.bitcast_convert_type(x, E8M0)
    elif x.dtype != E8M0:
        raise TypeError(
            f"jsa.quantization.from_e8m0 expects float8_e8m0fnu or uint8 exponent bytes, got {x.dtype}. "
            "Encode scales first with jsa.quantization.as_e8m0."
        )
    if not is_floating_dtype(dtype):
        raise TypeError(f"jsa.quantization.from_e8m0 needs a floating output dtype, got {np.dtype(dtype)}.")
    return x.astype(dtype)
