"""``flax.serialization`` support for ``ScaledArray`` (``to_bytes``/``from_bytes``, state dicts).

Flax serialises the nodes it knows (dicts, lists, dataclasses, registered types) and hands
anything else to msgpack, which cannot encode a ``ScaledArray``. Registering it maps it to
the state dict ``{"data": ..., "scale": ...}``, so a training state holding ``ScaledArray``s
round-trips through ``flax.serialization.to_bytes``/``from_bytes``.

Importing Flax takes longer than importing JAX, so ``import jax_scalify`` does not import
it: the registration runs when ``flax.serialization`` is imported (at once if it already
was), through a finder on ``sys.meta_path`` that wraps only that module's loader.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

from ..core.array import ScaledArray

_FLAX_MODULE = "flax.serialization"


def _to_state_dict(x: ScaledArray) -> dict[str, Any]:
    from flax import serialization

    return {"data": serialization.to_state_dict(x.data), "scale": serialization.to_state_dict(x.scale)}


def _from_state_dict(target: ScaledArray, state: dict[str, Any]) -> ScaledArray:
    from flax import serialization

    missing = {"data", "scale"} - set(state)
    if missing:
        raise ValueError(f"Cannot restore a ScaledArray: the state dict lacks {sorted(missing)}.")
    data = serialization.from_state_dict(target.data, state["data"])
    scale = serialization.from_state_dict(target.scale, state["scale"])
    return ScaledArray.unchecked(data, scale)  # the scale is checked when scalify receives it


def register_flax_serialization() -> bool:
    """Register ``ScaledArray`` with ``flax.serialization`` now; False if Flax is not installed.

    ``import jax_scalify`` arranges this automatically; calling it again is harmless.
    """
    try:
        from flax import serialization
    except ImportError:
        return False
    serialization.register_serialization_state(ScaledArray, _to_state_dict, _from_state_dict, override=True)
    return True


class _RegisterAfterExec(importlib.abc.Loader):
    """Loader wrapper: run the real loader, then register the handlers."""

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        register_flax_serialization()


class _FlaxImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself; when ``flax.serialization`` is being imported, wraps its loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _FLAX_MODULE:
            return None
        uninstall_flax_hook()
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfterExec(spec.loader)
        return spec


_HOOK = _FlaxImportHook()


def uninstall_flax_hook() -> None:
    if _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)


def install_flax_hook() -> None:
    """Register now if ``flax.serialization`` is loaded, else when it gets imported."""
    if _FLAX_MODULE in sys.modules:
        register_flax_serialization()
    elif _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)


__all__ = ["register_flax_serialization"]
