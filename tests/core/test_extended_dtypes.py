"""Typed PRNG keys (extended dtypes) inside scalified functions are left alone.

Issue 39, point 3: a function closing over ``jax.random.key(0)`` raised ``TypeError: Cannot
interpret 'key<fry>' as a data type`` under ``jax.jit(jsa.scalify(f))`` on float16 data: the
pass that recovers the exact constants of a float16 trace read every size-1 constant's dtype
with NumPy. A key is no float: it is passed through as it is, whether closed over, passed as
an argument or closed over under ``jax.grad``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa

DTYPES = [jnp.float16, jnp.float32]


def _x(dtype) -> jsa.ScaledArray:
    return jsa.as_scaled_array(jnp.linspace(-2, 3, 12, dtype=jnp.float32).reshape(3, 4).astype(dtype))


def _assert_value(got, expected, dtype) -> None:
    assert isinstance(got, jsa.ScaledArray) and got.dtype == dtype
    rtol = 2e-3 if dtype == jnp.float16 else 1e-6
    np.testing.assert_allclose(np.asarray(jsa.asarray(got, jnp.float32)), np.asarray(expected, np.float32), rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
def test_closed_over_key(dtype):
    key = jax.random.key(0)

    def f(x):
        return x * jax.random.normal(key, x.shape, x.dtype)

    x = _x(dtype)
    _assert_value(jax.jit(jsa.scalify(f))(x), f(jsa.asarray(x, dtype)), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
def test_key_argument(dtype):
    def f(x, key):
        key, sub = jax.random.split(key)
        return x * jax.random.normal(sub, x.shape, x.dtype), key

    x, key = _x(dtype), jax.random.key(1)
    got, got_key = jax.jit(jsa.scalify(f))(x, key)
    expected, expected_key = f(jsa.asarray(x, dtype), key)
    _assert_value(got, expected, dtype)
    assert jnp.issubdtype(got_key.dtype, jax.dtypes.extended)
    np.testing.assert_array_equal(jax.random.key_data(got_key), jax.random.key_data(expected_key))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
def test_closed_over_key_under_grad(dtype):
    key = jax.random.key(2)

    def loss(x):
        noise = jax.random.normal(key, x.shape, x.dtype)
        return jnp.sum((x * noise + jax.random.uniform(key, x.shape, x.dtype)).astype(jnp.float32) ** 2)

    x = _x(dtype)
    expected = jax.grad(loss)(jsa.asarray(x, dtype))
    _assert_value(jax.jit(jsa.scalify(jax.grad(loss)))(x), expected, dtype)


def test_cast_to_key_dtype_names_it():
    with pytest.raises(TypeError, match="non-floating dtype key<fry>"):
        jsa.as_scaled_array(jnp.ones(2)).astype(jax.random.key(0).dtype)
