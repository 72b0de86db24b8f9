"""Special constants beside scaled data: NaN, ±inf, 0, the data dtype's largest value and denormals.

A constant whose value is the same at every scale (NaN, ±inf, 0) or that fits at every scale
(a denormal) takes the scale of the traced data it meets; the dtype's largest finite value fits
with a factor 2 of headroom. None of them may raise the common scale far enough to flush the
traced data.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa


def test_var_gradient_of_float16_data_follows_float32():
    """``jnp.var`` ends with ``where(normalizer > 0, result, nan)``: the NaN constant counted as a
    scale of 1, raised the variance's scale by ``2**14`` (its float16 data fell to ``2**-10``), and
    the gradient of ``rsqrt(var + eps)`` overflowed; ``mean((x - mean) ** 2)`` was fine."""
    x32 = 0.02 * jax.random.normal(jax.random.key(0), (8, 64, 64))
    x16 = x32.astype(jnp.float16)

    def loss(x):
        return jnp.sum(jax.lax.rsqrt(jnp.var(x, -1, keepdims=True) + 1e-5))

    grad = jax.jit(jsa.scalify(jax.grad(loss)))(jsa.as_scaled_array(x16))
    got = np.asarray(jsa.asarray(grad, jnp.float32))
    expected = np.asarray(jax.grad(loss)(x16.astype(jnp.float32)))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, expected, rtol=0, atol=5e-3 * np.max(np.abs(expected)))


def _classes(dtype) -> dict[str, float]:
    info = jnp.finfo(dtype)
    return {
        "nan": np.nan,
        "inf": np.inf,
        "-inf": -np.inf,
        "zero": 0.0,
        "max": float(info.max),
        "min": float(info.min),
        "smallest_subnormal": float(info.smallest_subnormal),
        "-smallest_subnormal": -float(info.smallest_subnormal),
        "float32_smallest_subnormal": float(jnp.finfo(jnp.float32).smallest_subnormal),
    }


MASK = np.arange(16) % 3 == 0
OPS = {
    "where": lambda x, c: jnp.where(MASK, x, c),
    "where_on_x": lambda x, c: jnp.where(x > 0, x, c),
    "maximum": lambda x, c: jnp.maximum(x, c),
    "minimum": lambda x, c: jnp.minimum(x, c),
    "clip_below": lambda x, c: jnp.clip(x, c, None),
    "concatenate": lambda x, c: jnp.concatenate([x, jnp.full((2,), c, x.dtype)]),
    "add": lambda x, c: x + c,
}
# Constants that take the traced data's scale: the result keeps it exactly.
TAKE_ANY_SCALE = {
    "nan",
    "inf",
    "-inf",
    "zero",
    "smallest_subnormal",
    "-smallest_subnormal",
    "float32_smallest_subnormal",
}


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32], ids=["float16", "float32"])
@pytest.mark.parametrize("op", list(OPS), ids=list(OPS))
@pytest.mark.parametrize("name", list(_classes(jnp.float16)))
def test_special_constant_beside_scaled_data(name, op, dtype):
    """Data of magnitude ``2**-10`` (float16 data near 1 at scale ``2**-11``) beside each constant class:
    the value is plain JAX's in the data dtype (the same NaN and ±inf, finite entries within the
    data dtype's resolution at the common scale),
    and a constant of the same value at every scale leaves the scale alone."""
    c = _classes(dtype)[name]
    fn = OPS[op]
    values = (np.random.default_rng(0).normal(size=16) * 2.0**-10).astype(np.float32)
    x = jsa.as_scaled_array(jnp.asarray(values).astype(dtype))
    out = jax.jit(jsa.scalify(lambda x: fn(x, c), policy=jsa.RescalePolicy.static()))(x)
    got = np.asarray(jsa.asarray(out, jnp.float32), np.float64)
    expected = np.asarray(fn(x.to_array(dtype), c).astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(np.where(np.isinf(got), got, 0), np.where(np.isinf(expected), expected, 0))
    # At the common scale the data keep the dtype's resolution near zero: a float16 subnormal
    # step, or float32's smallest normal (XLA on CPU flushes float32 subnormal results).
    info = jnp.finfo(dtype)
    step = 2 * float(info.smallest_subnormal) if dtype == jnp.float16 else float(info.tiny)
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-3, atol=step * float(out.scale))
    if name in TAKE_ANY_SCALE and op != "add":
        assert float(out.scale) == float(x.scale)
