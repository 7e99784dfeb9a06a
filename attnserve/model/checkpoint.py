"""The model directory: config.json, model.safetensors, tokenizer files, metadata.json.

Layout of ``checkpoints/<name>/``:

* ``config.json`` - ``ModelConfig.to_dict()``.
* ``model.safetensors`` - the state dict, each tensor once: ``tgt_embed.weight`` is left out when
  the embeddings are shared and ``lm_head.weight`` when the output is tied (both are restored
  by building the model from its config). The sinusoidal table is not stored.
* ``tokenizer.json`` + the spm / vocab files it names (see ``attnserve.model.tokenizer``).
* ``metadata.json`` - optional free-form JSON (provenance, generation defaults).

Importing this module does not import torch; `save_model_dir` / `load_model_dir` do, lazily, so
the service can call `read_model_config` / `read_metadata` without it.
"""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnserve.model.config import ModelConfig
from attnserve.model.tokenizer import CONFIG_NAME as TOKENIZER_CONFIG_NAME
from attnserve.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

    from attnserve.model.transformer import EncoderDecoder

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
METADATA_NAME = "metadata.json"
FORMAT_VERSION = "1"


class ModelDirError(Exception):
    """A model directory that cannot be used (base class)."""


class ModelFileMissingError(ModelDirError, FileNotFoundError):
    """A file the model directory needs is not there."""

    def __init__(self, name: str, directory: Path, detail: str = "") -> None:
        self.message = f"model directory {directory} has no {name}{detail}"
        super().__init__(errno.ENOENT, self.message, str(directory / name))
        self.directory = directory

    def __str__(self) -> str:
        return self.message


class ModelFileInvalidError(ModelDirError, ValueError):
    """A file of the model directory is corrupt or disagrees with the rest."""


def _require(directory: Path, name: str) -> Path:
    if not directory.is_dir():
        raise ModelFileMissingError(name, directory, " (the directory does not exist)")
    path = directory / name
    if not path.is_file():
        raise ModelFileMissingError(name, directory)
    return path


def read_json_object(directory: Path, name: str, *, required: bool = True) -> dict[str, Any]:
    """The JSON object in file `name` of `directory` ({} when optional and absent); a clear
    ModelFileMissingError / ModelFileInvalidError otherwise. Imports no torch: the engine, the
    exporter and the Marian importer all read their JSON files through it."""
    if not required and not (directory / name).is_file():
        return {}
    path = _require(directory, name)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFileInvalidError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelFileInvalidError(f"{path} must hold a JSON object")
    return data


def read_model_config(directory: str | Path) -> ModelConfig:
    """The ModelConfig of a model directory (imports neither torch nor the model)."""
    directory = Path(directory)
    data = read_json_object(directory, CONFIG_NAME)
    if "family" in data:  # see attnserve.model.decoder_checkpoint
        raise ModelFileInvalidError(
            f"{directory} is a decoder-only ({data['family']}) model directory, "
            "not an encoder-decoder one"
        )
    try:
        return ModelConfig.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ModelFileInvalidError(
            f"{directory / CONFIG_NAME} is not a valid ModelConfig: {exc}"
        ) from exc


def read_metadata(directory: str | Path) -> dict[str, Any]:
    """metadata.json of a model directory ({} when there is none)."""
    return read_json_object(Path(directory), METADATA_NAME, required=False)


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer of a model directory, checked against its config."""
    directory = Path(directory)
    _require(directory, TOKENIZER_CONFIG_NAME)
    try:
        tokenizer = Tokenizer.load(directory)
    except FileNotFoundError as exc:
        missing = Path(exc.filename).name if exc.filename else str(exc)
        raise ModelFileMissingError(
            missing, directory, f" (named by {TOKENIZER_CONFIG_NAME})"
        ) from exc
    except (ValueError, RuntimeError, OSError) as exc:  # RuntimeError: a corrupt spm model
        raise ModelFileInvalidError(f"tokenizer in {directory}: {exc}") from exc
    check_tokenizer(read_model_config(directory), tokenizer, directory)
    return tokenizer


def check_tokenizer(config: ModelConfig, tokenizer: Tokenizer, where: str | Path = "") -> None:
    """Raise ModelFileInvalidError unless the tokenizer's ids fit the model."""
    problems = []
    for role in ("pad", "eos", "unk"):
        ours, theirs = getattr(config, f"{role}_id"), getattr(tokenizer, f"{role}_id")
        if ours != theirs:
            problems.append(f"{role}_id: config {ours}, tokenizer {theirs}")
    max_source, max_target = tokenizer.max_ids
    if max_source >= config.vocab_size or max_target >= config.target_vocab_size:
        problems.append(
            f"tokenizer ids reach {max_source} / {max_target} (source / target) but the "
            f"vocabularies have {config.vocab_size} / {config.target_vocab_size} entries"
        )
    if problems:
        raise ModelFileInvalidError(
            f"tokenizer and config disagree {where}: " + "; ".join(problems)
        )


def alias_names(config: ModelConfig) -> set[str]:
    """State-dict names that repeat another tensor (not stored)."""
    names = set()
    if config.shared_embeddings:
        names.add("tgt_embed.weight")
    if config.tied_output:
        names.add("lm_head.weight")
    return names


def save_model_dir(
    model: EncoderDecoder,
    tokenizer: Tokenizer,
    out_dir: str | Path,
    extra_metadata: dict[str, Any] | None = None,
) -> Path:
    """Write a model directory (see the module docstring); returns its path."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    config = model.config
    check_tokenizer(config, tokenizer, "(refusing to save)")
    out.mkdir(parents=True, exist_ok=True)
    skip = alias_names(config)
    tensors = {
        name: t.detach().to("cpu").contiguous()
        for name, t in model.state_dict().items()
        if name not in skip
    }
    config.save(out / CONFIG_NAME)
    save_file(
        tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt", "attnserve": FORMAT_VERSION}
    )
    tokenizer.save(out)
    if extra_metadata is not None:
        text = json.dumps(extra_metadata, indent=2, ensure_ascii=False, sort_keys=True)
        (out / METADATA_NAME).write_text(text + "\n", encoding="utf-8")
    n_params = sum(t.numel() for t in tensors.values())
    logger.info("saved model (%d parameters) to %s", n_params, out)
    return out


def load_state_dict(
    directory: str | Path, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """The tensors of model.safetensors (aliases not included)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = _require(Path(directory), WEIGHTS_NAME)
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError) as exc:
        raise ModelFileInvalidError(f"{path} is not a readable safetensors file: {exc}") from exc


def load_weights(
    model: torch.nn.Module, tensors: dict[str, torch.Tensor], aliases: set[str], path: Path
) -> None:
    """Load `tensors` (the model's parameters less `aliases`, the tied copies) into `model`, or
    ModelFileInvalidError naming what is missing, unexpected or of the wrong shape."""
    expected = {name: t for name, t in model.state_dict().items() if name not in aliases}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ModelFileInvalidError(
            f"{path} does not match config.json: "
            f"missing {missing or 'nothing'}, unexpected {unexpected or 'nothing'}"
        )
    for name, tensor in tensors.items():
        if tensor.shape != expected[name].shape:
            raise ModelFileInvalidError(
                f"{path}: {name} has shape {tuple(tensor.shape)}, "
                f"config.json implies {tuple(expected[name].shape)}"
            )
    model.load_state_dict(tensors, strict=False)  # aliases are the same Parameter objects


def load_model_dir(
    directory: str | Path, device: str | torch.device = "cpu"
) -> tuple[EncoderDecoder, Tokenizer]:
    """Read a model directory: the model (eval mode, on `device`) and its tokenizer."""
    import torch

    from attnserve.model.transformer import EncoderDecoder

    directory = Path(directory)
    config = read_model_config(directory)
    tokenizer = load_tokenizer(directory)
    tensors = load_state_dict(directory, device)
    with torch.device(device):
        model = EncoderDecoder(config)
    load_weights(model, tensors, alias_names(config), directory / WEIGHTS_NAME)
    model.eval()
    logger.info("loaded %s (%d parameters) on %s", directory, model.num_parameters(), device)
    return model, tokenizer
