import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa
from jax_scalify import ScaledArray
from jax_scalify.core.array import ScaleFacts
from jax_scalify.core.promotion import any_scale_array
from tests.compiles import count_xla_compiles


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
    with pytest.raises(TypeError, match="arithmetic outside jsa.scalify"):
        x + 1
    with pytest.raises(TypeError, match="comparisons outside jsa.scalify"):
        _ = x < 1
    with pytest.raises(TypeError, match=r"indexing \(x\[...\]"):
        _ = x[...]


def test_as_scaled_array_tree():
    tree = {"w": np.ones((2, 2), np.float32), "n": 3, "i": np.arange(3), "lr": np.float32(0.1), "b": True}
    out = jsa.as_scaled_array(tree)
    assert isinstance(out["w"], ScaledArray) and float(out["w"].scale) == 1.0
    assert out["n"] == 3 and out["i"] is tree["i"] and out["b"] is True
    lr = out["lr"]
    assert isinstance(lr, ScaledArray) and float(lr.scale) == 0.0625 and 1 <= float(lr.data) < 2
    np.testing.assert_allclose(float(lr.to_array()), 0.1, rtol=1e-7)
    assert jsa.as_scaled_array(out)["w"] is out["w"]


def test_as_scaled_array_of_device_arrays_compiles_one_program_and_matches_numpy():
    """The scales of a tree's JAX arrays are computed in one compiled program: op by op, each
    array's operations were compiled per shape (65 compilations for this tree)."""
    rng = np.random.default_rng(0)
    host = {f"w{i}": (rng.standard_normal((8 + i, 4 + i)) * 10.0**i).astype(np.float32) for i in range(-3, 4)}
    host["half"] = rng.standard_normal(5).astype(np.float16)
    tree = {**jax.tree.map(jnp.asarray, host), "count": jnp.int32(3)}
    got = {}
    (compiles,) = count_xla_compiles([lambda: got.update(jsa.as_scaled_array(tree))])
    assert compiles <= 1, compiles
    assert got["count"] is tree["count"]
    for key, value in host.items():
        expected = jsa.as_scaled_array(value)  # NumPy: computed on the host
        assert got[key].dtype == value.dtype and float(got[key].scale) == float(expected.scale)
        np.testing.assert_array_equal(np.asarray(got[key].data), np.asarray(expected.data))


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


# --- validation of scales (issue: scale 3 accepted, negative/per-element/zero scales wrong) ---
@pytest.mark.parametrize(
    "scale, match",
    [
        (np.float32(3.0), "not a power of two"),
        (jnp.float32(3.0), "not a power of two"),
        (np.float32(-1.0), "negative"),
        (np.float32(np.inf), "not finite"),
        (np.float32(np.nan), "not finite"),
        (np.array([6.0, 3.0, 2.0], np.float32), "not a power of two"),
    ],
)
def test_invalid_concrete_scales_are_rejected_with_advice(scale, match):
    with pytest.raises(ValueError, match=match) as info:
        ScaledArray(np.ones(3, np.float32), scale)
    assert "pow2_round_down" in str(info.value) and "Pow2RoundMode.NONE" in str(info.value)


@pytest.mark.parametrize("scale", [np.float32(0.0), np.float32(2.0**-140), np.float16(2.0**-20), jnp.float32(2.0**100)])
def test_zero_and_powers_of_two_over_the_whole_range_are_accepted(scale):
    x = ScaledArray(np.ones(2, np.float32), scale)
    assert x.scale is scale


def test_rounding_mode_none_allows_any_positive_finite_scale():
    with jsa.ScalifyConfig(rounding_mode=jsa.Pow2RoundMode.NONE):
        x = ScaledArray(jnp.array([4.0]), jnp.float32(3.0))
        np.testing.assert_allclose(jsa.scalify(jnp.sqrt)(x).to_array(), [np.sqrt(12.0)], rtol=1e-6)
        with pytest.raises(ValueError, match="negative"):
            ScaledArray(jnp.array([4.0]), jnp.float32(-3.0))


def test_traced_scales_are_not_checked_but_scalify_inputs_are():
    data = jnp.array([4.0])
    # Inside jit the scale is a tracer: nothing can be checked at construction.
    out = jax.jit(lambda s: ScaledArray(data, s).scale)(jnp.float32(3.0))
    assert float(out) == 3.0
    # A ScaledArray rebuilt by a plain jax.tree function bypasses the constructor: scalify checks.
    tripled = jax.tree.map(lambda v: v * 3, jsa.as_scaled_array({"w": jnp.array([1.0, 2.0])}))
    with pytest.raises(ValueError, match=r"args\[0\]\['w'\]: scale 3.0 is not a power of two"):
        jsa.scalify(lambda t: jnp.sum(t["w"]))(tripled)


def test_negative_scale_sqrt_and_relu_no_longer_silently_wrong():
    for fn in (jnp.sqrt, jax.nn.relu, jnp.max, jnp.argmax):
        with pytest.raises(ValueError, match="negative"):
            jsa.scalify(fn)(ScaledArray(jnp.array([1.0, 4.0]), jnp.float32(-1.0)))


def test_non_scalar_scales_are_rejected_at_the_scalify_boundary():
    x = ScaledArray(jnp.array([1.0, 2.0, 4.0]), jnp.array([4.0, 2.0, 1.0]))  # valid for storage
    np.testing.assert_array_equal(x.to_array(), [4.0, 4.0, 4.0])
    for fn in (jsa.scalify(jnp.sum), jax.jit(jsa.scalify(jnp.sum))):
        with pytest.raises(ValueError, match=r"scale of shape \(3,\); the scale rules need a scalar"):
            fn(x)


def test_scalify_boundary_checks_data_and_scale_types():
    broken = jax.tree.map(lambda v: v.astype(jnp.int32), jsa.as_scaled_array(jnp.array([1.0, 2.0])))
    with pytest.raises(TypeError, match="must be a floating array"):
        jsa.scalify(jnp.sum)(broken)


def test_a_filter_spec_mapped_over_scaled_arrays_is_caught_with_the_way_to_build_it():
    """Equinox's freezing idiom ``jax.tree.map(lambda _: False, model)`` on a scaled model."""
    model = jsa.as_scaled_array({"w": jnp.ones(3)})
    spec = jax.tree.map(lambda _: False, model)
    with pytest.raises(TypeError, match="is_leaf=jsa.is_scaled_leaf"):
        jsa.scalify(lambda m, s: jnp.sum(m["w"]))(model, spec)
    good = jax.tree.map(lambda _: False, model, is_leaf=jsa.is_scaled_leaf)
    assert good == {"w": False}


def test_cast_of_a_whole_tree_with_jax_tree_map_is_caught():
    """jax.tree.map(astype) also casts the scale: small scales become 0 in float16."""
    tree = jsa.as_scaled_array({"w": jnp.array([3e-9, 1e-9])})
    cast = jax.tree.map(lambda v: v.astype(jnp.float16), tree)
    assert float(cast["w"].scale) == 0.0  # the pitfall itself
    assert float(jsa.tree.astype(tree, jnp.float16)["w"].scale) == float(tree["w"].scale)


def test_zero_scale_is_an_asserted_zero():
    x = ScaledArray(jnp.array([1.0, 2.0, 4.0]), jnp.float32(0.0))
    assert float(jsa.scalify(jnp.sum)(x).to_array()) == 0.0
    with pytest.raises(ValueError, match="divide the values by zero"):
        jsa.as_scaled_array(jnp.array([1.0, 2.0]), scale=0.0)
    with pytest.raises(ValueError, match="not a power of two"):
        jsa.as_scaled_array(jnp.array([1.0, 2.0]), scale=3.0)


@pytest.mark.parametrize("npapi", [np, jnp])
@pytest.mark.parametrize("magnitude", [1e-30, 1e-20, 1e-10, 1.0, 1e10, 1e30, 3e38])
def test_as_scaled_array_unit_rms_over_the_float32_range(npapi, magnitude):
    values = npapi.asarray(np.array([1.0, -2.0, 0.5, 1.5], np.float32) * np.float32(magnitude / 2))
    x = jsa.as_scaled_array(values)
    rms = float(np.sqrt(np.mean(np.square(np.asarray(x.data, np.float64)))))
    assert 1.0 <= rms < 2.0
    assert np.frexp(float(x.scale))[0] == 0.5
    np.testing.assert_array_equal(np.asarray(x.to_array(jnp.float32)), np.asarray(values))


def test_as_scaled_array_subnormal_and_float64_clamp_to_the_scale_range():
    sub = jsa.as_scaled_array(np.array([1e-40, 2e-40], np.float32))
    assert float(sub.scale) == np.finfo(np.float32).tiny  # smallest float32 normal power of two
    np.testing.assert_allclose(sub.to_array(np.float64), [1e-40, 2e-40], rtol=1e-4)
    tiny64 = jsa.as_scaled_array(np.array([1e-300], np.float64))
    assert float(tiny64.scale) == np.finfo(np.float32).tiny
    np.testing.assert_allclose(tiny64.to_array(np.float64), [1e-300], rtol=1e-12)


# --- conversions of 0-d values ---------------------------------------------------------------
def test_float_int_bool_of_a_concrete_scalar():
    loss = jsa.as_scaled_array(jnp.float32(2.75))
    assert float(loss) == 2.75 and int(loss) == 2 and bool(loss) is True
    assert bool(jsa.scalify(lambda v: v * 0.0)(loss)) is False
    assert float(jsa.as_scaled_array(np.float16(0.375))) == 0.375


def test_float_of_an_array_or_a_tracer_says_what_to_do():
    with pytest.raises(TypeError, match=r"concrete 0-d ScaledArray, got one of shape \(2,\)"):
        float(jsa.as_scaled_array(jnp.ones(2)))
    with pytest.raises(TypeError, match="traced"):
        jax.jit(lambda s: float(s))(jsa.as_scaled_array(jnp.float32(1.0)))


def test_training_loop_conversions_of_a_returned_loss():
    """What a loop does with the loss a scalified step returns: format it, ``.item()`` it, wait for it."""
    loss = ScaledArray(jnp.float16(1.5), jnp.float32(2.0**20))  # beyond float16's range: the value is exact
    assert f"{loss:.1f}" == "1572864.0" and loss.item() == 2.0**20 * 1.5 and loss.tolist() == 2.0**20 * 1.5
    assert loss.block_until_ready() is loss and f"{loss}" == repr(loss)
    values = jsa.scaled_array(np.array([0.5, 3.0], np.float16), 4.0)
    assert values.item(1) == 12.0 and values.tolist() == [2.0, 12.0]
    with pytest.raises(TypeError, match="unsupported format string"):
        f"{values:.2f}"  # as for a NumPy or JAX array of shape (2,)
    with pytest.raises(TypeError, match="item.. needs a concrete ScaledArray, got one traced"):
        jax.jit(lambda s: s.item())(loss)


# --- transformations applied outside scalify -------------------------------------------------
def test_grad_and_vmap_outside_scalify_say_to_move_them_inside():
    x = jsa.as_scaled_array(jnp.array([1.0, 2.0]))
    with pytest.raises(TypeError, match=r"jsa.scalify\(jax.grad\(f\)\)"):
        jax.grad(lambda a: jnp.sum(a))(x)  # plain function: the ScaledArray reaches jnp
    with pytest.raises(TypeError, match="applied outside scalify"):
        jax.grad(jsa.scalify(lambda a: jnp.sum(a * a)))(x)
    with pytest.raises(TypeError, match="applied outside scalify"):
        jax.jvp(jsa.scalify(jnp.sin), (x,), (x,))
    grads = jax.jit(jsa.scalify(jax.grad(lambda a: jnp.sum(a * a))))(x)  # the right way
    np.testing.assert_array_equal(grads.to_array(), [2.0, 4.0])


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_device_check_of_scalify_inputs_agrees_with_the_host_check(dtype):
    """scalify checks device scales with one fused bit-level computation; it must match the host rule."""
    from jax_scalify.core import array as array_module

    tiny = float(jnp.finfo(dtype).smallest_subnormal)
    specials = [0.0, -0.0, 1.0, 2.0**-3, tiny, tiny * 2, tiny * 3, 3.0, -2.0, np.inf, np.nan, 0.75]
    for value in specials:
        scale = jnp.asarray(value, dtype)
        for mode in (jsa.Pow2RoundMode.DOWN, jsa.Pow2RoundMode.NONE):
            with jsa.ScalifyConfig(rounding_mode=mode):
                host_ok = array_module._scale_problem(np.asarray(scale.astype(jnp.float32))) is None
                device_ok = bool(array_module._device_scales_valid(mode != jsa.Pow2RoundMode.NONE, scale))
            assert host_ok == device_ok, (value, mode)


# --- ScaleFacts: what is known about a value, as pytree aux data ----------------------------------
def test_a_plain_scaled_array_has_no_facts_in_its_treedef():
    x = jsa.ScaledArray(jnp.ones(3), np.float32(2.0))
    leaves, treedef = jax.tree.flatten(x)
    assert len(leaves) == 2 and treedef == jax.tree.structure(jsa.ScaledArray(jnp.zeros(3), np.float32(4.0)))
    assert x.facts == ScaleFacts() and x.plain() is x


def test_facts_distinguish_treedefs_and_survive_flatten_unflatten():
    zeros = any_scale_array(jnp.zeros(4), np.float32(1.0))
    stacked = jsa.ScaledArray.unchecked(jnp.ones((3, 2)), np.float32(4.0), slices=(jnp.ones((3, 2)), jnp.ones(3)))
    plain = jsa.ScaledArray(jnp.zeros(4), np.float32(1.0))
    assert jax.tree.structure(zeros) != jax.tree.structure(plain)
    assert len(jax.tree.leaves(stacked)) == 4
    for x in (zeros, stacked):
        back = jax.tree.unflatten(*reversed(jax.tree.flatten(x)))
        assert back.facts == x.facts
    assert not zeros.plain().any_scale and stacked.plain().slices is None
    assert zeros.astype(jnp.float16).any_scale  # a cast keeps a zero zero


def test_facts_cross_jit_with_the_value():
    zeros = any_scale_array(jnp.zeros(4), jnp.float32(1.0))
    x = jsa.ScaledArray(jnp.full(4, 3.0), jnp.float32(2.0**10))
    passed, largest = jax.jit(lambda z, v: (z, jsa.lax.scaled_max(v, z)))(zeros, x)
    assert passed.any_scale
    assert float(largest.scale) == 2.0**10  # inside the jitted function the zero adopted x's scale
    np.testing.assert_array_equal(np.asarray(largest.to_array()), np.full(4, 3.0 * 2.0**10))


def test_scalify_returns_scaled_arrays_without_facts():
    fn = jsa.scalify(lambda x: jax.lax.scan(lambda c, _: (c, c * 2.0), x, None, length=3))
    carry, ys = fn(jsa.as_scaled_array(jnp.ones(2)))
    assert carry.facts == ScaleFacts() and ys.facts == ScaleFacts()
    np.testing.assert_allclose(np.asarray(ys.to_array()), np.full((3, 2), 2.0))
