"""Test-session setup: eight host (CPU) devices, so that sharding and shard_map are tested.

XLA reads ``XLA_FLAGS`` once, when JAX initialises its backends, so the flag is set here at
import time, before any test module imports JAX. Flags already in the environment are kept;
a device count given there wins.
"""

import os

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"

if _DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_COUNT_FLAG}=8".strip()


import pytest  # noqa: E402  (after the flag: pytest does not import JAX)


@pytest.fixture
def restore_registry():
    """Rules registered by a test must not leak into the registry other tests (and docs) see."""
    from jax_scalify.core import registry  # here, not at import time: JAX reads XLA_FLAGS once

    saved = dict(registry._RULES)
    yield
    registry._RULES.clear()
    registry._RULES.update(saved)
