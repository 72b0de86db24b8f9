"""Every registered scale rule is exercised by at least one invariance case.

Test modules that add rules define ``INVARIANCE_CASES`` (see ``tests/invariance.py``) and
run them with the invariance property. This test gathers all those cases, traces them, and
checks that together they reach every primitive in the registry.
"""

import importlib
import pkgutil

import tests
from jax_scalify.extend import registered_rules
from tests.invariance import primitives_of

# Primitives whose rules are exercised by dedicated tests instead of invariance cases,
# with the reason.
COVERED_ELSEWHERE = {}


def _all_cases():
    cases = []
    for info in pkgutil.walk_packages(tests.__path__, prefix="tests."):
        if info.name.rsplit(".", 1)[-1].startswith("test_"):
            module = importlib.import_module(info.name)
            cases.extend(getattr(module, "INVARIANCE_CASES", []))
    return cases


def test_every_registered_rule_has_an_invariance_case():
    exercised = set()
    for case in _all_cases():
        exercised |= primitives_of(case)
    registered = {prim.name for prim in registered_rules()}
    missing = registered - exercised - set(COVERED_ELSEWHERE)
    assert not missing, f"Registered rules without an invariance case: {sorted(missing)}"
