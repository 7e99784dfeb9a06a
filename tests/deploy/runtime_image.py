"""`python runtime_image.py ARGS...` runs `attnserve ARGS...` as the runtime image would.

Only the distributions that the image installs (deploy/docker/requirements-cpu.txt and their
dependencies, attnserve itself) can be imported: the test venv's others (torch, onnxscript,
safetensors, transformers, pytest, ...) are named in ATTNSERVE_TEST_BLOCKED and importing them
fails as if they were not installed.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

BLOCKED_VARIABLE = "ATTNSERVE_TEST_BLOCKED"


class NotInImage(importlib.abc.MetaPathFinder):
    """Finds the blocked top-level modules (and their submodules) first, and refuses them."""

    def __init__(self, blocked: set[str]) -> None:
        self.blocked = blocked

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname.partition(".")[0] in self.blocked:
            raise ModuleNotFoundError(f"No module named {fullname!r} (not in the runtime image)")
        return None


def main() -> int:
    blocked = set(filter(None, os.environ.get(BLOCKED_VARIABLE, "").split(",")))
    sys.meta_path.insert(0, NotInImage(blocked))
    from attnserve.cli import main as attnserve

    return attnserve(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
