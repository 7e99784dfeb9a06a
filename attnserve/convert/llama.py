"""Hugging Face `LlamaForCausalLM` configs and weights -> `DecoderConfig` and `DecoderOnly`.

Never imports transformers. Our parameter names are Hugging Face's without the `model.` prefix,
and Hugging Face stores q/k projections in the rotate-half order our rotary embeddings use, so
the weights are renamed, not permuted (GGUF files store them interleaved: convert/gguf.py undoes
that). Weights are converted to float32. `import_llama` writes the weights and config of a
Hugging Face directory as a model directory, with its tokenizer.json, tokenizer_config.json (chat
template) and generation_config.json.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnserve.model.checkpoint import ModelDirError, read_json_object
from attnserve.model.decoder_checkpoint import save_decoder_dir
from attnserve.model.decoder_config import DecoderConfig
from attnserve.model.decoder_only import DecoderOnly

logger = logging.getLogger(__name__)

# LlamaConfig's defaults (transformers 5.x) for keys a config.json may leave out.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}
# Flags that change the network; the value we can run.
SUPPORTED_FLAGS: dict[str, Any] = {
    "attention_bias": False,
    "mlp_bias": False,
    "rope_interleaved": False,  # nanotron's name for GGUF-style pair order
}
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
_LAYER_PARAMS = tuple(
    f"{part}.weight"
    for part in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    )
)
# Old checkpoints store the rotary table; we compute it from rope_theta.
_IGNORED_LAYER_PARAMS = ("self_attn.rotary_emb.inv_freq",)


class LlamaImportError(ModelDirError, ValueError):
    """The Hugging Face config or weights hold something we cannot run faithfully."""


def _rope_theta(hf: dict[str, Any], problems: list[str]) -> float:
    """rope_theta from transformers 5's `rope_parameters` or the older top-level keys."""
    params = hf.get("rope_parameters")
    if params is None:
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", HF_DEFAULTS["rope_theta"]))
    if not isinstance(params, dict):
        problems.append(f"rope_parameters {params!r} is not an object")
        return float(HF_DEFAULTS["rope_theta"])
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        problems.append(f"rope_type {rope_type!r} (only plain rotary embeddings are supported)")
    return float(params.get("rope_theta", HF_DEFAULTS["rope_theta"]))


def _eos_ids(value: Any, problems: list[str]) -> tuple[int, ...]:
    if value is None:
        problems.append("eos_token_id must be set")
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(int(v) for v in values)


def llama_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    """Map a LlamaConfig dict (config.json) to DecoderConfig; LlamaImportError for the rest.

    A missing pad_token_id becomes the first eos id, as in Hugging Face's `generate()`.
    """
    problems: list[str] = []
    model_type = hf.get("model_type", "llama")
    if model_type != "llama":
        problems.append(f"model_type is {model_type!r}, not 'llama'")
    architectures = hf.get("architectures") or ["LlamaForCausalLM"]
    if "LlamaForCausalLM" not in architectures:
        problems.append(f"architectures {architectures} do not include LlamaForCausalLM")

    def get(key: str) -> Any:
        value = hf.get(key)
        return HF_DEFAULTS.get(key) if value is None else value

    for name, supported in SUPPORTED_FLAGS.items():
        value = hf.get(name)
        if value is not None and value != supported:
            problems.append(f"{name}={value!r} (only {supported!r} is supported)")
    if get("hidden_act") not in ("silu", "swish"):
        problems.append(f"hidden_act {get('hidden_act')!r} (only silu is supported)")
    rope_theta = _rope_theta(hf, problems)
    eos_ids = _eos_ids(hf.get("eos_token_id", HF_DEFAULTS["eos_token_id"]), problems)
    if problems:
        raise LlamaImportError("unsupported Llama model: " + "; ".join(problems))

    num_heads = int(get("num_attention_heads"))
    hidden_size = int(get("hidden_size"))
    pad = hf.get("pad_token_id")
    bos = hf.get("bos_token_id", HF_DEFAULTS["bos_token_id"])
    try:
        return DecoderConfig(
            family="llama",
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden_size,
            num_layers=int(get("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
            intermediate_size=int(get("intermediate_size")),
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=rope_theta,
            max_positions=int(get("max_position_embeddings")),
            tie_embeddings=bool(get("tie_word_embeddings")),
            bos_id=None if bos is None else int(bos),
            eos_ids=eos_ids,
            pad_id=eos_ids[0] if pad is None else int(pad),
        )
    except ValueError as exc:
        raise LlamaImportError(f"unsupported Llama config: {exc}") from exc


def _rename(key: str, num_layers: int) -> str | None:
    """model.layers.3.mlp.up_proj.weight -> layers.3.mlp.up_proj.weight (None: not ours)."""
    if key in ("model.embed_tokens.weight", "model.norm.weight"):
        return key.removeprefix("model.")
    match = _LAYER_KEY.fullmatch(key)
    if match is None or int(match.group(1)) >= num_layers or match.group(2) not in _LAYER_PARAMS:
        return None
    return key.removeprefix("model.")


def convert_llama_state_dict(
    hf_state: dict[str, Tensor], config: DecoderConfig
) -> dict[str, Tensor]:
    """HF LlamaForCausalLM tensors -> DecoderOnly's state dict (float32, tied head not repeated)."""
    ours: dict[str, Tensor] = {}
    unexpected = []
    for key, tensor in hf_state.items():
        name = _rename(key, config.num_layers)
        if name is not None:
            ours[name] = tensor
        elif key != "lm_head.weight" and not key.endswith(_IGNORED_LAYER_PARAMS):
            unexpected.append(key)
    if unexpected:
        raise LlamaImportError(f"unsupported weights in the checkpoint: {sorted(unexpected)[:10]}")

    head = hf_state.get("lm_head.weight")
    if not config.tie_embeddings:
        if head is None:
            raise LlamaImportError("tie_word_embeddings is false but there is no lm_head.weight")
        ours["lm_head.weight"] = head
    elif head is not None and not torch.equal(head, ours.get("embed_tokens.weight", head)):
        logger.warning("tie_word_embeddings: ignoring an lm_head.weight that differs (HF does)")
    return {name: t.float() if t.is_floating_point() else t for name, t in ours.items()}


def build_llama(config: DecoderConfig, state: dict[str, Tensor]) -> DecoderOnly:
    """A DecoderOnly (eval mode) holding converted weights; LlamaImportError on any mismatch."""
    model = DecoderOnly(config)
    expected = {k: t for k, t in model.state_dict().items() if k not in model.alias_names()}
    missing = sorted(set(expected) - set(state))
    if missing:
        raise LlamaImportError(f"the checkpoint lacks {missing[:10]}")
    for name, tensor in state.items():
        if name not in expected:
            raise LlamaImportError(f"{name} is not a parameter of the model")
        if tensor.shape != expected[name].shape:
            raise LlamaImportError(
                f"{name}: shape {tuple(tensor.shape)} in the checkpoint, "
                f"{tuple(expected[name].shape)} from config.json"
            )
    model.load_state_dict(state, strict=False)  # the tied head is the embedding Parameter
    return model.eval()


def import_llama(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """A Hugging Face LlamaForCausalLM directory -> a decoder-only model directory."""
    from attnserve.convert.marian import load_hf_state_dict  # the shared HF weight reader

    hf_dir = Path(hf_dir)
    config = llama_config_from_hf(read_json_object(hf_dir, "config.json"))
    model = build_llama(config, convert_llama_state_dict(load_hf_state_dict(hf_dir), config))
    out = save_decoder_dir(model, out_dir, {"source": str(hf_dir), "format": "huggingface"})
    copy_tokenizer_files(hf_dir, out)
    return out


# The tokenizer and generation files of a Hugging Face directory that a model directory keeps.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def copy_tokenizer_files(hf_dir: Path, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template of chat_template.jinja
    folded in, where transformers 5 keeps it apart) and generation_config.json, when present."""
    import json
    import shutil

    for name in TOKENIZER_FILES:
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, out / name)
    template = hf_dir / "chat_template.jinja"
    config_path = out / "tokenizer_config.json"
    if template.is_file():
        config = read_json_object(out, "tokenizer_config.json") if config_path.is_file() else {}
        config.setdefault("chat_template", template.read_text(encoding="utf-8"))
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", "utf-8")
