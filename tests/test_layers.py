"""The package's layers: each folder imports only folders below it (lazy imports included)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "attnserve"

# What each folder may import from attnserve (besides itself and `attnserve.defaults`).
ALLOWED: dict[str, set[str]] = {
    "model": set(),
    "text": {"model"},
    "kernels": set(),
    "engine": {"model", "kernels"},
    "export": {"engine", "model", "kernels"},
    "convert": {"model"},
    "training": {"engine", "model"},
    "service": {"engine", "model", "export", "convert", "text"},
    "bench": {
        "engine", "model", "kernels", "export", "convert", "training", "service", "loadtest",
        "text",
    },
    "loadtest": {"engine", "model", "service", "training"},
    "cli": {
        "engine", "model", "kernels", "export", "convert", "training", "service", "bench",
        "loadtest", "text",
    },
}  # fmt: skip


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


def test_every_folder_has_a_rule() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(ALLOWED)


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_imports_point_down(folder: str) -> None:
    allowed = ALLOWED[folder] | {folder, "defaults"}
    wrong = {
        str(path.relative_to(PACKAGE)): sorted(attnserve_imports(path) - allowed)
        for path in (PACKAGE / folder).rglob("*.py")
    }
    assert {k: v for k, v in wrong.items() if v} == {}


def test_the_rule_sees_lazy_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "def f():\n    from attnserve.service import app\n    import attnserve.bench\n"
    )
    assert attnserve_imports(module) == {"service", "bench"}


def test_building_the_command_line_imports_no_runtime() -> None:
    """`attnserve --help` stays fast: no torch, ONNX Runtime, FastAPI or transformers."""
    code = (
        "import sys\n"
        "from attnserve.cli import build_parser\n"
        "build_parser()\n"
        "heavy = ['torch', 'onnxruntime', 'fastapi', 'transformers']\n"
        "heavy = [m for m in heavy if m in sys.modules]\n"
        "sys.exit(repr(heavy) if heavy else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
