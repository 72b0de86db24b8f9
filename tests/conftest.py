"""Test-session setup: XLA flags for eight host (CPU) devices and fast compilation.

- eight host devices, so that sharding and shard_map are tested;
- LLVM optimisation level 0 for the compiled kernels: the test programs are small and
  compiled once or twice each, so XLA's compilation is most of the run time, and level 0
  compiles them about a quarter faster. The HLO XLA optimises (fusions, collectives, the
  FP8 GEMMs the tests count) is the same at every level; the generated code may round
  differently by an ulp where the optimiser would contract a multiply-add, which the tests'
  tolerances allow.

XLA reads ``XLA_FLAGS`` once, when JAX initialises its backends, so the flags are set here at
import time, before any test module imports JAX. Flags already in the environment are kept
and win over these defaults.
"""

import os

_DEFAULT_XLA_FLAGS = {
    "--xla_force_host_platform_device_count": "8",
    "--xla_backend_optimization_level": "0",
}

for _flag, _value in _DEFAULT_XLA_FLAGS.items():
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}={_value}".strip()


import pytest  # noqa: E402  (after the flag: pytest does not import JAX)


@pytest.fixture
def restore_registry():
    """Rules registered by a test must not leak into the registry other tests (and docs) see."""
    from jax_scalify.core import registry  # here, not at import time: JAX reads XLA_FLAGS once

    saved = dict(registry._RULES)
    yield
    registry._RULES.clear()
    registry._RULES.update(saved)


_MAPS = "/proc/self/maps"
_MAP_BUDGET = 55_000  # Linux's default vm.max_map_count is 65,530; one test adds at most a few thousand
_until_check = [1]


@pytest.fixture(autouse=True)
def _release_compiled_code():
    """Frees the compiled executables of earlier tests when the process nears the kernel's map limit.

    Each XLA:CPU executable maps its generated code; the program tests keep their compiled steps
    for the session (shared between tests), and a worker that ran a few hundred of them reached
    Linux's limit of 65,530 memory maps, where the next compilation crashed the process
    (a segmentation fault inside XLA). Past the budget the shared steps and JAX's caches are
    dropped and compiled again where needed.
    """
    yield
    _until_check[0] -= 1
    if _until_check[0] > 0 or not os.path.exists(_MAPS):
        return
    with open(_MAPS) as maps:
        count = sum(1 for _ in maps)
    _until_check[0] = 1 if count > 30_000 else 10  # reading the maps costs a few ms
    if count > _MAP_BUDGET:
        import gc

        import jax

        from tests.programs import harness

        harness.release_compiled_steps()
        jax.clear_caches()
        gc.collect()
