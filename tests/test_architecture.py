"""The import graph keeps its layers (docs/architecture.md): no module imports from a layer above its own, no
import cycle, and the architecture page names every production module. Every import counts, those inside
functions too: a lazy import is still a dependency."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOP = "corral"  # the one import name the distribution installs

# Lowest first. A module may import its own layer and those below; the first matching prefix decides.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("constraints", ("corral.grammars",)),
    ("grammar engines", ("corral.grammar_engines",)),
    (
        "models, kernels and server support",
        (
            "corral.server.models",
            "corral.kernels",
            "corral.server.settings",
            "corral.server.errors",
            "corral.server.request_context",
            "corral.server.metrics",
            "corral.server.memory",
            "corral.server.torch_threads",
            "corral.server.modes",
        ),
    ),
    # The structured-output wing is the engine's own stage (its sequences carry the wing's per-row state): one
    # layer, kept apart by the wing's face (test_the_structured_wing_is_reached_through_its_face).
    ("engine", ("corral.server.engine", "corral.structured")),
    (
        "serving core",
        (
            "corral.server.serving",
            "corral.server.prepared",
            "corral.server.compile_stage",
            "corral.server.fallback",
            "corral.server.answer_metrics",
        ),
    ),
    ("OpenAI API", ("corral.server.openai",)),
    ("HTTP", ("corral.server.app", "corral.server.auth", "corral.server.middleware", "corral.server.grammar_routes")),
    ("benchmarks", ("corral.benchmarks",)),
    ("command line", ("corral.server.cli",)),
]
# The client-side mediation package stands alone: it talks to corral over HTTP only.
STANDALONE = ("corral.mediation",)


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted((REPO / TOP).rglob("*.py")):
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


def _package(module: str) -> str:
    """`corral.server.engine.engine` -> `corral.server`: the layout's package a module belongs to."""
    return ".".join(module.split(".")[:2])


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
        if module == TOP or _package(module) in STANDALONE:
            continue
        for target in imported:
            if _package(target) in STANDALONE:
                continue
            if _layer(target) > _layer(module):
                upward.append(f"{module} ({LAYERS[_layer(module)][0]}) -> {target} ({LAYERS[_layer(target)][0]})")
    assert not upward, "imports from a higher layer:\n" + "\n".join(sorted(upward))


def test_mediation_stands_alone() -> None:
    reaching = [
        f"{module} -> {target}"
        for module, imported in GRAPH.items()
        if _package(module) == "corral.mediation"
        for target in imported
        if _package(target) != "corral.mediation"
    ]
    assert not reaching, reaching


def test_the_structured_wing_is_reached_through_its_face() -> None:
    """Outside the structured-output wing, production code imports what the wing offers from `corral.structured`
    (its `__all__`), never one of its modules."""
    wing = "corral.structured"
    reaching = sorted(
        f"{module} -> {target}"
        for module, imported in GRAPH.items()
        if _package(module) != wing
        for target in imported
        if target.startswith(wing + ".")
    )
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


@pytest.mark.parametrize(
    "package", ["corral.grammars", "corral.grammar_engines", "corral.structured", "corral.server", "corral.mediation"]
)
def test_architecture_page_names_every_production_module(package: str) -> None:
    page = (REPO / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`([a-z_]+(?:/[a-z_]+)*\.py)`", page))
    missing = [
        str(path.relative_to(REPO))
        for name, path in MODULES.items()
        if _package(name) == package and path.name != "__init__.py"
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


FILE_LIMIT = 400
CLASS_LIMIT = 250


def test_modules_and_classes_stay_small() -> None:
    """Budgets a newcomer can read (issues 21 and 49): no production file over 400 lines, no class over 250."""
    long_files = [
        f"{path.relative_to(REPO)} ({n} lines)"
        for path in MODULES.values()
        if (n := len(path.read_text().splitlines())) > FILE_LIMIT
    ]
    assert not long_files, long_files
    long_classes = [entry for path in MODULES.values() for entry in _long_classes(path, CLASS_LIMIT + 1)]
    assert not long_classes, long_classes


def test_engine_step_reads_as_its_phases() -> None:
    tree = ast.parse(MODULES["corral.server.engine.engine"].read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    step = next(n for n in engine.body if isinstance(n, ast.FunctionDef) and n.name == "step")
    assert step.end_lineno is not None
    assert step.end_lineno - step.lineno + 1 <= 15


def test_one_top_level_import_name() -> None:
    """The distribution installs `corral` alone: nothing else it ships can collide with a user's `server`."""
    config = (REPO / "pyproject.toml").read_text()
    assert 'include = ["corral*"]' in config
    assert 'corral = "corral.server.cli:main"' in config
    # Outside the checkout (the repository root off sys.path) the installed distribution is all there is.
    code = (
        "import importlib.util, sys\n"
        "sys.path = [p for p in sys.path if p not in ('', '.')]\n"
        "names = ('server', 'grammars', 'samplers', 'benchmarks', 'mediation', 'corral', 'corral.server')\n"
        "print([n for n in names if importlib.util.find_spec(n) is not None])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['corral', 'corral.server']"


def _service_parts() -> set[str]:
    """The attributes `Service.__init__` sets: the parts it holds (engine, loop, metrics, settings, ...)."""
    tree = ast.parse(MODULES["corral.server.serving"].read_text())
    service = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Service")
    init = next(n for n in service.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {
        target.attr
        for node in ast.walk(init)
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
    }


def test_no_module_reaches_through_the_service() -> None:
    """Layers above the serving core use what `Service` offers (prepare, run, stream, a few facts), never one of
    its parts' own attributes (`service.engine.scheduler`, `service.settings.api_keys`)."""
    parts = _service_parts()
    assert {"engine", "settings", "metrics", "loaded"} <= parts
    pattern = re.compile(r"\bservice\.(" + "|".join(sorted(parts)) + r")\.\w")
    reaching = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for name, path in MODULES.items()
        if name != "corral.server.serving"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not reaching, reaching


# Reading the environment is the settings' job (every CORRAL_ variable is a flag there). The exceptions: glibc's
# own MALLOC_ARENA_MAX, which corral must not override (memory.py), and the startup benchmark, which hands the
# server process it starts an empty cache directory through that server's own settings.
ENVIRONMENT_READERS = {"corral.server.settings", "corral.server.memory", "corral.benchmarks.startup.cli"}


def test_no_environment_read_outside_settings() -> None:
    reading = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            reads = (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
                     and isinstance(node.value, ast.Name) and node.value.id == "os")
            if reads and name not in ENVIRONMENT_READERS:
                reading.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not reading, reading
