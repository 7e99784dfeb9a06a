"""Choosing and building a Backend for a model directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnserve.engine.backend import Backend

BACKENDS = ("torch",)


def load_backend(
    model_dir: str | Path, backend: str = "torch", *, threads: int | None = None, **kwargs: Any
) -> Backend[Any]:
    """A backend over `model_dir`; heavy runtimes are imported only here, when chosen."""
    if backend == "torch":
        from attnserve.engine.torch_backend import TorchBackend

        return TorchBackend.from_dir(model_dir, threads=threads)
    raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
