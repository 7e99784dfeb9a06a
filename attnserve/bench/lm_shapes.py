"""Benchmark models in the real shapes of released language models, with random weights.

`bench-lm --shape NAME` times a model of NAME's shape (SHAPES: Qwen2.5-0.5B-Instruct,
Llama-3.2-1B-Instruct) without downloading it. `prepare_shape` writes, under one root:

* ``hf/``: a Hugging Face directory as the released model's (its config.json keys and values,
  bfloat16 safetensors) holding random weights, N(0, 0.02) matrices and biases, norms of ones;
  and its real tokenizer, rebuilt from the vocabulary file llama.cpp's sources ship for it
  (`models/ggml-vocab-qwen2.gguf`, `ggml-vocab-llama-bpe.gguf`): same ids, same pre-tokenizer,
  so llama.cpp's converter recognises it. Without those sources a byte-level stand-in of the
  same vocabulary size is written (every id valid; prompts then take more tokens);
* ``model/``: `attnserve import` of hf/, and its ONNX variants (`attnserve export`).

The peers build from the same hf/ (attnserve/bench/lm_peers.py): ONNX Runtime GenAI's model
builder reads it as is, llama.cpp gets a GGUF from its own converter. Only the network's cost
is real: random weights make near-uniform logits, so the export's parity gates, written for
trained models, are not applied (`verify` off by default).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

HF_DIR = "hf"
MODEL_DIR = "model"
INIT_STD = 0.02

# Chat templates in the released models' formats, without their tool-calling branches.
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are Qwen, created "
    "by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] "
    "+ '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' "
    "}}{%- endif %}"
)


@dataclass(frozen=True)
class LMShape:
    """A released model's shape: its config.json and generation_config.json, and its
    tokenizer's vocabulary file in llama.cpp's sources (models/ggml-vocab-VOCAB.gguf)."""

    name: str
    released: str  # the Hugging Face repository whose config.json this copies
    config: dict[str, Any]
    generation: dict[str, Any]
    vocab: str
    chat_template: str
    # special token -> id (the stand-in tokenizer places them; the real one has them)
    special_tokens: dict[str, int] = field(default_factory=dict)
    bos_token: str | None = None
    eos_token: str = ""
    add_bos: bool = False

    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])


SHAPES: dict[str, LMShape] = {
    "qwen2.5-0.5b": LMShape(
        name="qwen2.5-0.5b",
        released="Qwen/Qwen2.5-0.5B-Instruct",
        config={
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "hidden_act": "silu",
            "hidden_size": 896,
            "initializer_range": INIT_STD,
            "intermediate_size": 4864,
            "max_position_embeddings": 32768,
            "max_window_layers": 21,
            "num_attention_heads": 14,
            "num_hidden_layers": 24,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6,
            "rope_scaling": None,
            "rope_theta": 1000000.0,
            "sliding_window": 32768,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
        generation={
            "bos_token_id": 151643,
            "eos_token_id": [151645, 151643],
            "pad_token_id": 151643,
            "do_sample": False,
        },
        vocab="qwen2",
        chat_template=CHATML_TEMPLATE,
        special_tokens={"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645},
        eos_token="<|im_end|>",
    ),
    "llama-3.2-1b": LMShape(
        name="llama-3.2-1b",
        released="meta-llama/Llama-3.2-1B-Instruct",
        config={
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009],
            "head_dim": 64,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": INIT_STD,
            "intermediate_size": 8192,
            "max_position_embeddings": 131072,
            "mlp_bias": False,
            "num_attention_heads": 32,
            "num_hidden_layers": 16,
            "num_key_value_heads": 8,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-5,
            "rope_scaling": {
                "factor": 32.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "vocab_size": 128256,
        },
        generation={
            "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009],
            "do_sample": False,
        },
        vocab="llama-bpe",
        chat_template=LLAMA3_TEMPLATE,
        special_tokens={
            "<|begin_of_text|>": 128000,
            "<|end_of_text|>": 128001,
            "<|start_header_id|>": 128006,
            "<|end_header_id|>": 128007,
            "<|eom_id|>": 128008,
            "<|eot_id|>": 128009,
        },
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        add_bos=True,
    ),
}


def get_shape(name: str) -> LMShape:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}") from None


def scaled(shape: LMShape, **config: Any) -> LMShape:
    """`shape` with config.json values replaced (a smaller copy for tests). A new vocab_size
    moves every special token id with the vocabulary's end, as both families place them."""
    vocab = int(config.get("vocab_size", shape.config["vocab_size"]))
    delta = vocab - int(shape.config["vocab_size"])

    def move(value: Any) -> Any:
        if isinstance(value, list):
            return [move(v) for v in value]
        return value + delta if isinstance(value, int) else value

    ids = ("bos_token_id", "eos_token_id", "pad_token_id")
    moved = {k: move(v) if k in ids else v for k, v in shape.config.items()}
    generation = {k: move(v) if k in ids else v for k, v in shape.generation.items()}
    specials = {t: i + delta for t, i in shape.special_tokens.items()}
    return replace(
        shape,
        config={**moved, **config},
        generation=generation,
        special_tokens=specials,
    )


def parameter_shapes(config: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The Hugging Face checkpoint's tensor names and shapes for a llama / qwen2 config.json."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inner = int(config["intermediate_size"])
    qkv_bias = config["model_type"] == "qwen2" or bool(config.get("attention_bias"))
    out_bias = config["model_type"] == "llama" and bool(config.get("attention_bias"))
    yield "model.embed_tokens.weight", (int(config["vocab_size"]), hidden)
    for i in range(int(config["num_hidden_layers"])):
        layer = f"model.layers.{i}"
        yield f"{layer}.input_layernorm.weight", (hidden,)
        for name, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            yield f"{layer}.self_attn.{name}_proj.weight", (rows * head_dim, hidden)
            if qkv_bias:
                yield f"{layer}.self_attn.{name}_proj.bias", (rows * head_dim,)
        yield f"{layer}.self_attn.o_proj.weight", (hidden, heads * head_dim)
        if out_bias:
            yield f"{layer}.self_attn.o_proj.bias", (hidden,)
        yield f"{layer}.post_attention_layernorm.weight", (hidden,)
        yield f"{layer}.mlp.gate_proj.weight", (inner, hidden)
        yield f"{layer}.mlp.up_proj.weight", (inner, hidden)
        yield f"{layer}.mlp.down_proj.weight", (hidden, inner)
    yield "model.norm.weight", (hidden,)
    if not config.get("tie_word_embeddings", False):
        yield "lm_head.weight", (int(config["vocab_size"]), hidden)


def parameter_count(config: dict[str, Any]) -> int:
    count = 0
    for _, dims in parameter_shapes(config):
        size = 1
        for d in dims:
            size *= d
        count += size
    return count


def write_weights(config: dict[str, Any], out: Path, seed: int = 0) -> Path:
    """model.safetensors of random weights in config.json's dtype: norms ones, the rest
    N(0, INIT_STD)."""
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, str(config.get("torch_dtype", "float32")))
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, dims in parameter_shapes(config):
        if name.endswith("norm.weight"):
            state[name] = torch.ones(dims, dtype=dtype)
        else:
            state[name] = (torch.randn(dims, generator=generator) * INIT_STD).to(dtype)
    path = out / "model.safetensors"
    save_file(state, str(path), metadata={"format": "pt"})
    return path


def vocab_file(llama_cpp_src: Path, shape: LMShape) -> Path:
    """llama.cpp's vocabulary-only GGUF of the shape's tokenizer."""
    return Path(llama_cpp_src) / "models" / f"ggml-vocab-{shape.vocab}.gguf"


def standin_tokenizer(shape: LMShape) -> Any:
    """A byte-level BPE without merges over vocab_size ids: the 256 bytes first, the special
    tokens at their ids, fillers between (every id a valid token)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from attnserve.model.control_tokens import bytes_to_unicode

    size = int(shape.config["vocab_size"])
    by_id = {i: t for t, i in shape.special_tokens.items()}
    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    for i in range(len(vocab), size):
        vocab[by_id.get(i, f"<|filler_{i}|>")] = i
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in shape.special_tokens])
    return tokenizer


def write_tokenizer(shape: LMShape, out: Path, llama_cpp_src: Path | None = None) -> str:
    """tokenizer.json and tokenizer_config.json (the shape's chat template) into `out`: the real
    tokenizer from llama.cpp's vocabulary file when `llama_cpp_src` has it, else the stand-in.
    Returns which was written."""
    from attnserve.convert.gguf import open_gguf, tokenizer_fields
    from attnserve.convert.gguf_tokenizer import gguf_text_tokenizer
    from attnserve.model.text_tokenizer import TextTokenizer

    source = None if llama_cpp_src is None else vocab_file(llama_cpp_src, shape)
    if source is not None and source.is_file():
        fields = tokenizer_fields(open_gguf(source))
        fields["tokenizer.ggml.add_bos_token"] = shape.add_bos
        text = gguf_text_tokenizer(fields)
        kind = f"llama.cpp's {source.name}"
    else:
        if source is not None:
            log.warning("%s is missing: a stand-in byte-level tokenizer", source)
        text = TextTokenizer(standin_tokenizer(shape), {})
        kind = "a byte-level stand-in"
    config = {
        **text.config,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": shape.chat_template,
        "eos_token": shape.eos_token,
        "bos_token": shape.bos_token,
        "pad_token": None,
        "add_bos_token": shape.add_bos,
        "model_max_length": int(shape.config["max_position_embeddings"]),
    }
    if len(text.tokenizer.get_vocab()) != int(shape.config["vocab_size"]):
        raise ValueError(
            f"{kind} has {text.vocab_size} tokens, the shape {shape.config['vocab_size']}"
        )
    TextTokenizer(text.tokenizer, config).save(out)
    return kind


def write_hf_shape(
    shape: LMShape, out: str | Path, *, llama_cpp_src: Path | None = None, seed: int = 0
) -> Path:
    """A Hugging Face directory of `shape` with random weights (see the module doc)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    kind = write_tokenizer(shape, out, llama_cpp_src)
    (out / "generation_config.json").write_text(json.dumps(shape.generation, indent=2) + "\n")
    write_weights(shape.config, out, seed)
    # config.json last: its presence says the directory is complete
    (out / "config.json").write_text(json.dumps(shape.config, indent=2) + "\n")
    log.info("wrote %s: %s, random weights (seed %d), tokenizer: %s", out, shape.name, seed, kind)
    return out


def prepare_shape(
    shape: LMShape,
    root: str | Path,
    variants: Sequence[str] = ("int8", "int4"),
    *,
    llama_cpp_src: Path | None = None,
    seed: int = 0,
    verify: bool = False,
) -> Path:
    """root/hf (written when missing), root/model (imported when missing) with `variants`
    exported when missing; returns the model directory."""
    from attnserve.convert.hf_decoder import import_hf_decoder
    from attnserve.export.ensure import is_exported
    from attnserve.export.lm_export import export_lm_model

    root = Path(root)
    hf, model = root / HF_DIR, root / MODEL_DIR
    if not (hf / "config.json").is_file():
        write_hf_shape(shape, hf, llama_cpp_src=llama_cpp_src, seed=seed)
    if not (model / "tokenizer.json").is_file():  # the importer's last file
        log.info("importing %s into %s", hf, model)
        import_hf_decoder(hf, model)
    missing = [v for v in variants if not is_exported(model, v)]
    if missing:
        log.info("exporting %s (verify: %s)", ", ".join(missing), verify)
        export_lm_model(model, missing, verify=verify)
    return model
