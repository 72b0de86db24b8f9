"""Helpers of ``jax_scalify.lax.base_scaling``: exact power-of-two multiplies of the data."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_scalify.lax.base_scaling import mul_data


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
