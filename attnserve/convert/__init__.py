"""Importers: other formats -> attnserve model directories.

`import_model(src, out)` picks the importer from what `src` is: a Hugging Face directory is
recognised by `model_type` in its config.json, a llama.cpp GGUF file by its magic (or its
`.gguf` suffix). Each family's importer lives in its own module and
imports torch; this module does not.
"""

from __future__ import annotations

from pathlib import Path

from attnserve.model.checkpoint import ModelDirError, read_json_object

# model_type -> (module, function) of its importer
HF_IMPORTERS: dict[str, tuple[str, str]] = {
    "marian": ("attnserve.convert.marian", "import_marian"),
    # decoder-only: one importer, each model_type's switches in hf_decoder.FAMILIES
    "llama": ("attnserve.convert.hf_decoder", "import_hf_decoder"),
    "mistral": ("attnserve.convert.hf_decoder", "import_hf_decoder"),
    "qwen2": ("attnserve.convert.hf_decoder", "import_hf_decoder"),
    "qwen3": ("attnserve.convert.hf_decoder", "import_hf_decoder"),
    "phi3": ("attnserve.convert.hf_decoder", "import_hf_decoder"),
    "gemma2": ("attnserve.convert.hf_decoder", "import_hf_decoder"),
    "gemma3_text": ("attnserve.convert.hf_decoder", "import_hf_decoder"),
    "gemma3": ("attnserve.convert.hf_decoder", "import_hf_decoder"),  # its language model
    "m2m_100": ("attnserve.convert.fairseq", "import_family"),  # M2M100 and NLLB
    "mbart": ("attnserve.convert.fairseq", "import_family"),
    "bart": ("attnserve.convert.fairseq", "import_family"),
    "t5": ("attnserve.convert.t5", "import_t5"),
}
GGUF_IMPORTER = ("attnserve.convert.gguf", "import_gguf")
GGUF_MAGIC = b"GGUF"


class UnsupportedModelError(ModelDirError, ValueError):
    """`src` is no format or family attnserve imports."""


def is_gguf(src: Path) -> bool:
    """A file with the GGUF magic, or any path named *.gguf (its importer says what is wrong)."""
    if src.is_file():
        with src.open("rb") as f:
            if f.read(4) == GGUF_MAGIC:
                return True
    return src.suffix.lower() == ".gguf"


def detect_family(src: Path) -> str:
    """The family of a Hugging Face directory (its config.json's `model_type`)."""
    if not src.is_dir():
        raise UnsupportedModelError(
            f"{src}: expected a Hugging Face model directory or a .gguf file"
        )
    model_type = read_json_object(src, "config.json").get("model_type")
    if model_type not in HF_IMPORTERS:
        raise UnsupportedModelError(
            f"{src}: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(sorted(HF_IMPORTERS))}"
        )
    return str(model_type)


def import_model(src: str | Path, out: str | Path) -> str:
    """Convert `src` into the model directory `out`; returns the family imported."""
    import importlib

    if is_gguf(Path(src)):
        module, function = GGUF_IMPORTER
        getattr(importlib.import_module(module), function)(src, out)
        from attnserve.model.decoder_checkpoint import directory_family

        return directory_family(out)
    family = detect_family(Path(src))
    module, function = HF_IMPORTERS[family]
    getattr(importlib.import_module(module), function)(src, out)
    return family
