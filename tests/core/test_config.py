import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa
from jax_scalify.core import get_scalify_config


def test_defaults():
    config = get_scalify_config()
    assert config.rounding_mode == jsa.Pow2RoundMode.DOWN
    assert config.scale_dtype == np.float32


def test_context_manager_nests_and_restores():
    with jsa.ScalifyConfig(rounding_mode=jsa.Pow2RoundMode.UP):
        assert get_scalify_config().rounding_mode == jsa.Pow2RoundMode.UP
        with jsa.ScalifyConfig(scale_dtype=jnp.float16):
            assert get_scalify_config().scale_dtype == np.float16
        assert get_scalify_config().scale_dtype == np.float32
    assert get_scalify_config().rounding_mode == jsa.Pow2RoundMode.DOWN


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        jsa.ScalifyConfig().rounding_mode = jsa.Pow2RoundMode.UP


def test_scale_dtype_changes_created_scales():
    with jsa.ScalifyConfig(scale_dtype=jnp.float16):
        x = jsa.as_scaled_array(np.ones(3, np.float16))
    assert x.scale.dtype == np.float16


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"rounding_mode": "down"}, ValueError),
        ({"scale_dtype": np.int32}, ValueError),
        ({"scale_dtype": jnp.float8_e4m3fn}, ValueError),
        ({"rounding_mode": jsa.Pow2RoundMode.STOCHASTIC}, NotImplementedError),
    ],
)
def test_bad_config_values(kwargs, error):
    with pytest.raises(error):
        jsa.ScalifyConfig(**kwargs)
