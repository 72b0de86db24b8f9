"""Flax serialization of states holding ScaledArray, registered without importing Flax eagerly."""

import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scalify as jsa

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_flax_to_bytes_round_trip_of_a_training_state():
    serialization = pytest.importorskip("flax.serialization")
    params = jsa.as_scaled_array({"w": jnp.array([[1.0, 2.0], [3e-6, -4.0]], jnp.float16), "b": jnp.zeros(2)})
    state = {"params": params, "opt": optax.adam(1e-3).init(params), "step": jnp.int32(5)}
    blob = serialization.to_bytes(state)
    template = jax.tree.map(jnp.zeros_like, state)
    restored = serialization.from_bytes(template, blob)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert np.asarray(got).dtype == np.asarray(want).dtype
    assert isinstance(restored["params"]["w"], jsa.ScaledArray)
    assert serialization.to_state_dict(params["w"]).keys() == {"data", "scale"}


def _run(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def test_import_does_not_load_flax_and_registers_when_flax_comes():
    pytest.importorskip("flax")
    out = _run(
        "import sys, jax.numpy as jnp, jax_scalify as jsa\n"
        "print('flax' in sys.modules)\n"
        "from flax import serialization\n"
        "x = {'p': jsa.as_scaled_array(jnp.array([3.0, 5.0]))}\n"
        "print(serialization.from_bytes(x, serialization.to_bytes(x))['p'].scale)\n"
    )
    assert out.split() == ["False", "4.0"]


def test_registration_when_flax_was_imported_first():
    pytest.importorskip("flax")
    out = _run(
        "import flax.serialization as s, jax.numpy as jnp, jax_scalify as jsa\n"
        "print(s.to_state_dict(jsa.as_scaled_array(jnp.float32(6.0)))['scale'])\n"
    )
    assert out.strip() == "4.0"


def test_orbax_checkpoint_round_trip_as_in_the_docs(tmp_path):
    """docs/pytrees.md's Orbax example: a ScaledArray is saved as its two arrays."""
    ocp = pytest.importorskip("orbax.checkpoint")
    state = {
        "params": jsa.as_scaled_array({"w": jnp.array([[1.0, 2.0], [3e-6, -4.0]], jnp.float16)}),
        "step": jnp.int32(3),
    }
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "step_3", state)
    checkpointer.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    restored = checkpointer.restore(tmp_path / "step_3", abstract)
    assert isinstance(restored["params"]["w"], jsa.ScaledArray)
    np.testing.assert_array_equal(restored["params"]["w"].data, state["params"]["w"].data)
    assert restored["params"]["w"].scale.dtype == np.float32 and float(restored["params"]["w"].scale) == 2.0


def test_orbax_restore_of_a_scaled_nnx_model_into_its_eval_shape_as_in_the_docs(tmp_path):
    """docs/pytrees.md: the abstract target of a scaled NNX model is the eval_shape of a function
    that builds and scales it; the restored model holds the same ScaledArrays."""
    ocp = pytest.importorskip("orbax.checkpoint")
    nnx = pytest.importorskip("flax.nnx")

    def create_scaled_model():
        model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jsa.tree.astype(jsa.as_scaled_array(params), jnp.float16))
        return model

    model = create_scaled_model()
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "step_100", nnx.state(model))
    checkpointer.wait_until_finished()
    graphdef, abstract = nnx.split(nnx.eval_shape(create_scaled_model))
    restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "step_100", abstract))
    saved, got = (jax.tree.leaves(nnx.state(m), is_leaf=jsa.is_scaled_leaf) for m in (model, restored))
    assert len(got) == 4 and all(isinstance(x, jsa.ScaledArray) and x.dtype == jnp.float16 for x in got)
    for a, b in zip(saved, got):
        np.testing.assert_array_equal(np.asarray(b.data), np.asarray(a.data))
        assert float(b.scale) == float(a.scale)


def test_orbax_restore_without_target_names_data_and_scale(tmp_path):
    """Without a target Orbax rebuilds pytree nodes from their keys: a ScaledArray comes back as
    ``{"data": ..., "scale": ...}`` (a dict that fails loudly where an array is expected, not
    a two-element list that ``* 2`` would silently repeat), and ``jsa.ScaledArray(**d)`` rebuilds it."""
    ocp = pytest.importorskip("orbax.checkpoint")
    w = jsa.as_scaled_array(jnp.array([[1.0, 2.0], [3e-6, -4.0]], jnp.float16))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"w": w})
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "ckpt")
    assert set(restored["w"]) == {"data", "scale"}
    rebuilt = jsa.ScaledArray(**restored["w"])
    np.testing.assert_array_equal(rebuilt.data, w.data)
    np.testing.assert_array_equal(rebuilt.scale, w.scale)
    # Passed to a scalified step as it is, the dict is named with what to do.
    with pytest.warns(UserWarning, match=r"args\[0\]\['w'\] is a dict with keys 'data' and 'scale'.*target"):
        with pytest.raises(TypeError):
            jsa.scalify(lambda p, x: x @ p["w"])(restored, jnp.ones((2, 2), jnp.float16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jsa.scalify(lambda p, x: x @ p["w"])({"w": rebuilt}, jnp.ones((2, 2), jnp.float16))


def test_key_paths_name_data_and_scale():
    tree = {"w": jsa.as_scaled_array(jnp.ones(3))}
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert paths == ["['w'].data", "['w'].scale"]
