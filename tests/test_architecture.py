"""The import graph keeps its layers (docs/architecture.md): no module imports from a layer above its own, no
import cycle, and the architecture page names every production module. Every import counts, those inside
functions too: a lazy import is still a dependency."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("grammars", "samplers", "server", "mediation", "benchmarks")

# Lowest first. A module may import its own layer and those below; the first matching prefix decides.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("constraints", ("grammars",)),
    ("grammar engines", ("samplers",)),
    (
        "models and server support",
        (
            "server.models",
            "server.settings",
            "server.errors",
            "server.request_context",
            "server.metrics",
            "server.memory",
            "server.torch_threads",
            "server.modes",
        ),
    ),
    ("engine", ("server.engine",)),
    ("serving core", ("server.serving",)),
    ("OpenAI API", ("server.openai",)),
    ("HTTP", ("server.app", "server.auth", "server.middleware", "server.grammar_routes")),
    ("benchmarks", ("benchmarks",)),
    ("command line", ("server.cli",)),
]
# The client-side mediation package stands alone: it talks to corral over HTTP only.
STANDALONE = ("mediation",)


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (a `from package import name` counts as the submodule if it is one)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def _layer(module: str) -> int:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS and docs/architecture.md")


MODULES = _modules()
GRAPH = {name: _imports(path, MODULES) - {name} for name, path in MODULES.items()}


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = []
    for module, imported in GRAPH.items():
        if module.split(".")[0] in STANDALONE:
            continue
        for target in imported:
            if target.split(".")[0] in STANDALONE:
                continue
            if _layer(target) > _layer(module):
                upward.append(f"{module} ({LAYERS[_layer(module)][0]}) -> {target} ({LAYERS[_layer(target)][0]})")
    assert not upward, "imports from a higher layer:\n" + "\n".join(sorted(upward))


def test_mediation_stands_alone() -> None:
    reaching = [
        f"{module} -> {target}"
        for module, imported in GRAPH.items()
        if module.split(".")[0] == "mediation"
        for target in imported
        if target.split(".")[0] != "mediation"
    ]
    assert not reaching, reaching


def test_no_import_cycles() -> None:
    # Package __init__ files re-export their submodules: an edge into a package's own children is not a cycle.
    def edges(module: str) -> set[str]:
        return {t for t in GRAPH[module] if not t.startswith(module + ".")}

    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges(module)):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("package", ["grammars", "samplers", "server", "mediation"])
def test_architecture_page_names_every_production_module(package: str) -> None:
    page = (REPO / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`([a-z_]+(?:/[a-z_]+)*\.py)`", page))
    missing = [
        str(path.relative_to(REPO))
        for name, path in MODULES.items()
        if name.split(".")[0] == package and path.name != "__init__.py"
        and str(path.relative_to(REPO)) not in named
    ]
    assert not missing, f"docs/architecture.md does not describe: {missing}"


def _long_classes(path: Path, limit: int) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        f"{path.relative_to(REPO)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.end_lineno is not None and node.end_lineno - node.lineno + 1 >= limit
    ]


def test_modules_and_classes_stay_small() -> None:
    """Budgets a newcomer can read (issue 21): no production file over 500 lines, no class of 300 or more."""
    long_files = [
        f"{path.relative_to(REPO)} ({n} lines)"
        for path in MODULES.values()
        if (n := len(path.read_text().splitlines())) > 500
    ]
    assert not long_files, long_files
    long_classes = [entry for path in MODULES.values() for entry in _long_classes(path, 300)]
    assert not long_classes, long_classes


def test_engine_step_reads_as_its_phases() -> None:
    tree = ast.parse(MODULES["server.engine.engine"].read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    step = next(n for n in engine.body if isinstance(n, ast.FunctionDef) and n.name == "step")
    assert step.end_lineno is not None
    assert step.end_lineno - step.lineno + 1 <= 15
