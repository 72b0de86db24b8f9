import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scalify as jsa


def _tree():
    return {
        "w": jsa.ScaledArray(jnp.array([1.0, 2.0], jnp.float32), jnp.float32(4.0)),
        "b": jnp.array([0.5, -1.0], jnp.float32),
        "step": jnp.array(3, jnp.int32),
    }


def test_astype_casts_scaled_data_and_keeps_scale():
    out = jsa.tree.astype(_tree(), jnp.float16, floating_only=True)
    assert isinstance(out["w"], jsa.ScaledArray)
    assert out["w"].dtype == jnp.float16 and out["w"].scale.dtype == jnp.float32
    assert float(out["w"].scale) == 4.0
    np.testing.assert_array_equal(np.asarray(out["w"].to_array(jnp.float32)), [4.0, 8.0])
    assert out["b"].dtype == jnp.float16
    assert out["step"].dtype == jnp.int32


def test_astype_fp8():
    out = jsa.tree.astype(_tree()["w"], jnp.float8_e4m3fn)
    assert out.dtype == jnp.float8_e4m3fn and float(out.scale) == 4.0


def test_astype_touches_floating_arrays_only_by_default():
    key = jax.random.key(0)
    tree = {"b": jnp.array([0.5]), "step": jnp.array(3, jnp.int32), "n": 2, "lr": 0.1, "act": jnp.tanh, "key": key}
    out = jsa.tree.astype(tree, jnp.float16)
    assert out["b"].dtype == jnp.float16
    assert out["step"].dtype == jnp.int32 and out["n"] == 2 and out["lr"] == 0.1
    assert out["act"] is jnp.tanh and out["key"] is key


def test_astype_floating_only_false_casts_integer_arrays_but_not_other_leaves():
    tree = {"step": jnp.array(3, jnp.int32), "n": 2, "key": jax.random.key(0)}
    out = jsa.tree.astype(tree, jnp.float32, floating_only=False)
    assert out["step"].dtype == jnp.float32 and out["n"] == 2 and out["key"] is tree["key"]


def test_astype_keeps_the_optax_step_count_counting():
    """Regression: the README's cast turned Optax's int32 count into float16, frozen at 2048."""
    opt = optax.adam(optax.linear_schedule(0.0, 1.0, 4096))
    params = {"w": jnp.ones(3)}
    state = jsa.tree.astype(jsa.as_scaled_array(opt.init(params)), jnp.float16)
    counts = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.integer)]
    assert counts and all(c.dtype == jnp.int32 for c in counts)
    state = jax.tree.map(lambda x: x + 2049 if jnp.issubdtype(x.dtype, jnp.integer) else x, state)
    assert all(int(c) == 2049 for c in jax.tree.leaves(state) if jnp.issubdtype(c.dtype, jnp.integer))


def test_astype_scaled_to_integer_raises():
    with pytest.raises(TypeError, match="non-floating"):
        jsa.tree.astype(_tree(), jnp.int32)


def test_astype_leaves_python_numbers():
    out = jsa.tree.astype({"n": 3, "x": 1.5, "a": np.ones(2)}, jnp.float16)
    assert out["n"] == 3 and out["x"] == 1.5 and out["a"].dtype == jnp.float16


def test_leaves_flatten_unflatten_structure_keep_scaled_whole():
    tree = _tree()
    leaves = jsa.tree.leaves(tree)
    assert len(leaves) == 3 and any(isinstance(x, jsa.ScaledArray) for x in leaves)
    assert len(jax.tree.leaves(tree)) == 4  # plain jax.tree looks inside
    flat, treedef = jsa.tree.flatten(tree)
    assert treedef == jsa.tree.structure(tree) and treedef.num_leaves == 3
    rebuilt = jsa.tree.unflatten(treedef, flat)
    assert isinstance(rebuilt["w"], jsa.ScaledArray) and rebuilt["w"] is tree["w"]


def test_user_is_leaf_is_combined():
    tree = {"pair": (jnp.ones(2), jnp.zeros(2)), "w": _tree()["w"]}
    leaves = jsa.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple))
    assert len(leaves) == 2
    assert isinstance(leaves[0], tuple) and isinstance(leaves[1], jsa.ScaledArray)


def test_map_receives_scaled_arrays_whole():
    tree = _tree()
    out = jsa.tree.map(lambda x: isinstance(x, jsa.ScaledArray), tree)
    assert out == {"w": True, "b": False, "step": False}
    doubled = jsa.tree.map(lambda a, b: (a, b), tree, tree)
    assert doubled["w"][0] is tree["w"]


def test_all():
    assert jsa.tree.all(jsa.tree.map(lambda x: x.ndim <= 1, _tree()))
    assert not jsa.tree.all({"a": True, "b": False})
    assert jsa.tree.all({"s": jsa.ScaledArray(jnp.array(1.0), jnp.float32(2.0))})
    assert not jsa.tree.all({"s": jsa.ScaledArray(jnp.array(0.0), jnp.float32(2.0))})
    assert jsa.tree.all({})


def test_tree_functions_under_jit():
    @jax.jit
    def f(tree):
        return jsa.tree.astype(tree, jnp.bfloat16, floating_only=True)

    out = f(_tree())
    assert out["w"].dtype == jnp.bfloat16 and out["step"].dtype == jnp.int32
