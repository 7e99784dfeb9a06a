"""Import Hugging Face's ports of fairseq translation models: M2M100 and NLLB (`m2m_100`), mBART
and mBART-50 (`mbart`), BART (`bart`).

The three families share HF's BART code lineage (parameter names, attention, feed-forward) and
differ in switches that `ModelConfig` holds as data:

| model_type | LayerNorm | positions | embedding LayerNorm | final logits bias |
|---|---|---|---|---|
| m2m_100 | pre, final norms | fairseq sinusoids, row pad_id + 1 + p | no | no |
| mbart | pre, final norms | learned, row 2 + p | yes | yes |
| bart | post | learned, row 2 + p | yes | yes |

The embedding scale (sqrt(d_model) or 1) and the activation come from config.json. Never imports
transformers; weights are converted to float32.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from torch import Tensor

from attnserve.convert.marian import (
    ACTIVATIONS,
    _rename_layer_key,
    generation_defaults,
    load_hf_state_dict,
    read_hf_json,
)
from attnserve.model.checkpoint import (
    ModelDirError,
    ModelFileInvalidError,
    ModelFileMissingError,
    alias_names,
    check_tokenizer,
    save_model_dir,
)
from attnserve.model.config import ModelConfig
from attnserve.model.tokenizer import Tokenizer
from attnserve.model.transformer import EncoderDecoder

logger = logging.getLogger(__name__)

FAMILIES = ("m2m_100", "mbart", "bart")
ARCHITECTURES = {
    "m2m_100": "M2M100ForConditionalGeneration",
    "mbart": "MBartForConditionalGeneration",
    "bart": "BartForConditionalGeneration",
}
# The families' config classes' defaults (transformers 5.x) for keys a config.json may leave out.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "m2m_100": {
        "vocab_size": 128112, "max_position_embeddings": 1024, "encoder_layers": 12,
        "encoder_ffn_dim": 4096, "encoder_attention_heads": 16, "decoder_layers": 12,
        "decoder_ffn_dim": 4096, "decoder_attention_heads": 16, "activation_function": "relu",
        "d_model": 1024, "dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.0,
        "scale_embedding": True, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
        "decoder_start_token_id": 2, "tie_word_embeddings": True,
    },
    "mbart": {
        "vocab_size": 50265, "max_position_embeddings": 1024, "encoder_layers": 12,
        "encoder_ffn_dim": 4096, "encoder_attention_heads": 16, "decoder_layers": 12,
        "decoder_ffn_dim": 4096, "decoder_attention_heads": 16, "activation_function": "gelu",
        "d_model": 1024, "dropout": 0.1, "attention_dropout": 0.0, "activation_dropout": 0.0,
        "scale_embedding": False, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
        "decoder_start_token_id": None, "tie_word_embeddings": True,
    },
    "bart": {
        "vocab_size": 50265, "max_position_embeddings": 1024, "encoder_layers": 12,
        "encoder_ffn_dim": 4096, "encoder_attention_heads": 16, "decoder_layers": 12,
        "decoder_ffn_dim": 4096, "decoder_attention_heads": 16, "activation_function": "gelu",
        "d_model": 1024, "dropout": 0.1, "attention_dropout": 0.0, "activation_dropout": 0.0,
        "scale_embedding": False, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
        "decoder_start_token_id": 2, "tie_word_embeddings": True,
    },
}  # fmt: skip
LEARNED_OFFSET = 2  # BartLearnedPositionalEmbedding's
# HF names outside the layers -> ours (per family; `None`: read elsewhere or ignored).
_TOP_LEVEL = {
    "model.encoder.layer_norm.weight": "encoder_norm.weight",
    "model.encoder.layer_norm.bias": "encoder_norm.bias",
    "model.decoder.layer_norm.weight": "decoder_norm.weight",
    "model.decoder.layer_norm.bias": "decoder_norm.bias",
    "model.encoder.layernorm_embedding.weight": "src_input_norm.weight",
    "model.encoder.layernorm_embedding.bias": "src_input_norm.bias",
    "model.decoder.layernorm_embedding.weight": "tgt_input_norm.weight",
    "model.decoder.layernorm_embedding.bias": "tgt_input_norm.bias",
    "model.encoder.embed_positions.weight": "src_positions.weight",
    "model.decoder.embed_positions.weight": "tgt_positions.weight",
}
_EMBEDDINGS = (
    "model.shared.weight",
    "model.encoder.embed_tokens.weight",
    "model.decoder.embed_tokens.weight",
    "lm_head.weight",
    "final_logits_bias",
)
_SINUSOID_BUFFERS = re.compile(
    r"model\.(encoder|decoder)\.embed_positions\.(weights|_float_tensor)"
)


class FairseqImportError(ModelDirError, ValueError):
    """The Hugging Face directory holds something we cannot import faithfully."""


def family_model_config(hf: dict[str, Any], unk_id: int) -> ModelConfig:
    """Map an M2M100Config / MBartConfig / BartConfig dict to ModelConfig."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise FairseqImportError(f"model_type {family!r} is not one of {', '.join(FAMILIES)}")
    defaults = HF_DEFAULTS[family]

    def get(key: str) -> Any:
        return hf.get(key, defaults.get(key))

    problems = []
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
    eos, pad = get("eos_token_id"), get("pad_token_id")
    if isinstance(eos, list):
        eos = eos[0] if len(eos) == 1 else None
    if pad is None or eos is None:
        problems.append("pad_token_id and a single eos_token_id must be set")
    if family == "m2m_100" and int(get("d_model")) // 2 < 2:
        problems.append(f"d_model={get('d_model')} is too small for fairseq's sinusoids")
    if not get("tie_word_embeddings") and family != "bart":
        problems.append("an untied output projection (tie_word_embeddings=false)")
    if problems:
        raise FairseqImportError(f"unsupported {family} model: " + "; ".join(problems))
    start = get("decoder_start_token_id")
    pre = family in ("m2m_100", "mbart")
    try:
        return ModelConfig(
            vocab_size=int(get("vocab_size")),
            d_model=int(get("d_model")),
            n_heads=int(get("encoder_attention_heads")),
            encoder_layers=int(get("encoder_layers")),
            decoder_layers=int(get("decoder_layers")),
            ffn_dim=int(get("encoder_ffn_dim")),
            activation=activation,  # type: ignore[arg-type]
            norm_placement="pre" if pre else "post",
            scale_embedding=bool(get("scale_embedding")),
            shared_embeddings=True,
            tied_output=bool(get("tie_word_embeddings")),
            final_logits_bias=family != "m2m_100",
            positions="sinusoidal_fairseq" if family == "m2m_100" else "learned",
            position_offset=int(pad) + 1 if family == "m2m_100" else LEARNED_OFFSET,
            layernorm_embedding=family != "m2m_100",
            max_positions=int(get("max_position_embeddings")),
            layer_norm_eps=1e-5,
            dropout=float(get("dropout")),
            attention_dropout=float(get("attention_dropout")),
            activation_dropout=float(get("activation_dropout")),
            pad_id=int(pad),
            eos_id=int(eos),
            unk_id=unk_id,
            # mBART without one starts from its last target token (the language code): the
            # tokenizer's rule, not a fixed id; an explicit one is kept.
            decoder_start_id=None if start is None else int(start),
        )
    except ValueError as exc:
        raise FairseqImportError(f"unsupported {family} config: {exc}") from exc


def convert_family_state_dict(
    hf_state: dict[str, Tensor], config: ModelConfig
) -> dict[str, Tensor]:
    """HF tensors -> our state dict (float32, tied/shared weights once)."""
    ours: dict[str, Tensor] = {}
    unexpected = []
    for key, tensor in hf_state.items():
        name = _rename_layer_key(key)
        if name is None:
            name = _TOP_LEVEL.get(key)
        if name is not None:
            ours[name] = tensor
        elif key not in _EMBEDDINGS and not _SINUSOID_BUFFERS.fullmatch(key):
            unexpected.append(key)
    if unexpected:
        raise FairseqImportError(
            f"unsupported weights in the checkpoint: {sorted(unexpected)[:10]}"
        )
    embedding = next((hf_state[k] for k in _EMBEDDINGS[:3] if k in hf_state), None)
    if embedding is None:
        raise FairseqImportError(f"the weights have none of {', '.join(_EMBEDDINGS[:3])}")
    ours["src_embed.weight"] = embedding
    if not config.tied_output:
        if "lm_head.weight" not in hf_state:
            raise FairseqImportError("tie_word_embeddings is false but there is no lm_head.weight")
        ours["lm_head.weight"] = hf_state["lm_head.weight"]
    if config.final_logits_bias:
        bias = hf_state.get("final_logits_bias")
        ours["logits_bias"] = (
            bias.reshape(-1) if bias is not None else embedding.new_zeros(config.target_vocab_size)
        )
    return {name: t.float() if t.is_floating_point() else t for name, t in ours.items()}


def build_family_model(hf_dir: Path, hf_config: dict[str, Any], unk_id: int) -> EncoderDecoder:
    """Our model with the directory's weights (shapes checked against config.json)."""
    config = family_model_config(hf_config, unk_id)
    state = convert_family_state_dict(load_hf_state_dict(hf_dir), config)
    model = EncoderDecoder(config)
    expected = model.state_dict()
    missing = sorted(k for k in expected if k not in state and k not in alias_names(config))
    if missing:
        raise FairseqImportError(f"the checkpoint lacks {missing[:10]}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise FairseqImportError(
                f"{name}: shape {tuple(tensor.shape)} in the checkpoint, "
                f"{tuple(expected[name].shape)} from config.json"
            )
    model.load_state_dict(state, strict=False)
    return model.eval()


def read_family_config(hf_dir: str | Path) -> dict[str, Any]:
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ModelFileMissingError("config.json", hf_dir, " (the directory does not exist)")
    return read_hf_json(hf_dir, "config.json")


def family_metadata(hf_dir: Path, hf_config: dict[str, Any]) -> dict[str, Any]:
    """metadata.json's source and generation sections."""
    return {
        "source": {
            "format": f"huggingface-{hf_config.get('model_type')}",
            "path": str(hf_dir.resolve()),
            "architectures": hf_config.get("architectures"),
            "transformers_version": hf_config.get("transformers_version"),
        },
        "generation": generation_defaults(hf_dir, hf_config),
    }


def convert_family(hf_dir: str | Path) -> tuple[EncoderDecoder, Tokenizer, dict[str, Any]]:
    """Our model, tokenizer and metadata from an M2M100 / NLLB / mBART directory (in memory)."""
    hf_dir = Path(hf_dir)
    hf_config = read_family_config(hf_dir)
    family = hf_config.get("model_type")
    tokenizer_class = str(
        read_hf_json(hf_dir, "tokenizer_config.json", required=False).get("tokenizer_class", "")
    )
    if family == "mbart" and not tokenizer_class.startswith("MBart50"):
        raise FairseqImportError(
            f"{hf_dir}: {tokenizer_class or 'this mBART tokenizer'} puts the language code after "
            "the source and starts the decoder with the target's; mBART-50 directories "
            "(MBart50Tokenizer) are supported"
        )
    try:
        if family == "bart":  # byte-level BPE: its tokenizer.json, <s> ... </s>
            tokenizer = Tokenizer.from_hf_json(hf_dir)
        else:
            tokenizer = Tokenizer.from_fairseq(hf_dir)
    except FileNotFoundError as exc:
        raise ModelFileMissingError(Path(exc.filename or str(exc)).name, hf_dir) from exc
    except (ValueError, RuntimeError) as exc:
        raise ModelFileInvalidError(f"tokenizer files in {hf_dir}: {exc}") from exc
    model = build_family_model(hf_dir, hf_config, tokenizer.unk_id)
    try:
        check_tokenizer(model.config, tokenizer, f"in {hf_dir}")
    except ModelFileInvalidError as exc:
        raise FairseqImportError(str(exc)) from exc
    metadata = family_metadata(hf_dir, hf_config)
    metadata["languages"] = {
        "source": tokenizer.source_lang,
        "target": tokenizer.target_lang,
        "target_tags": tokenizer.language_tags,
    }
    return model, tokenizer, metadata


def import_family(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Convert a HF M2M100 / NLLB / mBART directory into a model directory at `out_dir`."""
    model, tokenizer, metadata = convert_family(hf_dir)
    logger.info(
        "imported %s %s: %d parameters, vocab %d, %d languages",
        metadata["source"]["format"],
        hf_dir,
        model.num_parameters(),
        model.config.vocab_size,
        len(tokenizer.languages),
    )
    return save_model_dir(model, tokenizer, out_dir, extra_metadata=metadata)
