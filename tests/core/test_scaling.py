"""Helpers of ``jax_scalify.core.scaling``: exact power-of-two multiplies of the data, stacked scales."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa
from jax_scalify.core.array import unscaled
from jax_scalify.core.measure import narrowed_within_range
from jax_scalify.core.scaling import (
    mul_data,
    numpy_api,
    rebalance_stacked,
    with_scalar_scale,
)


def _every_value(dtype) -> np.ndarray:
    """All 65,536 bit patterns of a 16-bit float dtype (nan and inf included)."""
    return np.arange(2**16, dtype=np.uint16).view(dtype)


@jax.jit
def _through_float32(data, factor):
    """The reference: multiply in float32, round once (compiled too, so that XLA's handling
    of subnormals, e.g. flushing them to zero on CPU, is the same on both sides)."""
    return (data.astype(jnp.float32) * factor).astype(data.dtype)


def assert_same_bits(got, expected):
    """Bit-identical, except that any nan matches any nan (payloads are not specified)."""
    got, expected = np.asarray(got), np.asarray(expected)
    both_nan = np.isnan(got.astype(np.float32)) & np.isnan(expected.astype(np.float32))
    differ = (got.view(np.uint16) != expected.view(np.uint16)) & ~both_nan
    assert not differ.any(), f"{differ.sum()} values differ, e.g. {got[differ][:4]} vs {expected[differ][:4]}"


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("exponent", [-24, -20, -14, -6, -1, 1, 3, 10])
def test_trace_time_factor_multiplies_in_16_bits_with_the_float32_result(dtype, exponent):
    """A factor the dtype holds exactly is one ``mul`` in that dtype, bit for bit the float32 route."""
    data = _every_value(dtype)
    factor = np.float32(2.0**exponent)
    jaxpr = jax.make_jaxpr(lambda x: mul_data(x, factor))(data)
    assert [eqn.primitive.name for eqn in jaxpr.eqns] == ["mul"]
    got = np.asarray(jax.jit(lambda x: mul_data(x, factor))(data))
    assert_same_bits(got, _through_float32(data, np.float32(factor)))


def test_factor_outside_the_16_bit_range_goes_through_float32():
    data = _every_value(jnp.float16)
    factor = np.float32(2.0**-30)  # not a float16: multiplying in float16 would give 0
    jaxpr = jax.make_jaxpr(lambda x: mul_data(x, factor))(data)
    assert "convert_element_type" in {eqn.primitive.name for eqn in jaxpr.eqns}
    got = np.asarray(jax.jit(lambda x: mul_data(x, factor))(data))
    assert_same_bits(got, _through_float32(data, np.float32(factor)))


def test_traced_factor_goes_through_float32():
    """A run-time factor may be outside the dtype's range, so it is applied in float32."""
    data = _every_value(jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda x, f: mul_data(x, f))(data, np.float32(0.5))
    assert "convert_element_type" in {eqn.primitive.name for eqn in jaxpr.eqns}
    got = np.asarray(jax.jit(lambda x, f: mul_data(x, f))(data, np.float32(2.0**-140)))
    assert_same_bits(got, _through_float32(data, np.float32(2.0**-140)))


def test_rebalance_stacked_keeps_every_slice_value_exactly():
    data = jnp.asarray([[1.5, -1.0], [1.25, 1.75], [1.0, 0.0]], jnp.float16)
    scales = jnp.asarray([2.0**-3, 2.0**4, 2.0**-20], jnp.float32)
    out = rebalance_stacked(data, scales)
    assert out.scale.shape == () and float(out.scale) == 2.0**4
    expected = np.asarray(data, np.float64) * np.asarray(scales, np.float64)[:, None]
    np.testing.assert_array_equal(np.asarray(out.to_array(jnp.float32), np.float64), expected)


def test_rebalance_stacked_of_zero_scales_and_of_no_slices():
    data = jnp.asarray([[2.0], [3.0]], jnp.float32)
    zero = rebalance_stacked(data, jnp.zeros((2,), jnp.float32))
    assert float(zero.scale) == 0.0
    np.testing.assert_array_equal(zero.data, data)  # 0 / 0 would have made nan
    empty = rebalance_stacked(jnp.zeros((0, 3), jnp.float16), jnp.zeros((0,), jnp.float32))
    assert empty.data.shape == (0, 3) and float(empty.scale) == 1.0


def test_with_scalar_scale_folds_a_broadcast_scale_into_the_data():
    x = jsa.ScaledArray(jnp.asarray([[1.0, 1.0], [1.0, 1.0]], jnp.float32), np.asarray([[0.5], [4.0]], np.float32))
    out = with_scalar_scale(x)
    assert np.ndim(out.scale) == 0 and float(out.scale) == 4.0
    np.testing.assert_array_equal(out.to_array(), x.to_array())
    scalar = jsa.scaled_array(np.ones(2, np.float32), 2.0)
    assert with_scalar_scale(scalar) is scalar


def test_unscaled_and_numpy_api():
    x = jsa.scaled_array(np.asarray([1.5], np.float32), 4.0)
    np.testing.assert_array_equal(unscaled(x), [6.0])
    plain = jnp.ones(2)
    assert unscaled(plain) is plain
    assert numpy_api(np.float32(1), 2.0, np.ones(2)) is np
    assert numpy_api(np.float32(1), jnp.ones(2)) is jnp


def test_narrowing_raises_the_scale_where_the_largest_entry_would_overflow():
    """A backward sum rescaled by the RMS of a sample that missed its one large entry."""
    data = np.full(128, 1.0, np.float32)
    data[1] = 2.0**20  # float16 holds up to 65504
    wide = jsa.ScaledArray(jnp.asarray(data), jnp.float32(2.0**-3))
    out = narrowed_within_range(wide, jnp.float16)
    assert out.dtype == jnp.float16 and float(out.scale) == 2.0**3  # 2**20 / 2**14: factor 2**6
    np.testing.assert_array_equal(np.asarray(out.to_array(jnp.float32)), data * 2.0**-3)
    unchanged = narrowed_within_range(jsa.ScaledArray(jnp.ones(4), jnp.float32(2.0)), jnp.float16)
    assert float(unchanged.scale) == 2.0 and np.all(np.asarray(unchanged.data) == 1)
    empty = narrowed_within_range(jsa.ScaledArray(jnp.ones((0, 3)), jnp.float32(2.0)), jnp.float16)
    assert empty.shape == (0, 3) and empty.dtype == jnp.float16


def test_a_narrow_result_computed_on_the_value_is_kept_narrow_in_memory():
    """``scaled_from_value`` holds float16 results as float16: XLA's temporaries are plain JAX's.

    Without the barrier XLA kept the float32 ``tanh`` (read by the forward product and by the
    backward pass) in memory and narrowed it in each reader: 11% more temporary bytes than
    the plain float16 gradient of this function.
    """

    def loss(w, x):
        h = jnp.tanh(x @ w)
        return jnp.sum((h @ w.T).astype(jnp.float32) ** 2)

    x = jnp.full((1024, 512), 0.1, jnp.float16)
    w = jnp.full((512, 512), 0.01, jnp.float16)
    grad = jax.grad(loss)
    plain = jax.jit(grad).lower(w, x).compile().memory_analysis().temp_size_in_bytes
    step = jax.jit(jsa.scalify(grad, policy=jsa.RescalePolicy.static()))
    scaled = step.lower(jsa.as_scaled_array(w), jsa.as_scaled_array(x)).compile().memory_analysis()
    assert scaled.temp_size_in_bytes <= 1.01 * plain
