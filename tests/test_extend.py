"""``jax_scalify.extend``: the engine for rule authors, kept out of the user namespaces."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive

import jax_scalify as jsa
from jax_scalify import extend as jsx
from jax_scalify.core import scaling as base_scaling
from jax_scalify.lax import subjaxpr

ENGINE_NAMES = (
    "RegisteredRule",
    "ScaleFacts",
    "any_scale_array",
    "custom_scale_call_p",
    "eval_closed_jaxpr",
    "eval_scaled_jaxpr",
    "eval_sub_jaxpr",
    "fixed_point",
    "is_any_scale",
    "known_scalar",
    "observe_equations",
    "primitive_of",
    "registered_rule",
    "registered_rules",
    "scales_are_pow2",
)


pytestmark = pytest.mark.usefixtures("restore_registry")  # tests/conftest.py


# Not for rule authors: the data model is the package's (``jsa.ScaledArray``, ``jsa.is_scaled_leaf``),
# a value is read with ``jsa.asarray``, 0.1's lookup is ``jsa.core.find_registered_scaled_op``.
NOT_ENGINE_NAMES = (
    "ScaledArray",
    "find_registered_scaled_op",
    "is_floating_dtype",
    "is_scaled",
    "lax_primitive",
    "ScaledRule",
    "to_float32_value",
    "unscaled",
    "value_of",
)


def test_extend_exports_the_engine_and_the_shared_scale_arithmetic():
    assert set(ENGINE_NAMES) <= set(jsx.__all__)
    assert set(jsx.__all__) <= set(base_scaling.__all__) | set(subjaxpr.__all__) | set(ENGINE_NAMES) | {
        "ScaledPrimitiveType",
        "register_scaled_lax_op",
        "register_scaled_op",
        "promote",
        "is_numpy",
    }
    assert not set(jsx.__all__) & set(NOT_ENGINE_NAMES)
    for name in jsx.__all__:
        assert getattr(jsx, name) is not None, name
    assert jsx.at_scale is base_scaling.at_scale and jsx.register_scaled_op is jsa.core.register_scaled_op


def test_engine_internals_are_not_in_the_user_namespaces():
    for namespace in (jsa, jsa.core):
        public = set(getattr(namespace, "__all__", dir(namespace)))
        assert not public & set(ENGINE_NAMES), namespace.__name__
    assert "scalify" in jsa.__all__ and "ScaledArray" in jsa.__all__ and "extend" not in jsa.__all__


def test_a_rule_written_with_extend_alone():
    my_p = Primitive("keep_scale_for_test")
    my_p.def_impl(lambda x: 2 * x)
    my_p.def_abstract_eval(lambda x: x)

    @jsx.register_scaled_op(my_p, scalar_preserving=True)
    def scaled_keep(x: jsa.ScaledArray, **params) -> jsa.ScaledArray:
        """Scale kept, the primitive applied to the data."""
        return jsx.bind_keep_scale(my_p, x, **params)

    x = jsa.scaled_array(np.array([1.0, 1.5], np.float16), 2.0**-10)
    out = jsa.scalify(my_p.bind, policy=jsa.RescalePolicy.static())(x)
    assert float(out.scale) == 2.0**-10 and out.dtype == jnp.float16
    np.testing.assert_array_equal(out.to_array(jnp.float32), [2.0**-9, 3 * 2.0**-10])
    assert jsx.registered_rule(my_p).scalar_fn is not None
