"""The ``jsa.lax`` namespace: every module's ``__all__``, every registered rule exported."""

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


def test_every_registered_rule_is_exported_by_its_module_and_by_jsa_lax():
    for prim, entry in registered_rules().items():
        module = importlib.import_module(entry.rule.__module__)
        name = entry.rule.__name__
        assert getattr(module, name, None) is entry.rule, f"rule of '{prim.name}' is not {module.__name__}.{name}"
        assert name in module.__all__, f"{module.__name__}.__all__ misses {name} (rule of '{prim.name}')"
        if module.__name__.startswith("jax_scalify.lax."):
            assert getattr(jsa.lax, name) is entry.rule and name in jsa.lax.__all__


_HELPER_MODULES = ("jax_scalify.core.scaling", "jax_scalify.lax.subjaxpr")


def test_jsa_lax_is_exactly_the_rule_modules_all():
    exported = set(jsa.lax.__all__)
    assert len(exported) == len(jsa.lax.__all__)  # no name exported by two modules
    for module in _lax_modules():
        if module.__name__ not in _HELPER_MODULES:  # rule authors' helpers: jsa.extend
            assert set(module.__all__) <= exported, module.__name__
    assert {"set_scaling", "get_data_scale", "stop_scaling", "rebalance", "scaled_add"} <= exported


def test_rule_modules_import_no_private_name_from_a_sibling():
    """Shared helpers are public names of base_scaling (or core), never a sibling's privates."""
    for path in sorted(LAX_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                private = [a.name for a in node.names if a.name.startswith("_") and a.name != "*"]
                assert not private, f"{path.name} imports private names {private} from {node.module}"
