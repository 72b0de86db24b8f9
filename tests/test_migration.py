"""jax-scalify 0.1's public names: importable, with their 0.1 meaning (see docs/migration.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa


def test_the_imports_of_the_0_1_test_files_work():
    from jax_scalify.core import (  # noqa: F401  (the import lines of 0.1's tests and modules)
        Array,
        ArrayTypes,
        DTypeLike,
        Pow2RoundMode,
        ScaledArray,
        ScaledPrimitiveType,
        ScalifyConfig,
        Shape,
        Sharding,
        as_scaled_array,
        asarray,
        debug_callback,
        find_registered_scaled_op,
        get_numpy_api,
        get_scale_dtype,
        get_scalify_config,
        is_scaled_leaf,
        is_static_anyscale,
        is_static_one_scalar,
        is_static_zero,
        make_scaled_scalar,
        pow2_decompose,
        pow2_round,
        pow2_round_down,
        pow2_round_up,
        register_scaled_lax_op,
        register_scaled_op,
        safe_div,
        safe_reciprocal,
        scaled_array,
        scalify,
    )
    from jax_scalify.lax import get_data_scale, rebalance, set_scaling, stop_scaling  # noqa: F401
    from jax_scalify.ops import (  # noqa: F401
        cast_on_backward,
        cast_on_forward,
        debug_callback_grad,
        debug_print,
        debug_print_grad,
        dynamic_rescale_l1,
        dynamic_rescale_l2_grad,
        dynamic_rescale_max,
        reduce_precision_on_backward,
        reduce_precision_on_forward,
    )
    from jax_scalify.quantization.scale import as_e8m0, from_e8m0, pow2_truncate  # noqa: F401

    assert debug_callback is jsa.ops.debug_callback is jsa.core.debug_callback is jsa.debug_callback
    assert Array is jax.Array and isinstance(jnp.ones(2), ArrayTypes) and Sharding is jax.sharding.Sharding
    for name in (
        "ScaledArray",
        "as_scaled_array",
        "asarray",
        "scaled_array",
        "scalify",
        "ScalifyConfig",
        "Pow2RoundMode",
    ):
        assert getattr(jsa, name) is getattr(jsa.core, name)


def test_core_debug_callback_is_set_from_above_by_compat():
    """0.1's ``jax_scalify.core.debug_callback`` is the ops function, set on core by jax_scalify.compat
    (core imports nothing above it: tests/test_layers.py)."""
    assert jsa.core.debug_callback is jsa.ops.debug_callback
    assert "debug_callback" not in jsa.core.__all__


@pytest.mark.parametrize("value", [2.1, np.float64(2.0), jnp.float32(-3.0), np.float16(0.375)])
def test_make_scaled_scalar_is_the_exact_mantissa_split(value):
    x = jsa.core.make_scaled_scalar(value)
    assert 1.0 <= abs(float(x.data)) < 2.0 and np.frexp(float(x.scale))[0] == 0.5
    assert float(x.data) * float(x.scale) == float(np.float32(value) if isinstance(value, float) else value)
    assert x.scale.dtype == (np.float32 if isinstance(value, float) else np.asarray(value).dtype)  # 0.1: value's dtype
    with pytest.raises(TypeError, match="floating scalar"):
        jsa.core.make_scaled_scalar(np.ones(2, np.float32))


@pytest.mark.parametrize(
    "value, zero, anyscale",
    [
        (0, True, True),
        (np.float16(0), True, True),
        (np.array([1.0, 2.0]), False, False),
        (np.array([0.0, -np.inf]), [True, False], True),
        (jnp.array([0.0, 0.0]), False, False),  # a JAX array is not known at trace time
        (jsa.ScaledArray(np.array([0.0, 0.0]), jnp.float32(2.0)), True, True),
        (jsa.ScaledArray(jnp.array([3.0, 4.0]), np.float32(0.0)), True, True),
        (jsa.ScaledArray(jnp.array([3.0, 4.0]), jnp.float32(0.0)), False, False),
    ],
)
def test_static_value_predicates(value, zero, anyscale):
    np.testing.assert_array_equal(jsa.core.is_static_zero(value), np.broadcast_to(zero, np.shape(value)))
    np.testing.assert_array_equal(jsa.core.is_static_anyscale(value), np.broadcast_to(anyscale, np.shape(value)))


def test_is_static_one_scalar_get_scale_dtype_numpy_api_and_safe_ops():
    core = jsa.core
    assert core.is_static_one_scalar(1.0) and core.is_static_one_scalar(np.array([1.0], np.float16))
    assert core.is_static_one_scalar(jsa.ScaledArray(np.float32(1.0), np.float32(1.0)))
    assert not core.is_static_one_scalar(jnp.float32(1.0)) and not core.is_static_one_scalar(np.ones(2))
    assert core.get_scale_dtype(jsa.ScaledArray(jnp.ones(2, jnp.float16), np.float32(1))) == np.float32
    assert core.get_scale_dtype(jnp.ones(2, jnp.float16)) == np.float16
    assert core.get_numpy_api(np.ones(2)) is np and core.get_numpy_api(jnp.ones(2)) is jnp
    with pytest.raises(TypeError):
        core.get_numpy_api([1.0])
    assert float(core.safe_div(np.float32(1.0), np.float32(0.0))) == 0.0
    assert isinstance(core.safe_div(np.float32(1.0), np.float32(4.0)), np.ndarray)
    assert float(core.safe_reciprocal(np.float16(4.0))) == 0.25
    assert float(jax.jit(core.safe_div)(jnp.float32(3.0), jnp.float32(0.0))) == 0.0
    assert float(jax.jit(core.safe_reciprocal)(jnp.float32(0.5))) == 2.0


def test_a_0_1_style_program_runs():
    """Adapted from 0.1's interpreter tests: powers of two where 0.1 used scale 3 (now rejected)."""
    x = jsa.scaled_array([-2.0, 2.0], 0.5, dtype=np.float32)
    y = jsa.scaled_array([1.5, 1.5], 2, dtype=np.float32)
    out = jax.jit(jsa.scalify(lambda a, b: a * b))(x, y)
    assert isinstance(out, jsa.ScaledArray)
    np.testing.assert_array_almost_equal(np.asarray(out), [-3.0, 3.0])
    with pytest.raises(ValueError, match="not a power of two"):
        jsa.scaled_array([1.0, 2.0], 3, dtype=np.float16)
    with jsa.ScalifyConfig(rounding_mode=jsa.Pow2RoundMode.NONE):  # 0.1's non-power-of-two scales
        np.testing.assert_array_almost_equal(np.asarray(jsa.scaled_array([1.0, 2.0], 3, dtype=np.float16)), [3, 6])


def test_scale_dtype_none_of_0_1_means_the_float32_default():
    assert jsa.ScalifyConfig(scale_dtype=None).scale_dtype == np.float32
    with jsa.ScalifyConfig(scale_dtype=None):
        _, scale = jsa.scalify(jsa.lax.get_data_scale)(jnp.ones(2, jnp.float16))
    assert scale.dtype == np.float32


# --- 0.1's MNIST examples, in 0.1's idiom (tests/programs/examples_0_1.py) --------------------
EXAMPLE_STEPS = 40


def _float32_losses(program, seed=0):
    from tests.programs.harness import train

    return train(program, "fp32", EXAMPLE_STEPS, seed)


def _as_0_1_scaled_float16(tree, scale):
    """0.1's conversion: ``as_scaled_array(tree, scale)``, then each leaf's ``astype(float16)``."""
    tree = jsa.as_scaled_array(tree, scale=np.float32(scale))
    return jax.tree_util.tree_map(lambda v: v.astype(np.float16), tree, is_leaf=jsa.core.is_scaled_leaf)


@pytest.mark.parametrize("fp8", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["fp16", "fp8"])
def test_0_1_mnist_from_scratch_example_trains_as_its_authors_wrote_it(fp8):
    """Parameters ``as_scaled_array(params, scale=0.1)`` (a scale that is no power of two, rounded to
    one now), batches at scale 1, both cast to float16, ``jit(scalify(update))`` called under
    ``ScalifyConfig(rounding_mode=DOWN, scale_dtype=float32)``: ends with float32 (FP8 casts too)."""
    from tests.programs import examples_0_1 as ex
    from tests.programs.harness import final_loss, relative_excess

    params = _as_0_1_scaled_float16(ex.init_random_params(0), ex.PARAM_SCALE)
    assert all(np.frexp(float(w.scale))[0] == 0.5 for w, _ in params)
    update = jax.jit(jsa.scalify(ex.make_sgd_step(None, fp8)))
    losses = []
    for batch in ex.one_hot_batches(0, EXAMPLE_STEPS):
        batch = _as_0_1_scaled_float16(batch, 1.0)
        with jsa.ScalifyConfig(rounding_mode=jsa.Pow2RoundMode.DOWN, scale_dtype=np.float32):
            loss, params = update(params, *batch)
        losses.append(float(loss))
    assert params[0][0].dtype == np.float16
    fp32 = final_loss(_float32_losses(ex.SGD_PROGRAM))
    assert relative_excess(final_loss(losses), fp32) <= 0.05, (final_loss(losses), fp32)


def test_0_1_flax_example_with_its_whole_adam_state_cast_to_float16():
    """0.1's Flax example stored Adam's state as ``jsa.tree.astype(jsa.as_scaled_array(opt.init(params)),
    float16)``: it trains with float32, or says to use ``jsa.optim.scale_state`` instead; it must not
    turn NaN in silence."""
    import warnings

    from tests.programs import examples_0_1 as ex
    from tests.programs.harness import final_loss, relative_excess

    tx = ex.make_adam()
    params, _ = ex.init_linen(0, tx)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt_state = jsa.tree.astype(jsa.as_scaled_array(tx.init(params)), jnp.float16)
        model_state = jsa.tree.astype(jsa.as_scaled_array(params, scale=np.float32(1.0)), jnp.float16)
        update = jax.jit(jsa.scalify(ex.make_linen_step(tx)))
        losses = []
        for batch in ex.one_hot_batches(0, EXAMPLE_STEPS):
            batch = jsa.as_scaled_array(jsa.tree.astype(batch, np.float16), scale=np.float32(1))
            with jsa.ScalifyConfig(rounding_mode=jsa.Pow2RoundMode.DOWN, scale_dtype=np.float32):
                loss, model_state, opt_state = update(model_state, opt_state, *batch)
            losses.append(float(loss))
    if any("scale_state" in str(w.message) for w in caught):
        return  # told what to do
    fp32 = final_loss(_float32_losses(ex.ADAM_PROGRAM))
    assert relative_excess(final_loss(losses), fp32) <= 0.05, (
        f"Adam with its state cast to float16 ends at {final_loss(losses)} (float32: {fp32}), and no warning "
        "named jsa.optim.scale_state"
    )
