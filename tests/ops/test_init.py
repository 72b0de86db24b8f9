"""The ``jsa.ops`` namespace: the user API of its modules' ``__all__``, each name listed once, in its module."""

import importlib
import pkgutil
from pathlib import Path

import jax_scalify as jsa

OPS_DIR = Path(jsa.ops.__file__).parent


def _ops_modules():
    return [importlib.import_module(f"jax_scalify.ops.{m.name}") for m in pkgutil.iter_modules([str(OPS_DIR)])]


# The primitive and its rule, for rule authors: in jax_scalify.ops.rescaling only.
RULE_AUTHORS_ONLY = {"dynamic_rescale_p", "scaled_dynamic_rescale"}


def test_jsa_ops_is_the_modules_all_but_the_rule_authors_names():
    exported = set(jsa.ops.__all__)
    assert len(exported) == len(jsa.ops.__all__)  # no name exported by two modules
    union = set()
    for module in _ops_modules():
        assert hasattr(module, "__all__"), f"{module.__name__} has no __all__"
        user_api = set(module.__all__) - RULE_AUTHORS_ONLY
        missing = [name for name in user_api if getattr(jsa.ops, name, None) is not getattr(module, name)]
        assert not missing, f"jsa.ops does not hold {module.__name__}'s {missing}"
        union |= set(module.__all__)
    assert exported == union - RULE_AUTHORS_ONLY and RULE_AUTHORS_ONLY <= union
    assert {"dynamic_rescale", "delayed_rescale", "cast_on_backward", "debug_print"} <= exported
