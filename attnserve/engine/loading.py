"""Building a Backend for a model directory (attnserve/provision.py imports and exports it
first)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnserve.defaults import BACKENDS, DEFAULT_VARIANT
from attnserve.engine.backend import Backend


def parse_backend_name(name: str) -> tuple[str, str | None]:
    """ "torch" -> ("torch", None); "onnx" -> ("onnx", None); "onnx-int8" -> ("onnx", "int8")."""
    backend, _, variant = name.partition("-")
    return backend, variant or None


def load_backend(
    model_dir: str | Path, backend: str = "torch", *, threads: int | None = None, **kwargs: Any
) -> Backend[Any]:
    """A backend over `model_dir`; heavy runtimes are imported only here, when chosen.

    `backend` is "torch", "onnx" (with `variant=` and `provider=` keyword arguments) or the
    shorthand "onnx-<variant>" (e.g. "onnx-int8"). A decoder-only model directory (config.json
    with a "family") gets a language-model backend; `stop_ids=` adds stop tokens to it.
    """
    kind, variant = parse_backend_name(backend)
    from attnserve.model.decoder_checkpoint import ENCODER_DECODER, directory_family

    if directory_family(model_dir) != ENCODER_DECODER:
        return _load_lm_backend(model_dir, backend, threads=threads, **kwargs)
    if kind == "torch" and variant is None:
        from attnserve.engine.torch_backend import TorchBackend

        return TorchBackend.from_dir(model_dir, threads=threads)
    if kind == "onnx":
        from attnserve.engine.onnx.backend import OnnxBackend

        options = {k: v for k, v in kwargs.items() if k in ("provider", "io_binding", "spinning")}
        chosen = variant or kwargs.get("variant") or DEFAULT_VARIANT
        return OnnxBackend.from_dir(model_dir, chosen, threads=threads, **options)
    raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")


def _load_lm_backend(
    model_dir: str | Path, backend: str, *, threads: int | None, **kwargs: Any
) -> Backend[Any]:
    """A decoder-only model's backend; `stop_ids`: its tokenizer's end-of-turn tokens."""
    kind, variant = parse_backend_name(backend)
    stop_ids = kwargs.get("stop_ids", ())
    if kind == "torch" and variant is None:
        from attnserve.engine.torch_lm import TorchLMBackend

        return TorchLMBackend.from_dir(model_dir, threads=threads, stop_ids=stop_ids)
    if kind == "onnx":
        from attnserve.engine.onnx.lm_open import open_lm_dir

        options = {k: v for k, v in kwargs.items() if k in ("provider", "io_binding", "spinning")}
        chosen = variant or kwargs.get("variant") or DEFAULT_VARIANT
        return open_lm_dir(model_dir, chosen, threads=threads, stop_ids=stop_ids, **options)
    raise ValueError(f"unknown backend {kind!r}; choose from {', '.join(BACKENDS)}")
