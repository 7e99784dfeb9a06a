"""attnserve's kernel library (attnserve/kernels/library.py, csrc/): built where a compiler is,
switched off, listed whole by the build, of this version of attnserve or refused."""

from __future__ import annotations

import ctypes
import platform
import shutil
from pathlib import Path

import onnxruntime as ort
import pytest

from attnserve import kernels
from attnserve.kernels import library
from tests.kernels.helpers import (
    BUILT,
    needs_library,
)


def test_the_library_is_built_where_a_compiler_is() -> None:
    if not (shutil.which("c++") or shutil.which("g++")) or platform.machine() != "x86_64":
        pytest.skip("no C++ compiler or not x86-64: the graphs run their stock bodies")
    assert BUILT, "pip install -e . should have built attnserve/kernels/_ortops*.so"


def test_the_switch_turns_the_library_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    assert kernels.library_path() is None
    assert not kernels.register(ort.SessionOptions())


def test_the_build_lists_every_source() -> None:
    """setup.py names every file of csrc/ (the .cc files compiled, the headers as dependencies)
    and the Makefile rebuilds when any of them changes."""
    root = Path(__file__).resolve().parents[2]
    setup = (root / "setup.py").read_text()
    csrc = root / "attnserve" / "kernels" / "csrc"
    names = sorted(p.name for p in csrc.iterdir() if p.suffix in (".cc", ".h"))
    assert names and all(f'"{name}"' in setup for name in names), names
    assert (
        "$(wildcard attnserve/kernels/csrc/*.cc attnserve/kernels/csrc/*.h)"
        in (root / "Makefile").read_text()
    )


@needs_library
def test_the_library_declares_its_version() -> None:
    path = kernels.library_path()
    assert path is not None and path.parent == Path(kernels.__file__).parent
    assert ctypes.CDLL(str(path)).attnserve_kernels_version() == kernels.VERSION


@needs_library
def test_a_library_of_another_version_is_not_registered(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A build left by another version of attnserve (ops that may differ) is ignored, with the
    command that rebuilds it; the graphs then run their stock bodies."""
    monkeypatch.setattr(library, "VERSION", kernels.VERSION + 1)
    library._built_library.cache_clear()
    try:
        assert kernels.library_path() is None
        assert "built from another version of attnserve" in caplog.text
    finally:
        monkeypatch.undo()
        library._built_library.cache_clear()
    assert kernels.library_path() is not None
