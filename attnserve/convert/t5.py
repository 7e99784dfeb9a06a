"""Import Hugging Face T5 directories (T5, T5 v1.1, Flan-T5, MADLAD-400: `model_type` `t5`).

T5 differs from the BART lineage in switches `ModelConfig` holds as data: pre-LN with RMSNorm
and no biases anywhere, no position embeddings but a learned bias per head over relative
position buckets (bidirectional in the encoder, causal in the decoder, computed in each stack's
first layer and shared by the others), no 1/sqrt(d) in the attention scores, a per-head width
`d_kv` that need not be d_model / heads, ReLU or gated-GELU (tanh approximation) feed-forward,
no embedding scale, and a tied output projection that rescales the decoder output by
d_model ** -0.5 (v1.1 and Flan-T5 untie it and do not). The decoder starts from the pad token.
T5 names the task in the source text: the translation prefixes of `task_specific_params` become
the tokenizer's prefixes by target language (a request's `target_lang` picks one). MADLAD-400
names the target language with a `<2xx>` token instead (`<2de> I love pizza.`): a vocabulary
with such tokens and no translation task prefixes gets one prefix per tag (`de` -> `<2de> `;
a tag typed in the text is replaced), and any source language.
Never imports transformers; weights are converted to float32.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnserve.convert.marian import generation_defaults, load_hf_state_dict, read_hf_json
from attnserve.model.checkpoint import (
    ModelDirError,
    ModelFileInvalidError,
    ModelFileMissingError,
    alias_names,
    check_tokenizer,
    save_model_dir,
)
from attnserve.model.config import ModelConfig
from attnserve.model.tokenizer import LANGUAGE_TOKEN, Tokenizer
from attnserve.model.transformer import EncoderDecoder

logger = logging.getLogger(__name__)

# T5Config's defaults (transformers 5.x) for keys a config.json may leave out.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32128, "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6,
    "num_heads": 8, "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
    "dropout_rate": 0.1, "layer_norm_epsilon": 1e-6, "feed_forward_proj": "relu",
    "tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": 1,
    "decoder_start_token_id": 0, "n_positions": 512,
}  # fmt: skip
# task_specific_params keys of translation tasks: translation_en_to_de
TRANSLATION_TASK = re.compile(r"translation_(?P<source>[A-Za-z-]+)_to_(?P<target>[A-Za-z-]+)")
# feed_forward_proj -> (gated, our activation)
FEED_FORWARD = {
    "relu": (False, "relu"),
    "gated-relu": (True, "relu"),
    "gelu": (False, "gelu"),
    "gated-gelu": (True, "gelu_tanh"),  # T5 v1.1: ACT2FN["gelu_new"]
    "gelu_new": (False, "gelu_tanh"),
    "gated-gelu_new": (True, "gelu_tanh"),
    "gated-silu": (True, "swish"),
}
_BLOCK = re.compile(r"(encoder|decoder)\.block\.(\d+)\.layer\.(\d)\.(.+)")
# (stack, sublayer index, HF name) -> ours, under {stack}_layers.{i}.
_SUBLAYERS = {
    ("encoder", 0): {"SelfAttention": "self_attn", "layer_norm": "self_attn_layer_norm"},
    ("encoder", 1): {"DenseReluDense": "ffn", "layer_norm": "final_layer_norm"},
    ("decoder", 0): {"SelfAttention": "self_attn", "layer_norm": "self_attn_layer_norm"},
    ("decoder", 1): {"EncDecAttention": "encoder_attn", "layer_norm": "encoder_attn_layer_norm"},
    ("decoder", 2): {"DenseReluDense": "ffn", "layer_norm": "final_layer_norm"},
}
_PROJECTIONS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "out_proj"}
_FFN = {"wi": "fc1", "wi_0": "fc1", "wi_1": "gate", "wo": "fc2"}
_TOP_LEVEL = {
    "encoder.final_layer_norm.weight": "encoder_norm.weight",
    "decoder.final_layer_norm.weight": "decoder_norm.weight",
}
_EMBEDDINGS = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


class T5ImportError(ModelDirError, ValueError):
    """The Hugging Face directory holds something we cannot import faithfully."""


def t5_model_config(
    hf: dict[str, Any], unk_id: int, *, tied: bool | None = None, shared: bool = True
) -> ModelConfig:
    """Map a T5Config dict to ModelConfig. `tied`: whether the checkpoint's output projection
    is the decoder's embedding (no separate lm_head.weight); default: config.json's
    tie_word_embeddings. `shared`: one embedding for both stacks (every released T5).

    The d_model ** -0.5 rescale is transformers 5's `scale_decoder_outputs` where config.json
    has it, else (transformers 4) tie_word_embeddings: T5 v1.0 ties and rescales, v1.1 unties
    and does not."""
    if hf.get("model_type") != "t5":
        raise T5ImportError(f"model_type is {hf.get('model_type')!r}, not 't5'")

    def get(key: str) -> Any:
        return hf.get(key, HF_DEFAULTS.get(key))

    projection = str(get("feed_forward_proj"))
    if projection not in FEED_FORWARD:
        raise T5ImportError(
            f"feed_forward_proj {projection!r} is not one of {', '.join(sorted(FEED_FORWARD))}"
        )
    gated, activation = FEED_FORWARD[projection]
    layers = int(get("num_layers"))
    decoder_layers = hf.get("num_decoder_layers") or layers
    scale = bool(hf.get("scale_decoder_outputs", get("tie_word_embeddings")))
    if tied is None:
        tied = bool(get("tie_word_embeddings"))
    eos = get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    try:
        return ModelConfig(
            vocab_size=int(get("vocab_size")),
            d_model=int(get("d_model")),
            n_heads=int(get("num_heads")),
            kv_dim=int(get("d_kv")),
            encoder_layers=layers,
            decoder_layers=int(decoder_layers),
            ffn_dim=int(get("d_ff")),
            activation=activation,  # type: ignore[arg-type]
            ffn_gated=gated,
            norm_placement="pre",
            norm="rmsnorm",
            linear_bias=False,
            scale_attention=False,
            scale_embedding=False,
            shared_embeddings=shared,
            tied_output=tied,
            scale_decoder_output=scale,
            final_logits_bias=False,
            positions="relative",
            relative_buckets=int(get("relative_attention_num_buckets")),
            relative_max_distance=int(get("relative_attention_max_distance")),
            max_positions=int(get("n_positions") or 512),
            layer_norm_eps=float(get("layer_norm_epsilon")),
            dropout=float(get("dropout_rate")),
            attention_dropout=float(get("dropout_rate")),
            activation_dropout=float(get("dropout_rate")),
            pad_id=int(get("pad_token_id")),
            eos_id=int(eos),
            unk_id=unk_id,
            decoder_start_id=int(get("decoder_start_token_id")),
        )
    except ValueError as exc:
        raise T5ImportError(f"unsupported T5 config: {exc}") from exc


def _rename(key: str) -> str | None:
    """A HF T5 tensor name -> ours (None: not one we read)."""
    if key in _TOP_LEVEL:
        return _TOP_LEVEL[key]
    match = _BLOCK.fullmatch(key)
    if match is None:
        return None
    stack, block, sublayer, rest = match.groups()
    parts = _SUBLAYERS.get((stack, int(sublayer)))
    if parts is None:
        return None
    module, _, tail = rest.partition(".")
    ours = parts.get(module)
    if ours is None:
        return None
    if tail.startswith("relative_attention_bias."):  # only block 0 has it: the stack's table
        table = "src_relative" if stack == "encoder" else "tgt_relative"
        return f"{table}.embedding.{tail.split('.', 1)[1]}"
    name, _, param = tail.rpartition(".")
    if ours == "ffn":
        name = _FFN.get(name, "")
    elif ours in ("self_attn", "encoder_attn"):
        name = _PROJECTIONS.get(name, "")
    if ours.endswith("layer_norm"):
        return f"{stack}_layers.{block}.{ours}.{tail}"
    if not name:
        return None
    return f"{stack}_layers.{block}.{ours}.{name}.{param}"


def _embeddings(hf_state: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor | None]:
    """The encoder's and decoder's input embeddings and a separate output projection (None
    when it is the decoder's embedding). Checkpoints store `shared` and usually the stacks'
    aliases of it; transformers 5 saves untied models with three separate matrices."""
    shared = hf_state.get("shared.weight")
    source = hf_state.get("encoder.embed_tokens.weight", shared)
    target = hf_state.get("decoder.embed_tokens.weight", shared)
    if source is None or target is None:
        raise T5ImportError(f"the weights have none of {', '.join(_EMBEDDINGS)}")
    head = hf_state.get("lm_head.weight")
    if head is not None and head.shape == target.shape and torch.equal(head, target):
        head = None
    return source, target, head


def convert_t5_state_dict(hf_state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    ours: dict[str, Tensor] = {}
    unexpected = []
    for key, tensor in hf_state.items():
        name = _rename(key)
        if name is not None:
            ours[name] = tensor
        elif key not in (*_EMBEDDINGS, "lm_head.weight"):
            unexpected.append(key)
    if unexpected:
        raise T5ImportError(f"unsupported weights in the checkpoint: {sorted(unexpected)[:10]}")
    source, target, head = _embeddings(hf_state)
    ours["src_embed.weight"] = source
    if not config.shared_embeddings:
        ours["tgt_embed.weight"] = target
    if not config.tied_output:
        if head is None:
            raise T5ImportError("an untied output projection needs lm_head.weight")
        ours["lm_head.weight"] = head
    return {name: t.float() if t.is_floating_point() else t for name, t in ours.items()}


def build_t5_model(hf_dir: Path, hf_config: dict[str, Any], unk_id: int) -> EncoderDecoder:
    hf_state = load_hf_state_dict(hf_dir)
    source, target, head = _embeddings(hf_state)
    shared = source.shape == target.shape and torch.equal(source, target)
    config = t5_model_config(hf_config, unk_id, tied=head is None, shared=shared)
    state = convert_t5_state_dict(hf_state, config)
    model = EncoderDecoder(config)
    expected = model.state_dict()
    missing = sorted(k for k in expected if k not in state and k not in alias_names(config))
    if missing:
        raise T5ImportError(f"the checkpoint lacks {missing[:10]}")
    for name, tensor in state.items():
        if name not in expected:
            raise T5ImportError(f"{name}: not a weight of the configured model")
        if tensor.shape != expected[name].shape:
            raise T5ImportError(
                f"{name}: shape {tuple(tensor.shape)} in the checkpoint, "
                f"{tuple(expected[name].shape)} from config.json"
            )
    model.load_state_dict(state, strict=False)
    return model.eval()


def task_prefixes(hf_config: dict[str, Any]) -> tuple[dict[str, str], str | None]:
    """T5's translation prefixes by target language from ``task_specific_params``
    (``translation_en_to_de``: ``translate English to German: ``) and their source language
    when they share one (else None; the first prefix per target is kept)."""
    params = hf_config.get("task_specific_params")
    prefixes: dict[str, str] = {}
    sources: set[str] = set()
    for task, values in params.items() if isinstance(params, dict) else ():
        match = TRANSLATION_TASK.fullmatch(str(task))
        prefix = values.get("prefix") if isinstance(values, dict) else None
        if match is None or not isinstance(prefix, str) or not prefix:
            continue
        sources.add(match["source"])
        prefixes.setdefault(match["target"], prefix)
    return prefixes, (sources.pop() if len(sources) == 1 else None)


def language_tag_prefixes(vocab: Iterable[str]) -> dict[str, str]:
    """MADLAD-400's `<2xx>` target language tokens of a vocabulary as prefixes by language
    code, in vocabulary order (``de`` -> ``<2de> ``, as its model card writes a source)."""
    return {m["code"]: f"{token} " for token in vocab if (m := LANGUAGE_TOKEN.fullmatch(token))}


def convert_t5(hf_dir: str | Path) -> tuple[EncoderDecoder, Tokenizer, dict[str, Any]]:
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ModelFileMissingError("config.json", hf_dir, " (the directory does not exist)")
    hf_config = read_hf_json(hf_dir, "config.json")
    prefixes, source_lang = task_prefixes(hf_config)
    try:
        tokenizer = Tokenizer.from_hf_json(hf_dir, prefixes=prefixes, source_lang=source_lang)
        if not prefixes:  # MADLAD-400: any source language, the target by its tag
            tokenizer.prefixes = language_tag_prefixes(tokenizer.source_vocabulary())
    except FileNotFoundError as exc:
        raise ModelFileMissingError(Path(exc.filename or str(exc)).name, hf_dir) from exc
    except (ValueError, RuntimeError) as exc:
        raise ModelFileInvalidError(f"tokenizer files in {hf_dir}: {exc}") from exc
    model = build_t5_model(hf_dir, hf_config, tokenizer.unk_id)
    try:
        check_tokenizer(model.config, tokenizer, f"in {hf_dir}")
    except ModelFileInvalidError as exc:
        raise T5ImportError(str(exc)) from exc
    metadata = {
        "source": {
            "format": "huggingface-t5",
            "path": str(hf_dir.resolve()),
            "architectures": hf_config.get("architectures"),
            "transformers_version": hf_config.get("transformers_version"),
        },
        "generation": generation_defaults(hf_dir, hf_config),
    }
    return model, tokenizer, metadata


def import_t5(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Convert a HF T5 directory into a model directory at `out_dir`."""
    model, tokenizer, metadata = convert_t5(hf_dir)
    logger.info("imported T5 %s: %d parameters", hf_dir, model.num_parameters())
    return save_model_dir(model, tokenizer, out_dir, extra_metadata=metadata)
