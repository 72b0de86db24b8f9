"""The ``jsa.lax`` package: every module's ``__all__``, every registered rule exported by its module."""

import ast
import importlib
import pkgutil
from pathlib import Path

import jax_scalify as jsa
from jax_scalify.extend import registered_rules

LAX_DIR = Path(jsa.lax.__file__).parent


def _lax_modules():
    return [importlib.import_module(f"jax_scalify.lax.{m.name}") for m in pkgutil.iter_modules([str(LAX_DIR)])]


def test_every_lax_module_has_an_all_whose_names_exist():
    for module in _lax_modules():
        assert hasattr(module, "__all__"), f"{module.__name__} has no __all__"
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert not missing, f"{module.__name__}.__all__ names missing objects: {missing}"


def test_every_registered_rule_is_exported_by_its_module():
    for prim, entry in registered_rules().items():
        module = importlib.import_module(entry.rule.__module__)
        name = entry.rule.__name__
        assert getattr(module, name, None) is entry.rule, f"rule of '{prim.name}' is not {module.__name__}.{name}"
        assert name in module.__all__, f"{module.__name__}.__all__ misses {name} (rule of '{prim.name}')"


def test_no_name_is_exported_by_two_lax_modules():
    owners = {}
    for module in _lax_modules():
        for name in module.__all__:
            assert name not in owners, f"{name} is in {owners.get(name)}.__all__ and {module.__name__}.__all__"
            owners[name] = module.__name__


def test_jsa_lax_is_the_scaling_primitives_and_0_1s_rule_functions():
    """The user API is the four scaling primitives; 0.1's rule functions resolve to the rules in their modules."""
    assert sorted(jsa.lax.__all__) == ["get_data_scale", "rebalance", "set_scaling", "stop_scaling"]
    assert jsa.lax.scaled_add is jsa.lax.rules_arithmetic.scaled_add  # 0.1's name (jax_scalify.compat)
    assert jsa.lax.scaled_dot_general is jsa.lax.rules_linalg.scaled_dot_general
    assert not hasattr(jsa.lax, "scaled_fft")  # a rule 0.1 did not have: in its module only


def test_rule_modules_import_no_private_name_from_a_sibling():
    """Shared helpers are public names of core (core.scaling ...), never a sibling's privates."""
    for path in sorted(LAX_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                private = [a.name for a in node.names if a.name.startswith("_") and a.name != "*"]
                assert not private, f"{path.name} imports private names {private} from {node.module}"
