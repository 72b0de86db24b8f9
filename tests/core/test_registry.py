import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive, primitives

import jax_scalify as jsa
from jax_scalify.core import registry
from jax_scalify.core import (
    ScaledPrimitiveType,
    find_registered_scaled_op,
    register_scaled_lax_op,
    register_scaled_op,
    registered_rules,
)


@pytest.fixture(autouse=True)
def restore_registry():
    """Rules registered by a test must not leak into the registry other tests (and docs) see."""
    saved = dict(registry._RULES)
    yield
    registry._RULES.clear()
    registry._RULES.update(saved)


def _fresh_primitive(name):
    prim = Primitive(name)
    prim.def_impl(lambda x: x * 2)
    prim.def_abstract_eval(lambda x: x)
    return prim


def test_register_as_decorator_and_find():
    prim = _fresh_primitive("double_for_test")

    @register_scaled_op(prim)
    def scaled_double(x):
        """Scale doubled, data unchanged."""
        return jsa.ScaledArray(x.data, x.scale * 2)

    assert find_registered_scaled_op(prim) == (scaled_double, ScaledPrimitiveType.FORWARD)
    entry = registered_rules()[prim]
    assert entry.summary == "Scale doubled, data unchanged."
    out = jsa.scalify(prim.bind)(jsa.scaled_array(np.ones(2, np.float32), 4.0))
    assert float(out.scale) == 8.0
    np.testing.assert_array_equal(out.to_array(), [8.0, 8.0])


def test_always_scale_rule_runs_on_plain_inputs():
    prim = _fresh_primitive("always_for_test")
    register_scaled_op(
        prim,
        lambda x: jsa.ScaledArray(x.data, x.scale * 2),
        scaled_type=ScaledPrimitiveType.ALWAYS_SCALE,
    )
    out = jsa.scalify(prim.bind)(jnp.ones(2))
    assert isinstance(out, jsa.ScaledArray)


def test_register_scaled_lax_op_uses_the_function_name():
    @register_scaled_lax_op
    def scaled_cosh(x):
        return x

    assert find_registered_scaled_op(primitives.cosh_p)[0] is scaled_cosh


def test_registration_errors():
    with pytest.raises(ValueError, match="scaled_<primitive>"):
        register_scaled_lax_op(lambda x: x)
    with pytest.raises(TypeError, match="JAX primitive"):
        register_scaled_op("add", lambda x: x)
    with pytest.raises(ValueError, match="no primitive"):

        @register_scaled_lax_op
        def scaled_not_a_primitive(x):
            return x


def test_missing_rule_error_names_primitive_shapes_and_line():
    prim = _fresh_primitive("unruled_for_test")

    def user_function(x):
        return prim.bind(x)

    with pytest.raises(NotImplementedError) as info:
        jsa.scalify(user_function)(jsa.scaled_array(np.ones((2, 3), np.float16), 1.0))
    message = str(info.value)
    assert "'unruled_for_test'" in message
    assert "ScaledArray float16[2, 3]" in message
    assert "test_registry.py" in message and "user_function" in message
    assert "register_scaled_op" in message
