"""Opening a language model's exported step graph with the backend its attention needs.

Plain attention runs on `OnnxLMBackend` (lm_backend.py), ONNX Runtime's GroupQueryAttention on
its subclass `OnnxGqaLMBackend` (lm_gqa.py); the variant's manifest says which the export wrote
(its `attention` option). The choice lives here, above both: lm_gqa.py subclasses lm_backend.py's
backend, so lm_backend.py cannot import it back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnserve.defaults import DEFAULT_VARIANT
from attnserve.engine.onnx.layout import LM_GQA, LM_PLAIN, read_manifest, variant_dir
from attnserve.engine.onnx.lm_backend import OnnxLMBackend
from attnserve.engine.onnx.lm_gqa import OnnxGqaLMBackend
from attnserve.model.decoder_checkpoint import read_decoder_config
from attnserve.model.decoder_config import DecoderConfig


def open_lm_backend(config: DecoderConfig, directory: str | Path, **kwargs: Any) -> OnnxLMBackend:
    """The backend for the step graph in `directory` (a variant's): plain attention, or
    GroupQueryAttention (its manifest's `attention` option)."""
    manifest = read_manifest(Path(directory))
    if manifest.get("options", {}).get("attention", LM_PLAIN) == LM_GQA:
        return OnnxGqaLMBackend(config, directory, **kwargs)
    return OnnxLMBackend(config, directory, **kwargs)


def open_lm_dir(
    model_dir: str | Path, variant: str = DEFAULT_VARIANT, **kwargs: Any
) -> OnnxLMBackend:
    """The backend of a language model directory's `variant` (MODEL/onnx/<variant>/)."""
    return open_lm_backend(
        read_decoder_config(model_dir), variant_dir(model_dir, variant), **kwargs
    )
