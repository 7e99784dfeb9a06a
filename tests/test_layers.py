"""The package's layers: each folder imports only folders below it (lazy imports included), and
no module imports itself back through others (no import cycle, inside a folder either)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "attnserve"

# What each folder (or top-level module) may import from attnserve, besides itself and
# `attnserve.defaults`. The package's own __init__.py and __main__.py (the console entry, which
# imports `cli`) are left out.
ALLOWED: dict[str, set[str]] = {
    "defaults": set(),
    "model": set(),
    "text": {"model"},
    "kernels": set(),
    "engine": {"model", "kernels"},
    "export": {"engine", "model", "kernels"},
    "convert": {"model"},
    "provision": {"engine", "model", "export", "convert"},
    "training": {"engine", "model"},
    "service": {"engine", "model", "text", "provision"},  # exports and imports: provision
    "bench": {
        "engine", "model", "kernels", "export", "convert", "training", "service", "loadtest",
        "text", "provision",
    },
    "loadtest": {"engine", "model", "service", "training"},
    "cli": {
        "engine", "model", "kernels", "export", "convert", "training", "service", "bench",
        "loadtest", "text", "provision",
    },
}  # fmt: skip
ENTRY = {"__init__", "__main__"}


def unit_files(unit: str) -> list[Path]:
    """The files of a folder, or the one file of a top-level module."""
    module = PACKAGE / f"{unit}.py"
    return [module] if module.is_file() else sorted((PACKAGE / unit).rglob("*.py"))


def attnserve_imports(path: Path) -> set[str]:
    """Second-level names (`engine`, `model`, ...) of every attnserve import in a file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "attnserve":
                names = [f"attnserve.{alias.name}" for alias in node.names]
        found |= {n.split(".")[1] for n in names if n.startswith("attnserve.")}
    return found


def test_every_folder_and_module_has_a_rule() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in PACKAGE.glob("*.py")} - ENTRY
    assert folders | modules == set(ALLOWED)


@pytest.mark.parametrize("unit", sorted(ALLOWED))
def test_imports_point_down(unit: str) -> None:
    allowed = ALLOWED[unit] | {unit, "defaults"}
    wrong = {
        str(path.relative_to(PACKAGE)): sorted(attnserve_imports(path) - allowed)
        for path in unit_files(unit)
    }
    assert {k: v for k, v in wrong.items() if v} == {}


def test_the_rule_sees_lazy_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "def f():\n    from attnserve.service import app\n    import attnserve.bench\n"
    )
    assert attnserve_imports(module) == {"service", "bench"}


# -- import cycles ----------------------------------------------------------------------------
# The graph's nodes are modules (attnserve.engine.onnx.lm_backend); an edge is any import of
# another attnserve module anywhere in a file: at the top, inside a function (a lazy import only
# defers the cycle to the first call, and still ties the two modules together), or under
# TYPE_CHECKING. `from attnserve.x import y` points at the module attnserve.x.y when there is
# one, else at attnserve.x. The packages' __init__ files that importing a module also runs are
# not edges of their own (attnserve's import nothing of their submodules).


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (lazy imports included)."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in files else node.module)
        graph[name] = set()
        for target in targets:
            while target and target not in files:  # attnserve.x.y.Name -> attnserve.x.y
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles (a -> b -> ... -> a) a depth-first walk of the graph closes: none exactly
    when the graph has no cycle."""
    cycles: list[list[str]] = []
    finished: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> None:
        path.append(module)
        for target in sorted(graph[module]):
            if target in path:
                cycles.append([*path[path.index(target) :], target])
            elif target not in finished:
                visit(target)
        path.pop()
        finished.add(module)

    for module in sorted(graph):
        if module not in finished:
            visit(module)
    return cycles


def test_no_import_cycles() -> None:
    cycles = import_cycles(import_graph(PACKAGE))
    assert [" -> ".join(c) for c in cycles] == []


def test_the_cycle_check_sees_lazy_imports(tmp_path: Path) -> None:
    root = tmp_path / "attnserve"
    (root / "engine").mkdir(parents=True)
    for name in ("__init__.py", "engine/__init__.py", "engine/c.py"):
        (root / name).write_text("")
    (root / "engine" / "a.py").write_text("from attnserve.engine.b import B\n")
    (root / "engine" / "b.py").write_text(
        "import attnserve.engine.c\n\ndef f():\n    from attnserve.engine import a\n"
    )
    graph = import_graph(root)
    assert graph["attnserve.engine.b"] == {"attnserve.engine.a", "attnserve.engine.c"}
    assert import_cycles(graph) == [
        ["attnserve.engine.a", "attnserve.engine.b", "attnserve.engine.a"]
    ]


def test_building_the_command_line_imports_no_runtime() -> None:
    """`attnserve --help` stays fast: no torch, ONNX Runtime, FastAPI, transformers or Ray."""
    code = (
        "import sys\n"
        "from attnserve.cli import build_parser\n"
        "build_parser()\n"
        "heavy = ['torch', 'onnxruntime', 'fastapi', 'transformers', 'ray']\n"
        "heavy = [m for m in heavy if m in sys.modules]\n"
        "sys.exit(repr(heavy) if heavy else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
