import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive, primitives
from jax.interpreters import mlir

import jax_scalify as jsa
from jax_scalify.core import find_registered_scaled_op  # 0.1's lookup (jax_scalify.compat)
from jax_scalify.extend import (
    RegisteredRule,
    ScaledPrimitiveType,
    register_scaled_lax_op,
    register_scaled_op,
    registered_rule,
    registered_rules,
)

pytestmark = pytest.mark.usefixtures("restore_registry")  # tests/conftest.py


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


def test_one_registration_call_stores_every_option_in_one_entry():
    prim = _fresh_primitive("options_for_test")

    def double_scalar(scalar, **params):
        return scalar * 2

    @register_scaled_op(prim, unpromoted_inputs=True, scalar_preserving=double_scalar)
    def scaled_options(x):
        """Scale kept."""
        return x

    entry = registered_rule(prim)
    assert isinstance(entry, RegisteredRule) and entry is registered_rules()[prim]
    assert entry.rule is scaled_options and entry.scaled_type == ScaledPrimitiveType.FORWARD
    assert entry.unpromoted_inputs and entry.scalar_fn is double_scalar and entry.summary == "Scale kept."
    assert not hasattr(scaled_options, "_jsa_unpromoted_inputs")  # no metadata on the function


def test_registering_again_replaces_the_whole_entry():
    prim = _fresh_primitive("replaced_for_test")
    register_scaled_op(prim, lambda x: x, unpromoted_inputs=True, scalar_preserving=True)
    register_scaled_op(prim, lambda x: x)
    entry = registered_rule(prim)
    assert not entry.unpromoted_inputs and entry.scalar_fn is None


def test_a_rule_registered_again_reaches_jitted_calls_compiled_before():
    """The scaled bodies of ``jax.jit`` calls are compiled once and cached: a rule registered
    since must not be hidden behind the body compiled with the old one."""
    prim = _fresh_primitive("rejit_double_for_test")
    mlir.register_lowering(prim, mlir.lower_fun(lambda x: x * 2, multiple_results=False))
    f = jsa.scalify(jax.jit(lambda x: prim.bind(x)), policy=jsa.RescalePolicy.static())
    x = jsa.scaled_array(np.ones(2, np.float32), 1.0)
    register_scaled_op(prim, lambda x: jsa.ScaledArray(prim.bind(x.data), x.scale))
    assert float(f(x).scale) == 1.0
    register_scaled_op(prim, lambda x: jsa.ScaledArray(x.data, x.scale * 2))
    assert float(f(x).scale) == 2.0


def test_scalar_preserving_true_is_the_identity_on_the_scalar():
    prim = _fresh_primitive("identity_scalar_for_test")
    register_scaled_op(prim, lambda x: x, scalar_preserving=True)
    assert registered_rule(prim).scalar_fn(np.float32(3.0), some_param=1) == 3.0


def test_register_scaled_lax_op_takes_the_same_options():
    @register_scaled_lax_op(scalar_preserving=True, unpromoted_inputs=True)
    def scaled_cosh(x):
        return x

    entry = registered_rule(primitives.cosh_p)
    assert entry.rule is scaled_cosh and entry.unpromoted_inputs and entry.scalar_fn is not None


def test_unpromoted_inputs_reach_the_rule_as_plain_arrays():
    prim = Primitive("two_inputs_for_test")
    prim.def_impl(lambda x, y: x + y)
    prim.def_abstract_eval(lambda x, y: x)
    seen = {}

    def rule(x, y):
        seen["types"] = (type(x), type(y))
        return jsa.ScaledArray(x.data + jsa.asarray(y) / x.scale, x.scale)

    scaled_x = jsa.scaled_array(np.ones(2, np.float32), 4.0)
    register_scaled_op(prim, rule)
    jsa.scalify(prim.bind)(scaled_x, jnp.ones(2))
    assert seen["types"][1] is jsa.ScaledArray  # promoted by default
    register_scaled_op(prim, rule, unpromoted_inputs=True)
    out = jsa.scalify(prim.bind)(scaled_x, jnp.ones(2))
    assert seen["types"][1] is not jsa.ScaledArray and not isinstance(seen["types"][1], jsa.ScaledArray)
    np.testing.assert_array_equal(out.to_array(), [5.0, 5.0])


def test_scalar_preserving_keeps_a_broadcast_constant_known():
    """A constant through a declared primitive is split at trace time where it meets scaled data."""
    prim = Primitive("scalar_map_for_test")
    prim.def_impl(lambda x: x * 3)
    prim.def_abstract_eval(lambda x: x)

    def rule(x):
        return jsa.ScaledArray(prim.bind(x.data), x.scale * 3)

    def f(x):
        return x * prim.bind(jnp.full((2,), 2.0**-20, np.float32))

    x = jsa.scaled_array(np.ones(2, np.float32), 1.0)
    static = jsa.scalify(f, policy=jsa.RescalePolicy.static())
    register_scaled_op(prim, rule)
    unknown = static(x)
    register_scaled_op(prim, rule, scalar_preserving=lambda scalar, **params: scalar * 3)
    known = static(x)
    np.testing.assert_array_equal(known.to_array(), unknown.to_array())
    assert float(unknown.scale) == 1.0  # an unknown array: promoted with scale 1
    assert float(known.scale) == 2.0**-18  # 3 * 2**-20, split exactly: its exponent went into the scale


def test_registration_option_errors():
    prim = _fresh_primitive("bad_options_for_test")
    with pytest.raises(TypeError, match="scalar_preserving.*bool or a function"):
        register_scaled_op(prim, lambda x: x, scalar_preserving="yes")
