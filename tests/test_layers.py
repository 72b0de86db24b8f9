"""The package's layers import downwards only.

``core`` (data model, power-of-two algebra, measuring and narrowing, registry, sites,
interpreter) <- ``lax`` (static scale rules) <- ``policy`` (the rescale policy) <- the user
packages (``ops``, ``tree``, ``quantization`` <- ``nn``, ``optim``, ``interop``,
``analysis``) <- the namespaces that gather them (``extend``, ``compat``, the package).
Every import counts, lazy ones inside functions included, and so does a module looked up by
name (``importlib.import_module``, ``sys.modules``).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jax_scalify"

LAYERS = {
    "core": 0,
    "lax": 1,
    "policy": 2,
    "ops": 3,
    "tree": 3,
    "quantization": 3,
    "nn": 4,
    "optim": 4,
    "interop": 4,
    "analysis": 4,
    "extend": 5,
    "compat": 5,
    "": 6,  # jax_scalify/__init__.py
}


def _unit(module: str) -> str:
    """``jax_scalify.core.sites`` -> ``core``; ``jax_scalify`` -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every jax_scalify module ``path`` imports or looks up by name."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("jax_scalify")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if not module.startswith("jax_scalify"):
                continue
            if node.module is None or module.count(".") == 0:  # `from . import x`: x is a module
                found += [(node.lineno, f"{module}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, module))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith("jax_scalify.") and " " not in node.value:
                found.append((node.lineno, node.value))
    return found


def _files():
    return sorted(PACKAGE.rglob("*.py"))


def test_every_package_has_a_layer():
    units = {_unit(_module_name(p)) for p in _files()}
    assert units <= set(LAYERS), f"packages without a layer: {units - set(LAYERS)}"


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_downwards_only(path):
    unit = _unit(_module_name(path))
    upward = [
        f"line {line}: {module}"
        for line, module in _imported_modules(path)
        if _unit(module) in LAYERS and _unit(module) != unit and LAYERS[_unit(module)] >= LAYERS[unit]
    ]
    assert not upward, (
        f"{path.relative_to(PACKAGE)} (layer {unit or 'package'}) imports at or above its layer: {upward}"
    )
