"""Hugging Face decoder-only directories (Llama, Mistral, Qwen2/2.5, Qwen3, Phi-3/3.5/4-mini,
Gemma 2, Gemma 3 text) -> `DecoderOnly`.

One importer for every family built on Llama's blocks: `FAMILIES` says, per config.json
`model_type`, what its architecture fixes (q/k/v and output biases, per-head q/k norms, partial
rotation, old rope_type names, Gemma's norms and scaled embeddings) and the defaults of its
config class, and `decoder_config_from_hf` reads the rest with the families' own config names
(rope_parameters / rope_scaling, per layer type for Gemma 3 or its older rope_local_base_freq;
partial_rotary_factor, original_max_position_embeddings; sliding_window / use_sliding_window /
layer_types / sliding_window_pattern; head_dim; hidden_act or Gemma's hidden_activation;
query_pre_attn_scalar and the soft caps) into `DecoderConfig`'s switches. Never imports
transformers. Our parameter names are Hugging Face's without the `model.` prefix, and Hugging
Face stores q/k projections in the rotate-half order our rotary embeddings use, so the weights
are renamed, not permuted (GGUF files store them interleaved: convert/gguf.py undoes that);
Phi-3's fused `qkv_proj` and `gate_up_proj` are split into the projections they stack
(`split_fused`), and Gemma's norm weights keep Gemma's meaning (the norm multiplies by 1 + w). A
dynamic NTK model's context becomes `factor` times its max_position_embeddings (what the scaling
is for); NTK's reference length stays the latter. Weights are converted to float32.
`import_hf_decoder` writes the weights and config of a Hugging Face directory as a model
directory, with its tokenizer.json, tokenizer_config.json (chat template) and
generation_config.json, whose eos_token_id joins the model's stop tokens. A multimodal checkpoint
whose language model is one of these (`MULTIMODAL`: Gemma 3 4B and larger) imports as that
text model: its text_config is the config, its language model's weights the weights, the vision
tower and projector are left out.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnserve.model.checkpoint import ModelDirError, read_json_object
from attnserve.model.decoder_checkpoint import save_decoder_dir
from attnserve.model.decoder_config import ROPE_SCALING_KEYS, Activation, DecoderConfig
from attnserve.model.decoder_only import DecoderOnly

logger = logging.getLogger(__name__)

# LlamaConfig's defaults (transformers 5.x) for keys a config.json may leave out; a family's
# own defaults (Family.defaults) replace them.
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
    "attention_bias": False,
}


@dataclass(frozen=True)
class Family:
    """What a model_type's architecture fixes. A bias switch is True or False when the
    architecture fixes it, or the name of the config key that sets it."""

    architecture: str
    qkv_bias: bool | str = "attention_bias"
    out_bias: bool | str = "attention_bias"
    qk_norm: bool = False
    # the config class's defaults where they differ from LlamaConfig's (HF_DEFAULTS)
    defaults: dict[str, Any] = field(default_factory=dict)
    # older rope_type names the config class reads as another (Phi-3's "su" and "yarn")
    rope_aliases: dict[str, str] = field(default_factory=dict)
    # partial_rotary_factor is honoured (the attention rotates only that share of a head)
    partial_rotary: bool = False
    # the config key naming the MLP's activation (Gemma: hidden_activation)
    activation_key: str = "hidden_act"
    # other DecoderConfig switches the architecture fixes (Gemma's norms and embeddings)
    switches: dict[str, Any] = field(default_factory=dict)
    # without layer_types: every `window_pattern`-th layer attends to the whole context, the
    # others through the window (a config's sliding_window_pattern replaces it); None: all
    # layers are windowed (Mistral)
    window_pattern: int | None = None
    # the rotary base of the sliding-window layers when rope_parameters is not per layer type
    # (an older config's rope_local_base_freq, else this default); None: as the other layers
    local_rope_theta: float | None = None


_QWEN_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "intermediate_size": 22016,
    "max_position_embeddings": 32768,
    "bos_token_id": None,
    "eos_token_id": None,
}
# Gemma2Config's and Gemma3TextConfig's shared defaults (the 2B / 1B shapes)
_GEMMA_DEFAULTS: dict[str, Any] = {
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}
_GEMMA_SWITCHES: dict[str, Any] = {
    "norm_unit_offset": True,
    "sandwich_norms": True,
    "scale_embeddings": True,
}
FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM"),
    "mistral": Family(
        "MistralForCausalLM",
        qkv_bias=False,
        out_bias=False,
        defaults={
            "intermediate_size": 14336,
            "max_position_embeddings": 131072,
            "num_key_value_heads": 8,
            "sliding_window": 4096,
        },
    ),
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True, out_bias=False, defaults=_QWEN_DEFAULTS),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True, defaults={**_QWEN_DEFAULTS, "head_dim": 128}),
    # fused qkv_proj and gate_up_proj, split at import (FUSED)
    "phi3": Family(
        "Phi3ForCausalLM",
        qkv_bias=False,
        out_bias=False,
        defaults={
            "vocab_size": 32064,
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "max_position_embeddings": 4096,
            "original_max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "eos_token_id": 32000,
            "sliding_window": None,
        },
        rope_aliases={"su": "longrope", "yarn": "longrope"},
        partial_rotary=True,
    ),
    "gemma2": Family(
        "Gemma2ForCausalLM",
        defaults={
            **_GEMMA_DEFAULTS,
            "vocab_size": 256000,
            "max_position_embeddings": 8192,
            "rope_theta": 10000.0,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
        activation_key="hidden_activation",
        switches=_GEMMA_SWITCHES,
        window_pattern=2,
    ),
    "gemma3_text": Family(
        "Gemma3ForCausalLM",
        qk_norm=True,
        defaults={
            **_GEMMA_DEFAULTS,
            "vocab_size": 262208,
            "max_position_embeddings": 131072,
            "rope_theta": 1_000_000.0,
            "sliding_window_pattern": 6,
        },
        activation_key="hidden_activation",
        switches=_GEMMA_SWITCHES,
        window_pattern=6,
        local_rope_theta=10_000.0,
    ),
}
# Flags that change the network; the value we can run.
SUPPORTED_FLAGS: dict[str, Any] = {
    "mlp_bias": False,
    "rope_interleaved": False,  # nanotron's name for GGUF-style pair order
    "use_bidirectional_attention": False,  # Gemma's encoder-style variants
}
# hidden_act / hidden_activation -> DecoderConfig.activation
ACTIVATIONS: dict[str, Activation] = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
}
# the layer types of transformers' per-layer-type rope_parameters (Gemma 3)
_LAYER_TYPES = ("full_attention", "sliding_attention")
# model_type of a multimodal checkpoint -> (its architecture, its language model's model_type)
MULTIMODAL: dict[str, tuple[str, str]] = {
    "gemma3": ("Gemma3ForConditionalGeneration", "gemma3_text"),
}
# a multimodal checkpoint's language model weights -> the text model's names (transformers 5's
# layout, and the one its save_pretrained and 4.5x write)
_LANGUAGE_MODEL_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
)
# top-level keys of a multimodal config that the generation reads (they win over text_config's)
_TOP_LEVEL_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Fused projections (Phi-3) -> ours, their rows in this order: q/k/v by head counts, gate/up
# in halves.
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# Old checkpoints store the rotary table; we compute it from rope_theta.
_IGNORED_LAYER_PARAMS = ("self_attn.rotary_emb.inv_freq",)


class DecoderImportError(ModelDirError, ValueError):
    """The Hugging Face config or weights hold something we cannot run faithfully."""


def _rope(
    hf: dict[str, Any], get: Any, family: Family, head_dim: int, problems: list[str]
) -> tuple[float, dict[str, Any] | None, int | None]:
    """rope_theta, the scaling (None: plain) and the rotated channels of a head (None: all),
    from transformers 5's `rope_parameters` or the older top-level `rope_theta`,
    `rope_scaling` and `partial_rotary_factor`, completed as transformers completes them."""
    params = hf.get("rope_parameters")
    if params is None:
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", get("rope_theta"))
    if not isinstance(params, dict):
        problems.append(f"rope_parameters {params!r} is not an object")
        return float(HF_DEFAULTS["rope_theta"]), None, None
    params = dict(params)
    theta = float(params.pop("rope_theta", None) or get("rope_theta"))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    rope_type = family.rope_aliases.get(rope_type, rope_type)
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor")) or 1.0
    rotary_dim = None if partial == 1.0 else int(head_dim * partial)
    if rotary_dim is not None and not family.partial_rotary:
        problems.append(f"partial_rotary_factor {partial} (only whole heads are rotated)")
    if rope_type == "default":
        return theta, None, rotary_dim
    if rope_type not in ROPE_SCALING_KEYS:
        problems.append(
            f"rope_type {rope_type!r} (supported: default, {', '.join(ROPE_SCALING_KEYS)})"
        )
        return theta, None, rotary_dim
    if rope_type in ("llama3", "yarn", "longrope"):
        # Phi-3's top-level original_max_position_embeddings (its config class has one) wins
        original = hf.get("original_max_position_embeddings")
        if original is None:
            original = family.defaults.get("original_max_position_embeddings")
        if original is not None:
            params["original_max_position_embeddings"] = original
        params.setdefault("original_max_position_embeddings", get("max_position_embeddings"))
    if rope_type == "dynamic":  # NTK's reference length is the context the model was made for
        params["original_max_position_embeddings"] = get("max_position_embeddings")
    if rope_type == "yarn" and params.get("factor") is None:
        params["factor"] = (
            get("max_position_embeddings") / params["original_max_position_embeddings"]
        )
    return theta, {"rope_type": rope_type, **params}, rotary_dim


def _layer_ropes(
    hf: dict[str, Any], get: Any, family: Family, head_dim: int, problems: list[str]
) -> tuple[float, dict[str, Any] | None, int | None, float | None]:
    """rope_theta, the scaling, the rotated channels of a head (`_rope`) and the sliding-window
    layers' own base (None: theirs are the others'). transformers 5 writes Gemma 3's
    rope_parameters per layer type; an older config has rope_theta / rope_scaling for the
    full-attention layers and rope_local_base_freq. Both layer types rotate the same channels."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params and set(params) <= set(_LAYER_TYPES):
        full = params.get("full_attention") or {}
        theta, scaling, rotary_dim = _rope(
            {**hf, "rope_parameters": full}, get, family, head_dim, problems
        )
        sliding = params.get("sliding_attention")
        if sliding is None:
            return theta, scaling, rotary_dim, None
        if "rope_theta" not in sliding and family.local_rope_theta is not None:
            sliding = {**sliding, "rope_theta": family.local_rope_theta}
        local_problems: list[str] = []
        local, local_scaling, local_dim = _rope(
            {**hf, "rope_parameters": sliding}, get, family, head_dim, local_problems
        )
        problems.extend(p for p in local_problems if p not in problems)
        if local_scaling is not None:
            problems.append(
                f"sliding_attention rope_type {local_scaling['rope_type']!r} (the "
                "sliding-window layers' rotary embeddings must be plain)"
            )
        if local_dim != rotary_dim:
            problems.append(
                "sliding_attention partial_rotary_factor differs from full_attention's (both "
                "layer types must rotate the same channels of a head)"
            )
    else:
        theta, scaling, rotary_dim = _rope(hf, get, family, head_dim, problems)
        if family.local_rope_theta is None:
            return theta, scaling, rotary_dim, None
        local = float(hf.get("rope_local_base_freq") or family.local_rope_theta)
    return theta, scaling, rotary_dim, None if (local == theta and scaling is None) else local


def _sliding_window(
    hf: dict[str, Any], get: Any, num_layers: int, pattern: int | None, problems: list[str]
) -> tuple[int | None, tuple[int, ...]]:
    """The window and the layers exempt from it: `layer_types` when the config lists them, else
    Qwen2/3's `use_sliding_window` from layer `max_window_layers` on, else every `pattern`-th
    layer full (Gemma's `sliding_window_pattern`), else `sliding_window` in every layer
    (Mistral)."""
    # an explicit null is no window (Mistral v0.2 on); a missing key the class default
    window = hf["sliding_window"] if "sliding_window" in hf else get("sliding_window")
    layer_types = hf.get("layer_types")
    if layer_types is None and pattern is not None:  # Gemma: layer i is full when (i+1) % n == 0
        n = int(hf.get("sliding_window_pattern") or pattern)
        layer_types = [
            "sliding_attention" if (i + 1) % n else "full_attention" for i in range(num_layers)
        ]
    if layer_types is None and "use_sliding_window" in hf:  # Qwen2 / Qwen3
        if not hf["use_sliding_window"]:
            return None, ()
        first = int(hf.get("max_window_layers") or 0)
        layer_types = [
            "full_attention" if i < first else "sliding_attention" for i in range(num_layers)
        ]
    if window is None:
        return None, ()
    if layer_types is None:
        return int(window), ()
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown or len(layer_types) != num_layers:
        problems.append(
            f"layer_types {layer_types!r} (one full_attention or sliding_attention per layer)"
        )
        return None, ()
    full = tuple(i for i, kind in enumerate(layer_types) if kind == "full_attention")
    return (None, ()) if len(full) == num_layers else (int(window), full)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _eos_ids(value: Any, problems: list[str]) -> tuple[int, ...]:
    if value is None:
        problems.append("eos_token_id must be set")
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(int(v) for v in values)


def decoder_config_from_hf(
    hf: dict[str, Any], generation: dict[str, Any] | None = None
) -> DecoderConfig:
    """Map a config.json of a supported model_type (FAMILIES) to DecoderConfig;
    DecoderImportError for the rest. `generation` (generation_config.json) adds its
    eos_token_id to the stop tokens, as Hugging Face's `generate()` stops on them.

    A missing pad_token_id becomes the first eos id, as in Hugging Face's `generate()`.
    """
    if hf.get("model_type") in MULTIMODAL:
        hf = text_config(hf)
    problems: list[str] = []
    model_type = hf.get("model_type", "llama")
    family = FAMILIES.get(model_type)
    if family is None:
        raise DecoderImportError(
            f"model_type {model_type!r} is not a supported decoder-only family; "
            f"supported: {', '.join(FAMILIES)}"
        )
    architectures = hf.get("architectures") or [family.architecture]
    if family.architecture not in architectures:
        problems.append(f"architectures {architectures} do not include {family.architecture}")
    defaults = {**HF_DEFAULTS, **family.defaults}

    def get(key: str) -> Any:
        value = hf.get(key)
        return defaults.get(key) if value is None else value

    def switch(fixed: bool | str) -> bool:
        return fixed if isinstance(fixed, bool) else bool(get(fixed))

    for name, supported in SUPPORTED_FLAGS.items():
        value = hf.get(name)
        if value is not None and value != supported:
            problems.append(f"{name}={value!r} (only {supported!r} is supported)")
    activation = get(family.activation_key)
    if activation not in ACTIVATIONS:
        problems.append(
            f"{family.activation_key} {activation!r} (supported: {', '.join(ACTIVATIONS)})"
        )

    def explicit(key: str) -> Any:
        """A key whose null means none (a soft cap), the class default when missing."""
        return hf[key] if key in hf else defaults.get(key)

    num_heads = int(get("num_attention_heads"))
    hidden_size = int(get("hidden_size"))
    head_dim = int(get("head_dim") or hidden_size // num_heads)
    rope_theta, rope_scaling, rotary_dim, local_rope_theta = _layer_ropes(
        hf, get, family, head_dim, problems
    )
    max_positions = int(get("max_position_embeddings"))
    factor = (rope_scaling or {}).get("factor")
    if rope_scaling is not None and rope_scaling["rope_type"] == "dynamic" and factor:
        # dynamic NTK runs a model past its context: `factor` times it
        max_positions = max(max_positions, int(max_positions * float(factor)))
    eos = get("eos_token_id") if "eos_token_id" not in hf else hf["eos_token_id"]
    eos_ids = _eos_ids(eos, problems)
    extra = (generation or {}).get("eos_token_id")
    for i in _eos_ids(extra, []) if extra is not None else ():
        if i not in eos_ids:
            eos_ids = (*eos_ids, i)
    num_layers = int(get("num_hidden_layers"))
    window, full_layers = _sliding_window(hf, get, num_layers, family.window_pattern, problems)
    if problems:
        raise DecoderImportError(f"unsupported {model_type} model: " + "; ".join(problems))

    pad = hf.get("pad_token_id")
    bos = get("bos_token_id") if "bos_token_id" not in hf else hf["bos_token_id"]
    try:
        return DecoderConfig(
            family=model_type,
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            intermediate_size=int(get("intermediate_size")),
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=rope_theta,
            max_positions=max_positions,
            tie_embeddings=bool(get("tie_word_embeddings")),
            bos_id=None if bos is None else int(bos),
            eos_ids=eos_ids,
            pad_id=eos_ids[0] if pad is None else int(pad),
            attention_bias=switch(family.qkv_bias),
            attention_out_bias=switch(family.out_bias),
            qk_norm=family.qk_norm,
            rope_scaling=rope_scaling,
            rotary_dim=rotary_dim,
            sliding_window=window,
            full_attention_layers=full_layers,
            activation=ACTIVATIONS[activation],
            query_pre_attn_scalar=_optional_float(get("query_pre_attn_scalar")),
            attn_logit_softcapping=_optional_float(explicit("attn_logit_softcapping")),
            final_logit_softcapping=_optional_float(explicit("final_logit_softcapping")),
            local_rope_theta=local_rope_theta if window is not None else None,
            **family.switches,
        )
    except ValueError as exc:
        raise DecoderImportError(f"unsupported {model_type} config: {exc}") from exc


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The config.json of a `MULTIMODAL` checkpoint's language model: its text_config, with the
    top-level token ids and tying; DecoderImportError when it has none."""
    architecture, text_type = MULTIMODAL[hf["model_type"]]
    architectures = hf.get("architectures") or [architecture]
    text = hf.get("text_config")
    if architecture not in architectures or not isinstance(text, dict):
        raise DecoderImportError(
            f"unsupported {hf['model_type']} model: expected a {architecture} config with a "
            f"text_config (architectures {architectures})"
        )
    top = {key: hf[key] for key in _TOP_LEVEL_KEYS if hf.get(key) is not None}
    return {
        **text,
        **top,
        "model_type": text.get("model_type", text_type),
        "architectures": [FAMILIES[text_type].architecture],
    }


def language_model_weights(hf_state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A multimodal checkpoint's language model tensors under the text model's names; the
    others (vision tower, projector) are left out."""
    ours: dict[str, Tensor] = {}
    for key, tensor in hf_state.items():
        for prefix, replacement in _LANGUAGE_MODEL_PREFIXES:
            if key.startswith(prefix):
                ours[replacement + key.removeprefix(prefix)] = tensor
                break
    logger.info("multimodal checkpoint: %d tensors of %d left out (not the language model's)",
                len(hf_state) - len(ours), len(hf_state))  # fmt: skip
    return ours


def parameter_names(config: DecoderConfig) -> set[str]:
    """The names of DecoderOnly's stored parameters for `config` (built on the meta device:
    nothing allocated)."""
    with torch.device("meta"):
        model = DecoderOnly(config)
    return {name for name in model.state_dict() if name not in model.alias_names()}


def _rename(key: str, num_layers: int) -> str | None:
    """model.layers.3.mlp.up_proj.weight -> layers.3.mlp.up_proj.weight (None: not a layer of
    the model nor its embedding or final norm)."""
    if key in ("model.embed_tokens.weight", "model.norm.weight"):
        return key.removeprefix("model.")
    match = _LAYER_KEY.fullmatch(key)
    if match is None or int(match.group(1)) >= num_layers:
        return None
    return key.removeprefix("model.")


def split_fused(key: str, tensor: Tensor, config: DecoderConfig) -> dict[str, Tensor]:
    """A fused projection's tensor (FUSED: Phi-3's qkv_proj, gate_up_proj) as the separate
    ones it stacks, under their names; any other tensor as it is."""
    for fused, parts in FUSED.items():
        prefix, dot, suffix = key.partition(f".{fused}.")
        if not dot:
            continue
        d = config.head_dim
        if fused == "self_attn.qkv_proj":
            rows = [config.num_heads * d, config.num_kv_heads * d, config.num_kv_heads * d]
        else:
            rows = [config.intermediate_size] * 2
        if tensor.shape[0] != sum(rows):
            raise DecoderImportError(
                f"{key}: {tensor.shape[0]} rows, {sum(rows)} expected from config.json"
            )
        pieces = torch.split(tensor, rows, dim=0)
        return {f"{prefix}.{part}.{suffix}": t for part, t in zip(parts, pieces, strict=True)}
    return {key: tensor}


def convert_decoder_state_dict(
    hf_state: dict[str, Tensor], config: DecoderConfig
) -> dict[str, Tensor]:
    """HF *ForCausalLM tensors -> DecoderOnly's state dict (float32, tied head not repeated;
    fused projections split)."""
    names = parameter_names(config)
    ours: dict[str, Tensor] = {}
    unexpected = []
    split: dict[str, Tensor] = {}
    for key, tensor in hf_state.items():
        split.update(split_fused(key, tensor, config))
    for key, tensor in split.items():
        name = _rename(key, config.num_layers)
        if name is not None and name in names:
            ours[name] = tensor
        elif key != "lm_head.weight" and not key.endswith(_IGNORED_LAYER_PARAMS):
            unexpected.append(key)
    if unexpected:
        raise DecoderImportError(
            f"unsupported weights in the checkpoint: {sorted(unexpected)[:10]}"
        )

    head = split.get("lm_head.weight")
    if not config.tie_embeddings:
        if head is None:
            raise DecoderImportError("tie_word_embeddings is false but there is no lm_head.weight")
        ours["lm_head.weight"] = head
    elif head is not None and not torch.equal(head, ours.get("embed_tokens.weight", head)):
        logger.warning("tie_word_embeddings: ignoring an lm_head.weight that differs (HF does)")
    return {name: t.float() if t.is_floating_point() else t for name, t in ours.items()}


def build_decoder(config: DecoderConfig, state: dict[str, Tensor]) -> DecoderOnly:
    """A DecoderOnly (eval mode) holding converted weights; DecoderImportError on any mismatch."""
    model = DecoderOnly(config)
    expected = {k: t for k, t in model.state_dict().items() if k not in model.alias_names()}
    missing = sorted(set(expected) - set(state))
    if missing:
        raise DecoderImportError(f"the checkpoint lacks {missing[:10]}")
    for name, tensor in state.items():
        if name not in expected:
            raise DecoderImportError(f"{name} is not a parameter of the model")
        if tensor.shape != expected[name].shape:
            raise DecoderImportError(
                f"{name}: shape {tuple(tensor.shape)} in the checkpoint, "
                f"{tuple(expected[name].shape)} from config.json"
            )
    model.load_state_dict(state, strict=False)  # the tied head is the embedding Parameter
    return model.eval()


def import_hf_decoder(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """A Hugging Face directory of a FAMILIES (or MULTIMODAL) model_type -> a decoder-only
    model directory."""
    from attnserve.convert.marian import load_hf_state_dict  # the shared HF weight reader

    hf_dir = Path(hf_dir)
    generation = (
        read_json_object(hf_dir, "generation_config.json")
        if (hf_dir / "generation_config.json").is_file()
        else None
    )
    hf_config = read_json_object(hf_dir, "config.json")
    config = decoder_config_from_hf(hf_config, generation)
    hf_state = load_hf_state_dict(hf_dir)
    if hf_config.get("model_type") in MULTIMODAL:
        hf_state = language_model_weights(hf_state)
    model = build_decoder(config, convert_decoder_state_dict(hf_state, config))
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
