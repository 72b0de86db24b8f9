import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa
from jax_scalify.quantization import as_e8m0, from_e8m0, pow2_truncate

E8M0 = jnp.float8_e8m0fnu
# Exact powers of two built with NumPy (jnp.exp2 is not exact on every backend).
POW2 = np.exp2(np.arange(-127, 128, dtype=np.float64)).astype(np.float32)


def _bytes(e):
    return np.asarray(jax.lax.bitcast_convert_type(e, jnp.uint8))


def test_pow2_truncate():
    x = jnp.array([3.0, -3.0, 0.75, 1.0, -1.9999, 0.0, -0.0, np.inf, -np.inf, 2.0**-140 * 3], jnp.float32)
    out = np.asarray(pow2_truncate(x))
    np.testing.assert_array_equal(out[:9], [2.0, -2.0, 0.5, 1.0, -1.0, 0.0, -0.0, np.inf, -np.inf])
    assert out[9] == np.float32(2.0**-139)  # subnormal: highest set bit kept
    assert np.isnan(np.asarray(pow2_truncate(jnp.array([np.nan]))))[0]
    assert pow2_truncate(jnp.array([5.0], jnp.bfloat16)).dtype == jnp.bfloat16
    np.testing.assert_array_equal(jax.jit(pow2_truncate)(x)[:5], out[:5])


def _reference_truncate(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        x = x.astype(np.float64)
        _, e = np.frexp(x)
        return np.where(np.isfinite(x) & (x != 0), np.sign(x) * np.ldexp(1.0, e - 1), x)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_pow2_truncate_every_value_of_small_formats(dtype):
    uint = np.uint8 if jnp.dtype(dtype).itemsize == 1 else np.uint16
    x = np.arange(np.iinfo(uint).max + 1, dtype=uint).view(dtype)
    got = np.asarray(jax.jit(pow2_truncate)(jnp.asarray(x)))
    assert got.dtype == x.dtype
    expected = _reference_truncate(x)
    with np.errstate(invalid="ignore"):
        got = got.astype(np.float64)
    same = (got == expected) & (np.signbit(got) == np.signbit(expected))
    assert np.all(same | (np.isnan(got) & np.isnan(expected)))


def test_pow2_truncate_scaled_array_and_errors():
    sx = jsa.ScaledArray(jnp.array([3.0, -1.5]), jnp.float32(0.25))
    out = pow2_truncate(sx)
    assert float(out.scale) == 0.25
    np.testing.assert_array_equal(np.asarray(out.to_array()), [0.5, -0.25])
    with pytest.raises(TypeError, match="floating"):
        pow2_truncate(jnp.arange(3))


def test_e8m0_round_trip_is_exact_on_the_whole_range():
    e = as_e8m0(jnp.asarray(POW2))
    assert e.dtype == E8M0
    np.testing.assert_array_equal(_bytes(e), np.arange(255))
    np.testing.assert_array_equal(np.asarray(from_e8m0(e)), POW2)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: from_e8m0(as_e8m0(x)))(jnp.asarray(POW2))), POW2)
    np.testing.assert_array_equal(np.asarray(from_e8m0(jnp.arange(255, dtype=jnp.uint8))), POW2)


def test_as_e8m0_rounds_down_and_special_values():
    x = jnp.array([3.0, 0.75, 1.9999, 0.0, -0.0, 2.0**-130, -2.0, np.inf, np.nan, -np.inf], jnp.float32)
    np.testing.assert_array_equal(_bytes(as_e8m0(x)), [128, 126, 127, 0, 0, 0, 255, 255, 255, 255])
    assert _bytes(as_e8m0(jnp.array([6.0], jnp.float16)))[0] == 129
    assert _bytes(as_e8m0(jnp.array([2.0**100], jnp.bfloat16)))[0] == 227


def test_from_e8m0_special_values_and_dtypes():
    b = jnp.array([255, 0, 127, 142, 143], jnp.uint8)
    out = np.asarray(from_e8m0(b))
    assert np.isnan(out[0]) and out[1] == np.float32(2.0**-127) and out[2] == 1.0
    f16 = np.asarray(from_e8m0(b, jnp.float16))
    assert f16.dtype == np.float16 and f16[1] == 0 and f16[3] == 2.0**15 and np.isinf(f16[4])
    bf16 = from_e8m0(b, jnp.bfloat16)
    assert bf16.dtype == jnp.bfloat16 and float(bf16[3]) == 2.0**15
    with pytest.raises(TypeError, match="as_e8m0"):
        from_e8m0(jnp.ones(2))
    with pytest.raises(TypeError, match="floating output dtype"):
        from_e8m0(b, jnp.int32)


def test_scales_of_a_scaled_tree_to_e8m0():
    tree = jsa.as_scaled_array({"a": jnp.ones(3), "b": jnp.ones(2)}, scale=np.float32(2.0**-20))
    scales = jax.tree.map(lambda x: as_e8m0(x.scale), tree, is_leaf=jsa.is_scaled_leaf)
    assert {k: int(_bytes(v)) for k, v in scales.items()} == {"a": 107, "b": 107}
