import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa
from jax_scalify import ScaledArray


def test_properties_and_value():
    x = jsa.scaled_array(np.array([1.0, 2.0], np.float16), 4.0)
    assert x.dtype == np.float16 and x.shape == (2,) and x.ndim == 1 and x.size == 2
    assert x.aval == jax.core.ShapedArray((2,), np.float16)
    assert x.scale.dtype == np.float32
    np.testing.assert_array_equal(x.to_array(), [4.0, 8.0])
    assert x.to_array(np.float32).dtype == np.float32
    np.testing.assert_array_equal(np.asarray(x), [4.0, 8.0])


def test_to_array_uses_scale_range():
    x = ScaledArray(jnp.ones(2, jnp.float16), jnp.float32(2.0**-30))
    np.testing.assert_array_equal(x.to_array(jnp.float32), [2.0**-30] * 2)
    assert np.all(x.to_array() == 0)  # float16 cannot hold 2^-30


def test_astype_keeps_scale():
    x = jsa.scaled_array([1.5, 2.0], 8.0).astype(jnp.float16)
    assert x.dtype == jnp.float16 and float(x.scale) == 8.0
    with pytest.raises(TypeError, match="to_array"):
        x.astype(jnp.int32)


def test_is_a_pytree_and_passes_jit():
    x = jsa.scaled_array([1.0, 2.0], 2.0)
    leaves, tree = jax.tree.flatten(x)
    assert len(leaves) == 2
    y = jax.jit(lambda t: t)(x)
    assert isinstance(y, ScaledArray)
    np.testing.assert_array_equal(y.to_array(), x.to_array())


@pytest.mark.parametrize(
    "data, scale, error, match",
    [
        (np.ones(3, np.int32), np.float32(1), TypeError, "floating"),
        (np.ones(3, np.float32), np.int32(1), TypeError, "floating"),
        (np.ones(3, np.float32), np.ones(2, np.float32), ValueError, "broadcastable"),
    ],
)
def test_bad_construction(data, scale, error, match):
    with pytest.raises(error, match=match):
        ScaledArray(data, scale)


def test_outside_scalify_errors_are_clear():
    x = jsa.scaled_array([1.0, 2.0], 2.0)
    with pytest.raises(TypeError, match="scalify"):
        jnp.sin(x)
    with pytest.raises(TypeError, match="scalify"):
        x + 1


def test_as_scaled_array_tree():
    tree = {"w": np.ones((2, 2), np.float32), "n": 3, "i": np.arange(3), "lr": np.float32(0.1), "b": True}
    out = jsa.as_scaled_array(tree)
    assert isinstance(out["w"], ScaledArray) and float(out["w"].scale) == 1.0
    assert out["n"] == 3 and out["i"] is tree["i"] and out["b"] is True
    lr = out["lr"]
    assert isinstance(lr, ScaledArray) and float(lr.scale) == 0.0625 and 1 <= float(lr.data) < 2
    np.testing.assert_allclose(float(lr.to_array()), 0.1, rtol=1e-7)
    assert jsa.as_scaled_array(out)["w"] is out["w"]


def test_as_scaled_array_with_scale_and_zero_scalar():
    x = jsa.as_scaled_array(np.array([2.0, 4.0], np.float32), scale=np.float32(2.0))
    np.testing.assert_array_equal(x.data, [1.0, 2.0])
    zero = jsa.as_scaled_array(np.float32(0.0))
    assert float(zero.scale) == 1.0 and float(zero.data) == 0.0
    zeros = jsa.as_scaled_array(jnp.zeros((2, 3)))
    assert float(zeros.scale) == 1.0 and not np.any(np.asarray(zeros.data))
    infinite = jsa.as_scaled_array(np.array([1.0, np.inf], np.float32))
    assert float(infinite.scale) == 1.0 and np.isinf(infinite.data[1])


def test_as_scaled_array_touches_floating_arrays_only():
    """Regression: non-array leaves (an Equinox module's functions) were rejected."""
    key = jax.random.key(0)
    tree = {"a": "text", "f": jnp.tanh, "lr": 0.1, "dtype": jnp.float16, "key": key, "none": None}
    out = jsa.as_scaled_array(tree)
    assert out == tree and out["key"] is key


def test_asarray_roundtrip_and_dtype():
    tree = {"a": np.array([1.0, 3.0], np.float32), "i": np.arange(2)}
    back = jsa.asarray(jsa.as_scaled_array(tree, scale=np.float32(0.5)))
    np.testing.assert_array_equal(back["a"], tree["a"])
    assert jsa.asarray(jsa.as_scaled_array(tree), dtype=jnp.float16)["a"].dtype == jnp.float16


def test_is_scaled_leaf():
    assert jsa.is_scaled_leaf(jsa.scaled_array([1.0], 1.0))
    assert not jsa.is_scaled_leaf(np.ones(2))
