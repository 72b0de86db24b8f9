"""jsa.tree.map_values: mapping functions over the values of a tree holding ScaledArrays."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_scalify as jsa

TREE = {"w": jnp.array([[1.0, -2.0], [0.5, 4.0]]), "small": jnp.array([3e-9, 1e-9]), "step": jnp.int32(7)}


def test_jax_tree_map_pitfalls_that_map_values_avoids():
    scaled = jsa.as_scaled_array(TREE)
    # The pitfall: plain jax.tree.map multiplies data and scale, so the value by 9.
    wrong = jax.tree.map(lambda x: x * 3, scaled)
    np.testing.assert_array_equal(wrong["w"].data * wrong["w"].scale, np.asarray(TREE["w"]) * 9)
    right = jsa.tree.map_values(lambda x: x * 3, scaled)
    np.testing.assert_array_equal(right["w"].to_array(), np.asarray(TREE["w"]) * 3)
    assert np.frexp(float(right["w"].scale))[0] == 0.5  # still a power of two
    assert int(right["step"]) == 21  # plain leaves get plain f


def test_map_values_cast_keeps_scales_of_small_values():
    scaled = jsa.as_scaled_array(TREE)
    wrong = jax.tree.map(lambda x: x.astype(jnp.float16), scaled)
    assert float(wrong["small"].scale) == 0.0  # the scale itself underflowed in float16
    cast = jsa.tree.map_values(lambda x: x.astype(jnp.float16) if x.dtype == jnp.float32 else x, scaled)
    assert cast["small"].dtype == jnp.float16 and cast["small"].scale.dtype == jnp.float32
    np.testing.assert_allclose(cast["small"].to_array(jnp.float32), TREE["small"], rtol=1e-3)


def test_map_values_over_several_trees_and_global_norm():
    params, grads = jsa.as_scaled_array(TREE), jsa.as_scaled_array(jax.tree.map(lambda x: x / 2, TREE))
    updated = jsa.tree.map_values(lambda p, g: p - 0.5 * g, params, grads)
    np.testing.assert_allclose(updated["w"].to_array(), np.asarray(TREE["w"]) * 0.75, rtol=1e-6)
    # optax.tree.norm (formerly optax.global_norm) on the raw tree counts data and scales as leaves: wrong. Under scalify: right.
    floats = {k: v for k, v in params.items() if k != "step"}
    expected = optax.tree.norm(jsa.asarray(floats))
    assert not np.isclose(float(optax.tree.norm(floats)), float(expected))
    np.testing.assert_allclose(float(jsa.scalify(optax.tree.norm)(floats)), float(expected), rtol=1e-6)
