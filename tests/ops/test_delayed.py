"""Delayed rescaling: the previous step's statistic sets this step's scale."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa
from jax_scalify import ops
from tests.invariance import STATIC_POLICY, assert_pow2_scales

RNG = np.random.default_rng(0)


def draw(rng, std=37.0, shape=(16, 16)):
    """A ScaledArray whose data are far from unit RMS (std 37 at scale 2**-5)."""
    return jsa.ScaledArray(jnp.asarray(rng.standard_normal(shape) * std, jnp.float32), jnp.float32(2.0**-5))


def tree_of(rng):
    return {"a": draw(rng), "b": draw(rng, std=0.01, shape=(8,)), "step": jnp.int32(3)}


@pytest.fixture(scope="module")
def step():
    @functools.partial(jax.jit, static_argnames="norm")
    @jsa.scalify(policy=STATIC_POLICY)
    def fn(tree, state, norm):
        delayed, state = ops.delayed_rescale(tree, state, norm)
        return delayed, state, ops.dynamic_rescale(tree, norm)

    return fn


def test_identity_on_values_outside_scalify():
    x = jnp.asarray(RNG.standard_normal((4, 4)), jnp.float32)
    state = ops.init_delayed_rescale_state({"x": x, "n": 3})
    out, state = ops.delayed_rescale({"x": x, "n": 3}, state)
    np.testing.assert_array_equal(out["x"], x)
    assert out["n"] == 3
    np.testing.assert_allclose(state.stats["x"], np.sqrt(np.mean(np.square(x))), rtol=1e-6)
    grad = jax.grad(lambda a: jnp.sum(ops.delayed_rescale(a, ops.DelayedRescaleState(state.stats["x"]))[0] * 3.0))
    np.testing.assert_array_equal(grad(x), jnp.full_like(x, 3.0))


def test_first_step_leaves_the_tree_unchanged(step):
    tree = tree_of(np.random.default_rng(1))
    out, _, _ = step(tree, ops.init_delayed_rescale_state(tree), "l2")
    for key in "ab":
        np.testing.assert_array_equal(out[key].data, tree[key].data)
        assert float(out[key].scale) == float(tree[key].scale)


@pytest.mark.parametrize("norm", ["l1", "l2", "max"])
def test_steady_state_matches_dynamic_rescale(step, norm):
    """Same tensor each step: from the second step on, delayed == dynamic, bit for bit."""
    tree = tree_of(np.random.default_rng(2))
    state = ops.init_delayed_rescale_state(tree)
    for i in range(3):
        delayed, state, dynamic = step(tree, state, norm)
        if i == 0:
            continue
        assert_pow2_scales(delayed)
        for key in "ab":
            assert float(delayed[key].scale) == float(dynamic[key].scale)
            np.testing.assert_array_equal(delayed[key].data, dynamic[key].data)
        assert int(delayed["step"]) == 3


def test_same_distribution_each_step_gives_dynamic_scales(step):
    """Fresh samples of one distribution: the delayed scales are the dynamic ones (up to a rounding edge)."""
    rng = np.random.default_rng(3)
    state = ops.init_delayed_rescale_state(tree_of(rng))
    matches = []
    for i in range(6):
        tree = tree_of(rng)
        delayed, state, dynamic = step(tree, state, "l2")
        np.testing.assert_allclose(delayed["a"].to_array(), tree["a"].to_array(), rtol=1e-6)
        if i > 0:
            ratio = float(delayed["a"].scale) / float(dynamic["a"].scale)
            assert ratio in (0.5, 1.0, 2.0)
            matches.append(ratio == 1.0)
    assert sum(matches) >= 4


def test_statistic_of_the_value_survives_a_change_of_representation(step):
    tree = tree_of(np.random.default_rng(4))
    _, state, _ = step(tree, ops.init_delayed_rescale_state(tree), "l2")
    # The same values with another scale: the delayed scale is unchanged.
    moved = dict(tree, a=jsa.ScaledArray(tree["a"].data * 2.0**-7, tree["a"].scale * 2.0**7))
    out_moved, _, _ = step(moved, state, "l2")
    out_same, _, _ = step(tree, state, "l2")
    assert float(out_moved["a"].scale) == float(out_same["a"].scale)
    np.testing.assert_allclose(out_moved["a"].data, out_same["a"].data, rtol=1e-6)


def test_float16_data_and_scaled_state_eager():
    x = jsa.ScaledArray(jnp.asarray(RNG.standard_normal(64) * 3000, jnp.float16), jnp.float32(2.0**-40))
    state = ops.init_delayed_rescale_state(x)
    _, state = ops.delayed_rescale(x, state)  # eager: runs under scalify
    state = jsa.as_scaled_array(state)  # a state converted with the rest of a training state
    out, state = ops.delayed_rescale(x, state)
    assert out.dtype == jnp.float16
    assert 1.0 <= float(jnp.sqrt(jnp.mean(jnp.square(out.data.astype(jnp.float32))))) < 2.0
    np.testing.assert_allclose(out.to_array(np.float32), x.to_array(np.float32), rtol=1e-3)


def test_bad_state_raises():
    with pytest.raises(TypeError, match="init_delayed_rescale_state"):
        ops.delayed_rescale(jnp.ones(3), {"stats": 0.0})
    with pytest.raises(ValueError, match="does not match the structure"):
        ops.delayed_rescale([jnp.ones(3), jnp.ones(2)], ops.init_delayed_rescale_state([jnp.ones(3)]))
    with pytest.raises(ValueError, match="Unknown norm"):
        ops.delayed_rescale(jnp.ones(3), ops.init_delayed_rescale_state(jnp.ones(3)), "l3")
