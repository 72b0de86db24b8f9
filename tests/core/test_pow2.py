import hypothesis.strategies as st
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings

from jax_scalify.core import (
    Pow2RoundMode,
    get_mantissa,
    pow2_decompose,
    pow2_exponent,
    pow2_round,
    pow2_round_down,
    pow2_round_up,
)

SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32)


@pytest.mark.parametrize("npapi", [np, jnp])
@pytest.mark.parametrize("mode", [Pow2RoundMode.DOWN, Pow2RoundMode.UP])
def test_decompose_is_exact_for_normals(npapi, mode):
    x = npapi.asarray(np.array([1.0, 1.5, 3.0, -3.0, 0.1, 2.0**100 * 1.3, 2.0**-100 * 1.7], np.float32))
    scale, mantissa = pow2_decompose(x, mode=mode)
    np.testing.assert_array_equal(np.asarray(scale) * np.asarray(mantissa), np.asarray(x))
    m = np.abs(np.asarray(mantissa))
    if mode == Pow2RoundMode.DOWN:
        assert np.all((m >= 1) & (m < 2))
    else:
        assert np.all((m > 0.5) & (m <= 1))


def test_decompose_subnormals_float32_numpy():
    x = np.array([1e-44, 3e-39, np.float32(2.0**-149)], np.float32)
    scale, mantissa = pow2_decompose(x)
    np.testing.assert_array_equal(scale * mantissa, x)
    np.testing.assert_array_equal(scale, [2.0**-147, 2.0**-128, 2.0**-149])


def test_decompose_subnormals_float16_jax():
    x = jnp.asarray(np.array([2.0**-24, 3 * 2.0**-24, 1e-5], np.float16))
    scale, mantissa = pow2_decompose(x)
    np.testing.assert_array_equal(np.asarray(scale) * np.asarray(mantissa, np.float32), np.asarray(x, np.float32))
    np.testing.assert_array_equal(np.asarray(scale), np.array([2.0**-24, 2.0**-23, 2.0**-17], np.float16))


@pytest.mark.parametrize("npapi", [np, jnp])
def test_decompose_special_values(npapi):
    scale, mantissa = pow2_decompose(npapi.asarray(SPECIALS))
    np.testing.assert_array_equal(np.asarray(scale), [0, 0, np.inf, np.inf, np.nan])
    np.testing.assert_array_equal(np.asarray(mantissa), [0, 0, 1, -1, np.nan])


def test_decompose_scale_dtype_and_fp8():
    x = jnp.asarray(np.array([0.001953125, 3.0, 448], ml_dtypes.float8_e4m3fn))
    scale, mantissa = pow2_decompose(x, scale_dtype=np.float32)
    assert scale.dtype == np.float32 and mantissa.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(scale), [2.0**-9, 2.0, 256.0])


def test_decompose_none_mode():
    scale, mantissa = pow2_decompose(np.float32(-3.0), mode=Pow2RoundMode.NONE)
    assert scale == 3.0 and mantissa == -1.0


def test_round_down_up_and_mantissa():
    x = np.array([3.0, -3.0, 4.0, 0.3], np.float32)
    np.testing.assert_array_equal(pow2_round_down(x), [2.0, -2.0, 4.0, 0.25])
    np.testing.assert_array_equal(pow2_round_up(x), [4.0, -4.0, 4.0, 0.5])
    np.testing.assert_array_equal(get_mantissa(x), np.array([1.5, -1.5, 1.0, 0.3 * 4], np.float32))
    np.testing.assert_array_equal(pow2_round(x, Pow2RoundMode.NONE), x)
    np.testing.assert_array_equal(pow2_round(x), pow2_round_down(x))
    np.testing.assert_array_equal(pow2_round_down(SPECIALS), SPECIALS)
    np.testing.assert_array_equal(pow2_round_up(SPECIALS), SPECIALS)


def test_round_up_overflow_gives_inf():
    assert pow2_round_up(np.float32(2.0**127 * 1.5)) == np.inf


def test_exponent():
    np.testing.assert_array_equal(pow2_exponent(np.array([1.0, 3.0, 0.5, 1e-44], np.float32)), [0, 1, -1, -147])


def test_rejects_integers_and_stochastic():
    with pytest.raises(TypeError, match="floating"):
        pow2_decompose(np.array([1, 2]))
    with pytest.raises(NotImplementedError, match="STOCHASTIC"):
        pow2_round(np.float32(3.0), Pow2RoundMode.STOCHASTIC)


@settings(max_examples=200, deadline=None)
@given(st.floats(width=32, allow_nan=False, allow_infinity=False))
def test_decompose_property(value):
    x = np.float32(value)
    scale, mantissa = pow2_decompose(x)
    assert scale * mantissa == x
    if x != 0:
        assert 1 <= abs(mantissa) < 2
        assert pow2_round_down(scale) == scale


def test_decompose_subnormals_float32_jax_matches_numpy():
    x = np.array([1e-44, 3e-39, 2.0**-149, 3 * 2.0**-140, -5e-42, 1.0, 0.0, np.inf], np.float32)
    for mode in (Pow2RoundMode.DOWN, Pow2RoundMode.UP):
        np_scale, np_mantissa = pow2_decompose(x, mode=mode)
        jax_scale, jax_mantissa = pow2_decompose(jnp.asarray(x), mode=mode)
        np.testing.assert_array_equal(np.asarray(jax_scale), np_scale)
        np.testing.assert_array_equal(np.asarray(jax_mantissa), np_mantissa)
    assert float(pow2_round_down(jnp.asarray(np.float32(3 * 2.0**-140)))) == 2.0**-139
