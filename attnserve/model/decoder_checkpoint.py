"""Decoder-only model directories: config.json (a DecoderConfig), model.safetensors, metadata.json.

A decoder-only directory's config.json carries a top-level ``"family"`` key (``"llama"``,
``"qwen2"``, ...: the model_type imported);
an encoder-decoder directory's (a ModelConfig) has none: `directory_family` tells them apart.
The tied output projection is not stored (it is the embedding). The tokenizer (tokenizer.json,
tokenizer_config.json with the chat template: model/text_tokenizer.py) and generation_config.json
are written by the importers.

Importing this module does not import torch; saving and loading do, lazily.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnserve.model.checkpoint import (
    CONFIG_NAME,
    FORMAT_VERSION,
    METADATA_NAME,
    WEIGHTS_NAME,
    ModelFileInvalidError,
    load_state_dict,
    load_weights,
    read_json_object,
)
from attnserve.model.decoder_config import FAMILIES, DecoderConfig

if TYPE_CHECKING:
    import torch

    from attnserve.model.decoder_only import DecoderOnly

logger = logging.getLogger(__name__)

ENCODER_DECODER = "encoder-decoder"


def directory_family(directory: str | Path) -> str:
    """The decoder-only family named by config.json's "family" key, else "encoder-decoder"."""
    directory = Path(directory)
    data = read_json_object(directory, CONFIG_NAME)
    family = data.get("family")
    if family is None:
        return ENCODER_DECODER
    if family not in FAMILIES:
        raise ModelFileInvalidError(
            f"{directory / CONFIG_NAME}: unknown family {family!r}; choose from {FAMILIES}"
        )
    return str(family)


def read_decoder_config(directory: str | Path) -> DecoderConfig:
    """The DecoderConfig of a decoder-only model directory (imports no torch)."""
    directory = Path(directory)
    data = read_json_object(directory, CONFIG_NAME)
    if "family" not in data:
        raise ModelFileInvalidError(
            f"{directory / CONFIG_NAME} has no 'family': not a decoder-only model directory"
        )
    try:
        return DecoderConfig.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ModelFileInvalidError(
            f"{directory / CONFIG_NAME} is not a valid DecoderConfig: {exc}"
        ) from exc


def save_decoder_dir(
    model: DecoderOnly, out_dir: str | Path, extra_metadata: dict[str, Any] | None = None
) -> Path:
    """Write config.json, model.safetensors (aliases left out) and metadata.json; returns out."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    skip = model.alias_names()
    tensors = {
        name: t.detach().to("cpu").contiguous()
        for name, t in model.state_dict().items()
        if name not in skip
    }
    model.config.save(out / CONFIG_NAME)
    save_file(
        tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt", "attnserve": FORMAT_VERSION}
    )
    if extra_metadata is not None:
        text = json.dumps(extra_metadata, indent=2, ensure_ascii=False, sort_keys=True)
        (out / METADATA_NAME).write_text(text + "\n", encoding="utf-8")
    n_params = sum(t.numel() for t in tensors.values())
    logger.info("saved decoder-only model (%d parameters) to %s", n_params, out)
    return out


def load_decoder_dir(directory: str | Path, device: str | torch.device = "cpu") -> DecoderOnly:
    """The DecoderOnly (eval mode, on `device`) of a decoder-only model directory."""
    import torch

    from attnserve.model.decoder_only import DecoderOnly

    directory = Path(directory)
    config = read_decoder_config(directory)
    tensors = load_state_dict(directory, device)
    with torch.device(device):
        model = DecoderOnly(config)
    load_weights(model, tensors, model.alias_names(), directory / WEIGHTS_NAME)
    return model.eval()
