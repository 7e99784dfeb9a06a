"""Import a Hugging Face MarianMTModel directory (OPUS-MT) into our model directory format.

Reads config.json, the weights (model.safetensors or pytorch_model.bin, sharded or not),
source.spm, target.spm, vocab.json [, target_vocab.json], tokenizer_config.json and
generation_config.json when present. Never imports transformers: the semantics reproduced here
are those of ``transformers.models.marian`` (post-LN, sinusoidal positions with sin in the first
half of the channels, sqrt(d_model) embedding scale, ``final_logits_bias``, decoder start = pad).
Weights are converted to float32.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnserve.model.checkpoint import (
    ModelDirError,
    ModelFileInvalidError,
    ModelFileMissingError,
    alias_names,
    check_tokenizer,
    read_json_object,
    save_model_dir,
)
from attnserve.model.config import ModelConfig
from attnserve.model.layers import sinusoidal_table
from attnserve.model.tokenizer import Tokenizer
from attnserve.model.transformer import EncoderDecoder

logger = logging.getLogger(__name__)

# MarianConfig's defaults (transformers 5.x) for keys a config.json may leave out.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 58101,
    "decoder_vocab_size": None,
    "max_position_embeddings": 1024,
    "encoder_layers": 12,
    "encoder_ffn_dim": 4096,
    "encoder_attention_heads": 16,
    "decoder_layers": 12,
    "decoder_ffn_dim": 4096,
    "decoder_attention_heads": 16,
    "activation_function": "gelu",
    "d_model": 1024,
    "dropout": 0.1,
    "attention_dropout": 0.0,
    "activation_dropout": 0.0,
    "decoder_start_token_id": 58100,
    "scale_embedding": False,
    "pad_token_id": 58100,
    "eos_token_id": 0,
    "share_encoder_decoder_embeddings": True,
    "tie_word_embeddings": True,
}
ACTIVATIONS = {"swish": "swish", "silu": "swish", "relu": "relu", "gelu": "gelu"}
# Legacy BART-style flags: HF's Marian ignores them, so a checkpoint that sets them was trained
# as a different network than the one HF (and we) would run.
UNSUPPORTED_FLAGS = {
    "normalize_before": (True, "pre-LN (normalize_before=true) is not Marian's post-LN"),
    "normalize_embedding": (True, "an embedding LayerNorm (normalize_embedding=true)"),
    "add_final_layer_norm": (True, "a final LayerNorm (add_final_layer_norm=true)"),
    "static_position_embeddings": (False, "learned positions (static_position_embeddings=false)"),
    "add_bias_logits": (True, "add_bias_logits=true"),
}
# Generation defaults kept in metadata.json (older config.json files carry them too).
GENERATION_KEYS = (
    "num_beams",
    "max_length",
    "max_new_tokens",
    "min_length",
    "bad_words_ids",
    "forced_eos_token_id",
    "forced_bos_token_id",
    "length_penalty",
    "early_stopping",
    "no_repeat_ngram_size",
    "repetition_penalty",
    "renormalize_logits",
    "num_return_sequences",
    "decoder_start_token_id",
    "eos_token_id",
    "pad_token_id",
)
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_LAYER_KEY = re.compile(r"model\.(encoder|decoder)\.layers\.(\d+)\.(.+)")
_LAYER_PARTS = {
    "encoder": ("self_attn", "self_attn_layer_norm", "fc1", "fc2", "final_layer_norm"),
    "decoder": (
        "self_attn",
        "self_attn_layer_norm",
        "encoder_attn",
        "encoder_attn_layer_norm",
        "fc1",
        "fc2",
        "final_layer_norm",
    ),
}
_IGNORED_KEYS = ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight")


class MarianImportError(ModelDirError, ValueError):
    """The Hugging Face directory holds something we cannot import faithfully."""


def read_hf_json(hf_dir: Path, name: str, *, required: bool = True) -> dict[str, Any]:
    """A JSON object file of the HF directory ({} when optional and absent)."""
    return read_json_object(hf_dir, name, required=required)


def marian_model_config(hf: dict[str, Any], tokenizer: Tokenizer) -> ModelConfig:
    """Map a MarianConfig dict to ModelConfig; MarianImportError for what we cannot run."""
    model_type = hf.get("model_type", "marian")
    if model_type != "marian":
        raise MarianImportError(f"model_type is {model_type!r}, not 'marian'")
    architectures = hf.get("architectures") or ["MarianMTModel"]
    if "MarianMTModel" not in architectures:
        raise MarianImportError(f"architectures {architectures} do not include MarianMTModel")

    def get(key: str) -> Any:
        return hf.get(key, HF_DEFAULTS.get(key))

    problems = [
        f"{name}: {reason}"
        for name, (bad, reason) in UNSUPPORTED_FLAGS.items()
        if name in hf and hf[name] == bad
    ]
    for enc, dec in (
        ("encoder_attention_heads", "decoder_attention_heads"),
        ("encoder_ffn_dim", "decoder_ffn_dim"),
    ):
        if get(enc) != get(dec):
            problems.append(f"{enc}={get(enc)} differs from {dec}={get(dec)}")
    activation = ACTIVATIONS.get(str(get("activation_function")))
    if activation is None:
        problems.append(
            f"activation_function {get('activation_function')!r} is not one of "
            f"{sorted(ACTIVATIONS)}"
        )
    if get("d_model") % 2:
        problems.append(f"d_model={get('d_model')} is odd (HF's sinusoid table differs from ours)")
    eos = get("eos_token_id")
    if isinstance(eos, list):
        if len(eos) != 1:
            problems.append(f"several eos_token_id {eos}")
        eos = eos[0] if eos else None
    pad = get("pad_token_id")
    if pad is None or eos is None:
        problems.append("pad_token_id and eos_token_id must be set")
    if problems:
        raise MarianImportError("unsupported Marian model: " + "; ".join(problems))

    shared = bool(get("share_encoder_decoder_embeddings"))
    vocab_size = int(get("vocab_size"))
    decoder_vocab = int(get("decoder_vocab_size") or vocab_size)
    if shared and decoder_vocab != vocab_size:
        logger.warning("shared embeddings: ignoring decoder_vocab_size=%d (HF does)", decoder_vocab)
    start = get("decoder_start_token_id")
    try:
        return ModelConfig(
            vocab_size=vocab_size,
            tgt_vocab_size=None if shared else decoder_vocab,
            d_model=int(get("d_model")),
            n_heads=int(get("encoder_attention_heads")),
            encoder_layers=int(get("encoder_layers")),
            decoder_layers=int(get("decoder_layers")),
            ffn_dim=int(get("encoder_ffn_dim")),
            activation=activation,  # type: ignore[arg-type]
            norm_placement="post",
            scale_embedding=bool(get("scale_embedding")),
            shared_embeddings=shared,
            tied_output=bool(get("tie_word_embeddings")),
            final_logits_bias=True,
            max_positions=int(get("max_position_embeddings")),
            layer_norm_eps=1e-5,
            dropout=float(get("dropout")),
            attention_dropout=float(get("attention_dropout")),
            activation_dropout=float(get("activation_dropout")),
            pad_id=int(pad),
            eos_id=int(eos),
            unk_id=tokenizer.unk_id,
            decoder_start_id=None if start is None or start == pad else int(start),
        )
    except ValueError as exc:
        raise MarianImportError(f"unsupported Marian config: {exc}") from exc


def _load_weight_file(path: Path) -> dict[str, Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ModelFileInvalidError(f"{path} does not hold a state dict")
    return state


def load_hf_state_dict(hf_dir: str | Path) -> dict[str, Tensor]:
    """All tensors of a HF model directory (safetensors preferred, shards followed)."""
    hf_dir = Path(hf_dir)
    for name in WEIGHT_FILES:
        path = hf_dir / name
        if not path.is_file():
            continue
        logger.info("reading %s", path)
        try:
            if not name.endswith(".index.json"):
                return _load_weight_file(path)
            shards = sorted(set(read_hf_json(hf_dir, name).get("weight_map", {}).values()))
            state: dict[str, Tensor] = {}
            for shard in shards:
                if not (hf_dir / shard).is_file():
                    raise ModelFileMissingError(shard, hf_dir, f" (a shard named by {name})")
                state.update(_load_weight_file(hf_dir / shard))
            return state
        except ModelDirError:
            raise
        except Exception as exc:  # safetensors / pickle errors have no common base class
            raise ModelFileInvalidError(f"cannot read weights {path}: {exc}") from exc
    raise ModelFileMissingError(" or ".join(WEIGHT_FILES[::2]), hf_dir)


def _rename_layer_key(key: str) -> str | None:
    """model.encoder.layers.3.fc1.weight -> encoder_layers.3.ffn.fc1.weight (None: not a layer)."""
    match = _LAYER_KEY.fullmatch(key)
    if match is None:
        return None
    stack, index, rest = match.groups()
    part = rest.split(".", 1)[0]
    if part not in _LAYER_PARTS[stack]:
        return None
    if part in ("fc1", "fc2"):
        rest = "ffn." + rest
    return f"{stack}_layers.{index}.{rest}"


def _first(state: dict[str, Tensor], *keys: str) -> Tensor:
    for key in keys:
        if key in state:
            return state[key]
    raise MarianImportError(f"the weights have none of {', '.join(keys)}")


def convert_state_dict(hf_state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """HF MarianMTModel tensors -> our state dict (float32, tied/shared weights once)."""
    ours: dict[str, Tensor] = {}
    unexpected = []
    for key, tensor in hf_state.items():
        name = _rename_layer_key(key)
        if name is not None:
            ours[name] = tensor
        elif key not in (
            *_IGNORED_KEYS,
            "model.shared.weight",
            "model.encoder.embed_tokens.weight",
            "model.decoder.embed_tokens.weight",
            "lm_head.weight",
            "final_logits_bias",
        ):
            unexpected.append(key)
    if unexpected:
        raise MarianImportError(f"unsupported weights in the checkpoint: {sorted(unexpected)[:10]}")

    shared = ("model.shared.weight", "model.encoder.embed_tokens.weight")
    if config.shared_embeddings:
        ours["src_embed.weight"] = _first(hf_state, *shared, "model.decoder.embed_tokens.weight")
    else:
        ours["src_embed.weight"] = _first(hf_state, *shared)
        ours["tgt_embed.weight"] = _first(hf_state, "model.decoder.embed_tokens.weight")
    target_embed = ours["src_embed.weight" if config.shared_embeddings else "tgt_embed.weight"]
    if not config.tied_output:
        ours["lm_head.weight"] = _first(hf_state, "lm_head.weight")
    elif "lm_head.weight" in hf_state and not torch.equal(hf_state["lm_head.weight"], target_embed):
        logger.warning("tie_word_embeddings: ignoring an lm_head.weight that differs (HF does)")
    bias = hf_state.get("final_logits_bias")
    ours["logits_bias"] = (
        bias.reshape(-1) if bias is not None else torch.zeros(config.target_vocab_size)
    )

    for key in _IGNORED_KEYS:  # stored by old checkpoints; must be the fixed sinusoid table
        if key in hf_state:
            table = hf_state[key].float()
            expected = sinusoidal_table(table.shape[0], config.d_model)
            if table.shape != expected.shape or not torch.allclose(table, expected, atol=1e-4):
                raise MarianImportError(f"{key} is not the sinusoidal table (learned positions?)")
    return {name: t.float() if t.is_floating_point() else t for name, t in ours.items()}


def generation_defaults(hf_dir: Path, hf_config: dict[str, Any]) -> dict[str, Any]:
    """Decoding defaults: legacy keys of config.json, overridden by generation_config.json."""
    generation = {k: hf_config[k] for k in GENERATION_KEYS if k in hf_config}
    for key, value in read_hf_json(hf_dir, "generation_config.json", required=False).items():
        if not key.startswith(("_", "output_")) and key not in (
            "transformers_version",
            "use_cache",
        ):
            generation[key] = value
    return generation


def convert_marian(hf_dir: str | Path) -> tuple[EncoderDecoder, Tokenizer, dict[str, Any]]:
    """Build our model, tokenizer and metadata from a HF Marian directory (in memory)."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ModelFileMissingError("config.json", hf_dir, " (the directory does not exist)")
    hf_config = read_hf_json(hf_dir, "config.json")
    try:
        tokenizer = Tokenizer.from_marian(hf_dir)
    except FileNotFoundError as exc:
        raise ModelFileMissingError(Path(exc.filename or str(exc)).name, hf_dir) from exc
    except (ValueError, RuntimeError) as exc:
        raise ModelFileInvalidError(f"tokenizer files in {hf_dir}: {exc}") from exc
    config = marian_model_config(hf_config, tokenizer)
    try:
        check_tokenizer(config, tokenizer, f"in {hf_dir}")
    except ModelFileInvalidError as exc:
        raise MarianImportError(str(exc)) from exc

    state = convert_state_dict(load_hf_state_dict(hf_dir), config)
    model = EncoderDecoder(config)
    expected = model.state_dict()
    missing = sorted(k for k in expected if k not in state and k not in alias_names(config))
    if missing:
        raise MarianImportError(f"the checkpoint lacks {missing[:10]}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise MarianImportError(
                f"{name}: shape {tuple(tensor.shape)} in the checkpoint, "
                f"{tuple(expected[name].shape)} from config.json"
            )
    model.load_state_dict(state, strict=False)
    model.eval()

    metadata = {
        "source": {
            "format": "huggingface-marian",
            "path": str(hf_dir.resolve()),
            "architectures": hf_config.get("architectures"),
            "transformers_version": hf_config.get("transformers_version"),
        },
        "languages": {
            "source": tokenizer.source_lang,
            "target": tokenizer.target_lang,
            "target_tags": tokenizer.language_tags,
        },
        "generation": generation_defaults(hf_dir, hf_config),
    }
    return model, tokenizer, metadata


def import_marian(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Convert a HF MarianMTModel directory into a model directory at `out_dir`."""
    model, tokenizer, metadata = convert_marian(hf_dir)
    logger.info(
        "imported Marian %s: %d parameters, vocab %d/%d, tags %s",
        hf_dir,
        model.num_parameters(),
        model.config.vocab_size,
        model.config.target_vocab_size,
        tokenizer.language_tags,
    )
    return save_model_dir(model, tokenizer, out_dir, extra_metadata=metadata)
