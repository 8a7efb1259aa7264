"""The layering rules of ARCHITECTURE.md, checked on the source, and no import circles among the pack's modules."""

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


# --- No import circles (rule: test_no_import_circles_among_the_pack_s_modules) ---------------------

ROOT_PACKAGE = "vidmem"


def pack_modules(root: Path, name: str = ROOT_PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for the package at `root` and every sub-package with an __init__.py."""
    found = {name: root / "__init__.py"}
    for path in sorted(root.iterdir()):
        if path.is_dir() and (path / "__init__.py").is_file():
            found.update(pack_modules(path, f"{name}.{path.name}"))
        elif path.suffix == ".py" and path.name != "__init__.py":
            found[f"{name}.{path.stem}"] = path
    return found


def _runs(test: ast.expr) -> bool:
    """False for `if TYPE_CHECKING:` (and `typing.TYPE_CHECKING`), whose body never runs."""
    return not (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
                or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_statements(nodes: list[ast.AST]):
    """Every import statement among `nodes` that can run, at any depth (functions included)."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and not _runs(node.test):
            yield from _import_statements(node.orelse)
        else:
            yield from _import_statements(list(ast.iter_child_nodes(node)))


def import_edges(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported pack module: line of the first import of it}."""
    edges = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: dict[str, int] = {}
        for node in _import_statements(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            else:
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                found = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            for target in found:
                if target in modules and target != name and not name.startswith(target + "."):
                    targets.setdefault(target, node.lineno)
        edges[name] = targets
    return edges


def import_circles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Each circle: a group of two or more modules that all reach one another, sorted."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in edges[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return groups


def _cycle_in(group: list[str], edges: dict[str, dict[str, int]]) -> list[str]:
    """One cycle through the group's first module (breadth first: the shortest way back)."""
    start = group[0]
    came_from = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(t for t in edges[module] if t in group):
                if target == start:
                    path = [module]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return path[::-1] + [start]
                if target not in came_from:
                    came_from[target] = module
                    following.append(target)
        frontier = following
    return group


def describe(group: list[str], edges: dict[str, dict[str, int]]) -> str:
    cycle = _cycle_in(group, edges)
    steps = [f"{a} (line {edges[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
    return f"circle among {', '.join(group)}; for example " + "; ".join(steps)


def test_no_import_circles_among_the_pack_s_modules():
    """No module of the pack can import itself again through others, however late.

    The pack's modules are what `import vidmem.…` can reach: the root and every folder below it that
    has an __init__.py (tests/ and bench/ are scripts, not modules of the pack). An edge A -> B means
    that running A can import B:

    - every import statement counts, wherever it sits: at module level, under an `if` or `try`, in a
      class, or inside a function. An import moved into a function still runs, only later; if it
      closes a circle, the circle is still there (the two modules still cannot be understood, tested
      or moved apart) and it only shows up as a half-initialised module when the call order changes.
    - deliberate lazy loading never needs an exemption: loading something late (torch, diffusers, the
      planner behind the CLI) keeps an import path light, and that works along an acyclic graph. A
      lazy import that is *needed* to avoid ImportError is exactly a hidden circle, so the test tells
      the two apart by the graph itself, not by where the import sits.
    - skipped: imports under `if TYPE_CHECKING:` (they never run) and importlib.import_module with a
      computed name, which the test cannot see (the pack uses it for the third-party classes a config
      names, and in memory/parallel/bootstrap.py to start a rank in a new process).
    - `from X import name` is an edge to the submodule X.name when that module exists, else to X (the
      name is defined in X's __init__). A submodule's own ancestor packages are not edges: Python
      starts them before the submodule, so `from . import host` in nodes/decode.py is decode -> host,
      not decode -> nodes.
    """
    edges = import_edges(pack_modules(PACKAGE))
    circles = import_circles(edges)
    assert not circles, "\n".join(describe(group, edges) for group in circles)


def test_the_circle_check_sees_imports_inside_functions(tmp_path):
    """The check itself: a circle closed by an import inside a function is found, one behind
    `if TYPE_CHECKING:` is not, and a submodule does not import its own package by being in it."""
    package = tmp_path / "pack"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from .sub import a\n")
    (package / "sub" / "__init__.py").write_text("from . import a, b\n")
    (package / "sub" / "a.py").write_text("from .b import B\n")
    (package / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"
                                           "B = 1\n")
    (package / "sub" / "c.py").write_text("def late():\n    from .. import sub\n")
    modules = pack_modules(package, "pack")
    assert import_circles(import_edges(modules)) == []
    (package / "sub" / "b.py").write_text("B = 1\n\ndef late():\n    from . import a\n")
    edges = import_edges(pack_modules(package, "pack"))
    assert import_circles(edges) == [["pack.sub.a", "pack.sub.b"]]
    assert describe(["pack.sub.a", "pack.sub.b"], edges) == (
        "circle among pack.sub.a, pack.sub.b; for example pack.sub.a (line 1) -> pack.sub.b; pack.sub.b (line 4) -> pack.sub.a")
