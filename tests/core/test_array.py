import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa
from jax_scalify import ScaledArray
from jax_scalify.core.array import ScaleFacts
from jax_scalify.core.promotion import any_scale_array
from jax_scalify.lax import rules_arithmetic
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
    assert np.all(x.to_array(x.dtype) == 0)  # asked for float16, which cannot hold 2^-30


_READOUT_CASES = [  # (data dtype, scale): values far outside the data dtype's range
    (jnp.float16, 2.0**20),
    (jnp.float16, 2.0**-40),
    (jnp.bfloat16, 2.0**100),
    (jnp.float8_e4m3fn, 2.0**20),
    (jnp.float8_e5m2, 2.0**-30),
]


@pytest.mark.parametrize("dtype, scale", _READOUT_CASES)
def test_readouts_are_float32_values(dtype, scale):
    """np.asarray, to_array and jsa.asarray of narrow data give float32 (1e6 was inf, 1e-9 was 0 in float16)."""
    data = jnp.array([1.0, -1.5, 0.5], dtype)
    x = ScaledArray(data, jnp.float32(scale))
    want = np.asarray(data, np.float32) * np.float32(scale)
    assert x.value_dtype == np.float32
    for got in (np.asarray(x), x.to_array(), jsa.asarray({"w": x})["w"], jsa.asarray([x])[0]):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(got), want)
    assert x.tolist() == want.tolist()
    assert x.to_array(dtype).dtype == dtype  # an explicit dtype still gives that dtype
    plain_jit = jax.jit(lambda t: t.to_array())(x)  # same dtype under a plain jax.jit: no value-dependent dtype
    assert plain_jit.dtype == np.float32
    np.testing.assert_array_equal(plain_jit, want)
    np.testing.assert_array_equal(jax.jit(jsa.asarray)({"w": x})["w"], want)


def test_readouts_of_float64_data_stay_float64():
    x = ScaledArray(np.array([1.0, 2.0**-1070]), np.float32(2.0**60))
    assert x.value_dtype == np.float64 and x.to_array().dtype == np.float64
    np.testing.assert_array_equal(np.asarray(x), [2.0**60, 2.0**-1010])


def test_astype_keeps_scale():
    x = jsa.scaled_array([1.5, 2.0], 8.0).astype(jnp.float16)
    assert x.dtype == jnp.float16 and float(x.scale) == 8.0
    with pytest.raises(TypeError, match=r"jsa\.asarray\(x, dtype\)"):
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
    with pytest.raises(TypeError, match="arithmetic outside jsa.scalify"):
        abs(x)


@pytest.mark.parametrize(
    "use",
    [lambda x: x.sum(), lambda x: x.mean(), lambda x: x.T, lambda x: x.reshape(2, 1), lambda x: x.at[0].set(1.0)],
    ids=["sum", "mean", "T", "reshape", "at"],
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "plain_jit"])
def test_jax_array_methods_outside_scalify_say_what_to_do(use, jit):
    """x.sum(), x.T ... raised a bare AttributeError ('ScaledArray' object has no attribute 'sum')."""
    x = jsa.scaled_array([1.0, 2.0], 2.0)
    with pytest.raises(AttributeError, match=r"outside jsa.scalify\. Wrap the function .* jsa\.asarray\(x\)"):
        (jax.jit(use) if jit else use)(x)
    np.testing.assert_allclose(np.asarray(jsa.scalify(use)(x)), np.asarray(use(x.to_array())))  # the right way
    assert not hasattr(x, "sum") and not hasattr(x, "sharding")  # duck typing still sees no jax.Array
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        _ = x.nonexistent


def test_len_is_the_first_axis():
    assert len(jsa.scaled_array(np.ones((3, 2)), 2.0)) == 3 == len(jnp.ones((3, 2)))
    with pytest.raises(TypeError, match="len"):
        len(jsa.scaled_array(1.0, 2.0))


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
    assert float(zero.scale) == 0.0 and float(zero.data) == 0.0
    zeros = jsa.as_scaled_array(jnp.zeros((2, 3)))
    assert float(zeros.scale) == 0.0 and not np.any(np.asarray(zeros.data))
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
        ScaledArray(jnp.array([1.0, 2.0]), jnp.float32(3.0))  # a pair whose value a rounding would change


@pytest.mark.parametrize("npapi", [np, jnp])
def test_as_scaled_array_rounds_a_given_scale_up_to_a_power_of_two(npapi):
    """0.1's recipes call as_scaled_array(params, scale=0.1): the value is kept, the scale becomes 0.125."""
    values = npapi.asarray(np.array([1.0, -3.0, 0.3], np.float32))
    tree = jsa.as_scaled_array({"w": values, "h": npapi.asarray(values, np.float16), "step": np.int32(3)}, scale=0.1)
    for name, dtype, rtol in [("w", np.float32, 1e-7), ("h", np.float16, 1e-3)]:
        x = tree[name]
        assert float(x.scale) == 0.125 and x.scale.dtype == np.float32 and x.dtype == dtype
        np.testing.assert_allclose(x.to_array(np.float32), values, rtol=rtol)
        assert np.max(np.abs(np.asarray(x.data, np.float32))) <= 3.0 / 0.1  # rounded up: data not enlarged
    assert tree["step"] == 3
    x = jsa.as_scaled_array(values, scale=np.float32(0.25))  # a power of two is kept
    assert float(x.scale) == 0.25
    np.testing.assert_array_equal(x.data, np.asarray(values) * 4)


def test_as_scaled_array_rounds_a_traced_scale():
    values = jnp.array([1.0, -3.0, 0.3], jnp.float32)
    x = jax.jit(lambda v, s: jsa.as_scaled_array(v, scale=s))(values, jnp.float32(0.3))
    assert float(x.scale) == 0.5
    np.testing.assert_allclose(x.to_array(), values, rtol=1e-7)
    with jsa.ScalifyConfig(rounding_mode=jsa.Pow2RoundMode.NONE):  # scales kept as given
        assert float(jsa.as_scaled_array(values, scale=0.1).scale) == np.float32(0.1)
    for bad, message in [(-1.0, "negative"), (np.inf, "not finite"), (0.0, "divide the values by zero")]:
        with pytest.raises(ValueError, match=message):
            jsa.as_scaled_array(values, scale=bad)


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
    passed, largest = jax.jit(lambda z, v: (z, rules_arithmetic.scaled_max(v, z)))(zeros, x)
    assert passed.any_scale
    assert float(largest.scale) == 2.0**10  # inside the jitted function the zero adopted x's scale
    np.testing.assert_array_equal(np.asarray(largest.to_array()), np.full(4, 3.0 * 2.0**10))


def test_scalify_returns_scaled_arrays_without_facts():
    fn = jsa.scalify(lambda x: jax.lax.scan(lambda c, _: (c, c * 2.0), x, None, length=3))
    carry, ys = fn(jsa.as_scaled_array(jnp.ones(2)))
    assert carry.facts == ScaleFacts() and ys.facts == ScaleFacts()
    np.testing.assert_allclose(np.asarray(ys.to_array()), np.full((3, 2), 2.0))


def _mixed_outside_scalify(tree):
    """optax.apply_updates outside scalify: data added to data, scale to scale (a scale of 1.00195)."""
    update = jsa.ScaledArray.unchecked(jnp.array([1.0, 1.0]), jnp.float32(2.0**-9))
    return jax.tree.map(lambda p, u: p + u, tree, {"w": update})


def test_scale_broken_outside_scalify_is_refused_eagerly_and_nan_under_jit():
    """Eager scalify rejected the scale; jax.jit(jsa.scalify(f)) accepted it and computed silently wrong values."""
    params = jsa.as_scaled_array({"w": jnp.array([1.0, 2.0])})
    bad = _mixed_outside_scalify(params)

    def double(tree):
        return jax.tree.map(lambda v: v * 2, tree)

    with pytest.raises(ValueError, match=r"args\[0\]\['w'\]: scale 1.00195.* is not a power of two"):
        jsa.scalify(double)(bad)
    out = jax.jit(jsa.scalify(double))(bad)["w"]
    assert np.isnan(float(out.scale)) and np.all(np.isnan(out.to_array()))
    good = jax.jit(jsa.scalify(double))(params)["w"]  # valid traced scales are untouched
    np.testing.assert_array_equal(good.to_array(), [2.0, 4.0])
    zero = jax.jit(jsa.scalify(double))({"w": ScaledArray(jnp.array([1.0, 2.0]), jnp.float32(0.0))})["w"]
    np.testing.assert_array_equal(zero.to_array(), [0.0, 0.0])  # scale 0 (an asserted zero) is valid


@pytest.mark.parametrize("scale, valid", [(3.0, True), (-2.0, False), (np.inf, False)])
def test_traced_scales_without_rounding_need_only_be_positive_and_finite(scale, valid):
    with jsa.ScalifyConfig(rounding_mode=jsa.Pow2RoundMode.NONE):
        x = ScaledArray.unchecked(jnp.array([1.0, 2.0]), jnp.float32(scale))
        out = jax.jit(jsa.scalify(lambda v: v * 2, policy=jsa.RescalePolicy.static()))(x)
    if valid:
        np.testing.assert_allclose(out.to_array(), [2 * scale, 4 * scale], rtol=1e-6)
    else:
        assert np.all(np.isnan(out.to_array()))


def test_one_invalid_traced_scale_makes_every_scale_nan():
    """The check is one reduction over all input scales; its verdict applies to all of them."""
    tree = {
        "bad": ScaledArray.unchecked(jnp.array([1.0, 2.0]), jnp.float32(3.0)),
        "good": jsa.as_scaled_array(jnp.ones(2)),
    }
    out = jax.jit(jsa.scalify(lambda t: jax.tree.map(lambda v: v * 2, t)))(tree)
    assert np.isnan(float(out["bad"].scale)) and np.isnan(float(out["good"].scale))


def test_each_traced_scale_stays_an_input_of_its_own():
    """No kernel reads its scale out of a vector of all scales at an offset of its own: kernels of
    blocks with the same shapes stay identical (XLA compiles identical kernels once)."""
    blocks = [jsa.as_scaled_array(jnp.ones((8, 8))) for _ in range(3)]

    def stack(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x

    hlo = jax.jit(jsa.scalify(stack, policy=jsa.RescalePolicy.static())).lower(blocks, jnp.ones((4, 8))).compile()
    assert " slice(" not in hlo.as_text()


def test_off_cpu_the_traced_scales_are_checked_as_one_vector():
    """XLA:GPU fuses sibling kernels that share an operand: there the checked scales are one
    vector computed once, which its readers slice (fewer H100 kernels; see docs/benchmarks.md)."""
    blocks = [jsa.as_scaled_array(jnp.ones((8, 8))) for _ in range(3)]
    fn = jax.jit(jsa.scalify(lambda ws, x: [x @ w for w in ws], policy=jsa.RescalePolicy.static()))
    traced = fn.trace(blocks, jnp.ones((4, 8)))
    assert traced.lower(lowering_platforms=("cuda",)).as_text().count("stablehlo.slice") == 3
    assert traced.lower(lowering_platforms=("cpu",)).as_text().count("stablehlo.slice") == 0


def test_the_check_of_traced_scales_is_compiled_once():
    """XLA copies cheap elementwise producers into every kernel that reads them; the check
    of the input scales (a population count among its operations) is computed once."""
    params = {"w": ScaledArray(jnp.ones((8, 8)), jnp.float32(2.0)), "b": ScaledArray(jnp.ones(8), jnp.float32(4.0))}

    def kernels(p, x):
        h = jnp.tanh(x @ p["w"] + p["b"])
        return h * p["b"], jnp.exp(x * p["b"]).sum(0), (h @ p["w"]).max(1)

    fn = jax.jit(jsa.scalify(kernels, policy=jsa.RescalePolicy.static()))
    hlo = fn.lower(params, jnp.ones((4, 8))).compile().as_text()
    assert hlo.count("popcnt(") == 1
