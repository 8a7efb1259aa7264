"""The layering rules of ARCHITECTURE.md, checked on the source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1]
HOST_MODULES = {"comfy", "comfy_api", "comfy_extras", "comfy_execution", "folder_paths", "server", "execution", "nodes"}


def imports(path: Path) -> list[tuple[int, str]]:
    """(level, module) for every import; level > 0 for relative imports."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(0, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or ""))
    return found


def files(sub: str) -> list[Path]:
    return sorted((PACKAGE / sub).rglob("*.py"))


@pytest.mark.parametrize("path", files("memory") + files("pipelines"), ids=lambda p: p.name)
def test_engine_and_pipelines_never_import_the_host(path):
    for level, module in imports(path):
        assert level or module.split(".")[0] not in HOST_MODULES, f"{path.name} imports {module}"


@pytest.mark.parametrize("path", files("memory"), ids=lambda p: p.name)
def test_memory_imports_no_other_vidmem_layer(path):
    for level, module in imports(path):
        assert not (level >= 2 and module.split(".")[0] in {"pipelines", "nodes"}), f"{path.name} imports {module}"


@pytest.mark.parametrize("path", [p for p in files("nodes") if p.name != "host.py"], ids=lambda p: p.name)
def test_only_host_py_imports_comfyui(path):
    for level, module in imports(path):
        assert level or module.split(".")[0] not in HOST_MODULES, f"{path.name} imports {module}"
