"""The ``jsa.ops`` namespace: every module's ``__all__``, each name listed once, in its module."""

import importlib
import pkgutil
from pathlib import Path

import jax_scalify as jsa

OPS_DIR = Path(jsa.ops.__file__).parent


def _ops_modules():
    return [importlib.import_module(f"jax_scalify.ops.{m.name}") for m in pkgutil.iter_modules([str(OPS_DIR)])]


def test_jsa_ops_is_exactly_the_modules_all():
    exported = set(jsa.ops.__all__)
    assert len(exported) == len(jsa.ops.__all__)  # no name exported by two modules
    union = set()
    for module in _ops_modules():
        assert hasattr(module, "__all__"), f"{module.__name__} has no __all__"
        missing = [name for name in module.__all__ if getattr(jsa.ops, name, None) is not getattr(module, name)]
        assert not missing, f"jsa.ops does not hold {module.__name__}'s {missing}"
        union |= set(module.__all__)
    assert exported == union
    assert {"dynamic_rescale", "delayed_rescale", "cast_on_backward", "debug_print"} <= exported
