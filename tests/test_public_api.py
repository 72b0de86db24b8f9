"""The public surface: each namespace's ``__all__`` is pinned, so that growing it is a deliberate act.

A name added to a namespace must be added here too; a name of jax-scalify 0.1 that is no longer
in the current API is listed in ``jax_scalify.compat`` and stays importable where 0.1 had it.
"""

import importlib

import jax.numpy as jnp
import numpy as np
import pytest

import jax_scalify as jsa
from jax_scalify import compat

PUBLIC = {
    "jax_scalify": {
        "Pow2RoundMode",
        "RescalePolicy",
        "ScaledArray",
        "ScalifyConfig",
        "as_scaled_array",
        "asarray",
        "custom_scale",
        "device_put",
        "is_scaled_leaf",
        "scaled_array",
        "scaled_shardings",
        "scalify",
        # namespaces
        "analysis",
        "core",
        "lax",
        "nn",
        "ops",
        "optim",
        "quantization",
        "tree",
    },
    "jax_scalify.core": {
        "get_mantissa",
        "get_scalify_config",
        "pow2_decompose",
        "pow2_exponent",
        "pow2_round",
        "pow2_round_down",
        "pow2_round_up",
    },
    "jax_scalify.lax": {"get_data_scale", "rebalance", "set_scaling", "stop_scaling"},
    "jax_scalify.ops": {
        "DelayedRescaleState",
        "cast_on_backward",
        "cast_on_forward",
        "debug_callback",
        "debug_callback_grad",
        "debug_print",
        "debug_print_grad",
        "delayed_rescale",
        "dynamic_rescale",
        "dynamic_rescale_grad",
        "dynamic_rescale_l1",
        "dynamic_rescale_l1_grad",
        "dynamic_rescale_l2",
        "dynamic_rescale_l2_grad",
        "dynamic_rescale_max",
        "dynamic_rescale_max_grad",
        "init_delayed_rescale_state",
        "reduce_precision_on_backward",
        "reduce_precision_on_forward",
    },
    "jax_scalify.nn": {
        "CastDotGeneral",
        "cast_dot_general",
        "cross_entropy",
        "dot_general",
        "gelu",
        "layer_norm",
        "layer_norm_grad_rescale",
        "linear",
        "log_softmax",
        "logsumexp",
        "relu",
        "rms_norm",
        "silu",
        "softmax",
    },
    "jax_scalify.tree": {"all", "astype", "flatten", "leaves", "map", "map_values", "structure", "unflatten"},
    "jax_scalify.policy": {"RescalePolicy"},
    "jax_scalify.optim": {"CompensatedState", "scale_state"},
    "jax_scalify.analysis": {
        "BACKWARD",
        "DEFAULT_FORMATS",
        "FORWARD",
        "FormatRange",
        "GemmCall",
        "PHASES",
        "UPDATE",
        "ScaleRecord",
        "ScaleRecorder",
        "ScaleReport",
        "data_fractions",
        "entry_kernels",
        "fp8_upcasts",
        "gemm_calls",
        "log2_rms",
        "plot_report",
        "record_scales",
        "scale_statistics",
    },
    "jax_scalify.quantization": {"as_e8m0", "from_e8m0", "pow2_truncate"},
    "jax_scalify.extend": {
        "RegisteredRule",
        "ScaledPrimitiveType",
        "primitive_of",
        "register_scaled_lax_op",
        "register_scaled_op",
        "registered_rule",
        "registered_rules",
        "eval_closed_jaxpr",
        "eval_scaled_jaxpr",
        "observe_equations",
        "ScaleFacts",
        "any_scale_array",
        "is_any_scale",
        "is_numpy",
        "known_scalar",
        "promote",
        "scales_are_pow2",
        "custom_scale_call_p",
        "StructureGrew",
        "check_structure",
        "eval_sub_jaxpr",
        "fixed_point",
        "ScaleMap",
        "align_to_largest",
        "as_scale",
        "bind_aligned",
        "bind_keep_scale",
        "exact_root",
        "largest_scale",
        "mul_data",
        "narrow_range",
        "num_elements",
        "numpy_api",
        "on_value",
        "rebalance_stacked",
        "at_scale",
        "round_scale",
        "saturated_cast",
        "scale_bounds",
        "scale_capped_at_one",
        "scale_div",
        "scale_dtype",
        "scale_max",
        "scale_min",
        "scale_mul",
        "scaled_from_value",
        "scaled_power",
        "scaled_product",
        "select",
        "single_binary_reducer",
        "sqrt_size_pow2",
        "unit_scale",
        "unit_scaled_sum",
        "value_order_data",
        "widen",
        "with_scalar_scale",
        "zero_to_one",
    },
    "jax_scalify.interop": set(),
}

# jax-scalify 0.1's public names, namespace by namespace (its __init__ files; for lax, the rule
# functions its star imports exported, under the names this release still has).
NAMES_OF_0_1 = {
    "jax_scalify": {"Pow2RoundMode", "ScaledArray", "ScalifyConfig", "as_scaled_array", "asarray"}
    | {"debug_callback", "scaled_array", "scalify", "core", "lax", "ops", "tree"},
    "jax_scalify.core": {
        "Array",
        "ArrayTypes",
        "DTypeLike",
        "Pow2RoundMode",
        "ScaledArray",
        "ScaledPrimitiveType",
        "ScalifyConfig",
        "Shape",
        "Sharding",
        "as_scaled_array",
        "asarray",
        "debug_callback",
        "find_registered_scaled_op",
        "get_numpy_api",
        "get_scale_dtype",
        "get_scalify_config",
        "is_scaled_leaf",
        "is_static_anyscale",
        "is_static_one_scalar",
        "is_static_zero",
        "make_scaled_scalar",
        "pow2_decompose",
        "pow2_round",
        "pow2_round_down",
        "pow2_round_up",
        "register_scaled_lax_op",
        "register_scaled_op",
        "safe_div",
        "safe_reciprocal",
        "scaled_array",
        "scalify",
    },
    "jax_scalify.lax": {"get_data_scale", "get_data_scale_p", "rebalance", "set_scaling", "set_scaling_p"}
    | {"stop_scaling", "stop_scaling_p"}
    | {
        f"scaled_{p}"
        for p in (
            "abs add argmax argmin broadcast_in_dim concatenate conv_general_dilated convert_element_type cos div "
            "dot_general eq exp ge gt integer_pow is_finite le log lt max min mul ne neg pad reduce_max reduce_min "
            "reduce_precision reduce_prod reduce_sum reduce_window_max reduce_window_min reduce_window_sum reshape "
            "rev select_n sign sin slice sqrt stop_gradient sub transpose"
        ).split()
    },
    "jax_scalify.ops": {
        "cast_on_backward",
        "cast_on_forward",
        "debug_callback",
        "debug_callback_grad",
        "debug_print",
        "debug_print_grad",
        "dynamic_rescale_l1",
        "dynamic_rescale_l1_grad",
        "dynamic_rescale_l2",
        "dynamic_rescale_l2_grad",
        "dynamic_rescale_max",
        "dynamic_rescale_max_grad",
        "reduce_precision_on_backward",
        "reduce_precision_on_forward",
    },
    "jax_scalify.tree": {"all", "astype", "flatten", "leaves", "map", "structure", "unflatten"},
    "jax_scalify.quantization": {"as_e8m0"},
}


@pytest.mark.parametrize("namespace", sorted(PUBLIC))
def test_each_namespace_exports_exactly_its_listed_names(namespace):
    module = importlib.import_module(namespace)
    exported = list(getattr(module, "__all__", []))
    assert len(exported) == len(set(exported)), f"{namespace}.__all__ lists a name twice"
    assert set(exported) == PUBLIC[namespace], (
        f"{namespace}.__all__ changed: added {sorted(set(exported) - PUBLIC[namespace])}, "
        f"removed {sorted(PUBLIC[namespace] - set(exported))}; update tests/test_public_api.py if deliberate"
    )
    missing = [name for name in exported if not hasattr(module, name)]
    assert not missing, f"{namespace}.__all__ names missing objects: {missing}"


def test_the_0_1_names_not_in_the_current_api_are_the_compat_list():
    for namespace, names in NAMES_OF_0_1.items():
        assert set(compat.NAMES_0_1.get(namespace, ())) == names - PUBLIC[namespace], namespace
    assert set(compat.NAMES_0_1) <= set(NAMES_OF_0_1)
    assert set(compat.__all__) == {name for names in compat.NAMES_0_1.values() for name in names}


@pytest.mark.parametrize("namespace", sorted(NAMES_OF_0_1))
def test_every_0_1_name_is_importable_where_0_1_had_it(namespace):
    module = importlib.import_module(namespace)
    for name in sorted(NAMES_OF_0_1[namespace]):
        value = getattr(module, name)  # `from <namespace> import <name>` does this lookup
        if name in compat.NAMES_0_1.get(namespace, ()):
            assert value is getattr(compat, name), f"{namespace}.{name} is not jax_scalify.compat.{name}"
            assert name not in module.__all__


def test_0_1_names_resolve_to_the_current_objects():
    assert jsa.debug_callback is jsa.ops.debug_callback is jsa.core.debug_callback
    assert jsa.core.ScaledArray is jsa.ScaledArray and jsa.core.scalify is jsa.scalify
    assert jsa.lax.scaled_add is jsa.lax.rules_arithmetic.scaled_add
    assert jsa.core.register_scaled_op is jsa.extend.register_scaled_op
    from jax_scalify.core import make_scaled_scalar  # noqa: F401  (a module __getattr__ answers `from ... import`)
    from jax_scalify.lax import scaled_dot_general, set_scaling_p  # noqa: F401


def test_a_name_no_namespace_has_raises_attribute_error_naming_the_module():
    for module, name in ((jsa, "scaled_add"), (jsa.core, "rescale"), (jsa.lax, "scaled_fft")):
        with pytest.raises(AttributeError, match=f"'{module.__name__}' has no attribute '{name}'"):
            getattr(module, name)


def test_one_public_way_to_read_a_plain_value():
    """``jsa.asarray`` (a leaf or a pytree); ``x.to_array()`` is 0.1's method for one array, and
    ``np.asarray(x)`` / ``float(x)`` are NumPy's and Python's protocols. No namespace exports another."""
    readouts = {"unscaled", "value_of", "to_float32_value", "get_data_and_scale"}
    for namespace in PUBLIC:
        assert not readouts & set(getattr(importlib.import_module(namespace), "__all__", [])), namespace
    x = jsa.scaled_array(np.array([1.0, -2.0], np.float16), 2.0**20)
    tree = {"w": x, "step": jnp.int32(3)}
    expected = np.array([2.0**20, -(2.0**21)], np.float32)
    np.testing.assert_array_equal(jsa.asarray(x), expected)
    np.testing.assert_array_equal(jsa.asarray(tree)["w"], expected)
    assert jsa.asarray(tree)["step"] is tree["step"]
    np.testing.assert_array_equal(x.to_array(), expected)
    np.testing.assert_array_equal(np.asarray(x), expected)
