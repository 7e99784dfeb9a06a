"""Import a llama.cpp GGUF file (architectures `llama`, Mistral's included, `qwen2`, `qwen3`,
`phi3`, `gemma2` and `gemma3`) into a decoder-only model directory.

Reads the `{arch}.*` metadata into a DecoderConfig and every tensor through the `gguf` package
(GGUFReader, `gguf.quants.dequantize`: F32, F16, BF16, Q8_0, Q4_0, Q4_1 and the other block
formats it implements), dequantized to float32. GGUF lists a tensor's dimensions innermost first
(ggml's ne[0] is the row length); the reader's arrays are already in numpy (outermost first)
order. llama.cpp's converter permutes the rows of attn_q / attn_k so that each head's rotary
pairs are interleaved (GPT-J style); our rotary embeddings rotate halves (as Hugging Face's), so
`unpermute_rows` undoes that, as transformers' GGUF loader does. The converter permutes only for
`llama`: qwen2/qwen3 files keep Hugging Face's order. The tensors present set the switches
(q/k/v and output biases, per-head q/k norms); `{arch}.attention.sliding_window` sets the window
of a `llama` file (Mistral). llama.cpp writes Llama 3's rope scaling as `rope_freqs` (divisors of
the plain frequencies): it is read as the `llama3` rope_scaling that gives the same frequencies,
and refused when none does. A `phi3` file keeps Hugging Face's q/k order; its fused `attn_qkv`
and `ffn_up` (gate and up stacked) are split as the Hugging Face import splits Phi-3's
checkpoints, `rope.dimension_count` below the head size is partial rotation (Phi-4-mini),
`attention.sliding_window` the window of every layer (0: none), and LongRoPE is the
`rope_factors_short` / `rope_factors_long` tensors with `rope.scaling.original_context_length`
(and `rope.scaling.attn_factor`, kept where it is not the one computed from the context
lengths): the `longrope` rope_scaling. No `output` tensor means the output projection is the
embedding. The tokenizer and chat template become tokenizer.json and
tokenizer_config.json (convert/gguf_tokenizer.py).

Gemma (`gemma2`, `gemma3`): llama.cpp's converter adds 1 to every norm weight (Gemma's norms
multiply by 1 + w, llama.cpp's by w), so the import subtracts it; `ffn_norm` is then the MLP's
input norm (`pre_feedforward_layernorm`), `post_attention_norm` and `post_ffw_norm` the branch
outputs' norms. What llama.cpp fixes for these architectures rather than stores, the import
fixes as llama.cpp does: every 2nd (gemma2) or 6th (gemma3) layer attends to the whole context,
the others through `attention.sliding_window` (unless `attention.sliding_window_pattern` says
otherwise), gemma3's windowed layers rotate with base 10000 (`rope.freq_base_swa` when present)
and only its other layers with the linear `rope.scaling`, and the attention scale is
1/sqrt(hidden / heads) for the 27B models (46 and 62 layers), 1/sqrt(key_length) otherwise.
The soft caps are `{arch}.attn_logit_softcapping` and `final_logit_softcapping`; the
`<end_of_turn>` token, when the vocabulary has it, ends a sequence as EOS does.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.constants import GGUF_MAGIC
from gguf.quants import dequantize

from attnserve.convert.hf_decoder import build_decoder, split_fused
from attnserve.model.checkpoint import ModelDirError, ModelFileInvalidError
from attnserve.model.decoder_checkpoint import save_decoder_dir
from attnserve.model.decoder_config import DecoderConfig
from attnserve.model.decoder_only import DecoderOnly

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
# the architectures whose q/k rows llama.cpp's converter permutes
_PERMUTED_ARCHITECTURES = ("llama",)
# the architectures whose ffn_up holds gate and up stacked (Phi-3's gate_up_proj)
_FUSED_UP_ARCHITECTURES = ("phi3",)
# the architectures that may rotate part of each head (rope.dimension_count < head size)
_PARTIAL_ROPE_ARCHITECTURES = ("phi3",)
GENERATION_CONFIG = "generation_config.json"
# GGUF tensor name (without ".weight") -> ours; {i} is the layer index.
_GLOBAL_NAMES = {
    "token_embd": "embed_tokens.weight",
    "output_norm": "norm.weight",
    "output": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_qkv": "self_attn.qkv_proj.weight",  # fused (Phi-3): split as the HF import does
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
    "attn_norm": "input_layernorm.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "attn_q_norm": "self_attn.q_norm.weight",
    "attn_k_norm": "self_attn.k_norm.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
}
# Gemma's names for its four layer norms (the MLP input's is `ffn_norm`, as Llama's)
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm.weight",
    "post_attention_norm": "post_attention_layernorm.weight",
    "post_ffw_norm": "post_feedforward_layernorm.weight",
}
# arch -> (our family, every n-th layer attends to the whole context, 27B's layer count)
GEMMA_ARCHITECTURES = {"gemma2": ("gemma2", 2, 46), "gemma3": ("gemma3_text", 6, 62)}
GEMMA_LOCAL_ROPE_THETA = 10000.0  # llama.cpp's gemma3 sliding-window base
GEMMA2_SLIDING_WINDOW = 4096  # llama.cpp's default when a gemma2 file has none
END_OF_TURN = "<end_of_turn>"
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Per-frequency divisors llama.cpp stores for Llama 3's scaled rotary embeddings.
ROPE_FREQS = "rope_freqs.weight"
# Llama 3.x's llama3 rope parameters other than `factor` (llama.cpp's converter's defaults too);
# a file's rope.scaling.original_context_length replaces the context length.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3_ORIGINAL_CONTEXT = 8192
# LongRoPE's per-frequency divisors (Phi-3 128k, Phi-3.5, Phi-4-mini): -> short_factor and
# long_factor of a `longrope` rope_scaling.
ROPE_FACTORS = {
    "rope_factors_short.weight": "short_factor",
    "rope_factors_long.weight": "long_factor",
}


class GGUFImportError(ModelDirError, ValueError):
    """The GGUF file holds something we cannot run faithfully, or is no GGUF file."""


def is_gguf_file(path: str | Path) -> bool:
    """True for a file that starts with the GGUF magic ("GGUF")."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        head = f.read(4)
    return len(head) == 4 and int.from_bytes(head, "little") == GGUF_MAGIC


def open_gguf(path: str | Path) -> GGUFReader:
    """A GGUFReader (memory-mapped); GGUFImportError for a file that is not valid GGUF."""
    try:
        return GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as exc:
        raise GGUFImportError(f"{path} is not a readable GGUF file: {exc}") from exc


def metadata(reader: GGUFReader) -> dict[str, Any]:
    """Scalar and string metadata as Python values; arrays as their item count (`len(...)`),
    but for a per-layer sliding window pattern (a list)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not field.types:
            continue
        if field.types[0] == GGUFValueType.ARRAY and key.endswith(".sliding_window_pattern"):
            out[key] = list(field.contents())
        elif field.types[0] == GGUFValueType.ARRAY:
            out[key] = len(field.data)
        else:
            out[key] = field.contents()
    return out


def _float32(value: Any) -> float:
    """A float stored as float32, as the shortest decimal that rounds to it (1e-05, not
    9.999999747378752e-06), as the config.json it was converted from wrote it."""
    return float(str(np.float32(value)))


def config_from_gguf(meta: dict[str, Any]) -> DecoderConfig:
    """DecoderConfig from GGUF metadata (`metadata(reader)`); GGUFImportError for the rest."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    problems: list[str] = []

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            problems.append(f"{arch}.{key} is missing")
        return value

    hidden = get("embedding_length")
    heads = get("attention.head_count")
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    head_dim: Any = meta.get(f"{arch}.attention.key_length")
    if head_dim is None and hidden is not None and heads:
        head_dim = hidden // heads
    rope_dims = meta.get(f"{arch}.rope.dimension_count", head_dim)
    partial = arch in _PARTIAL_ROPE_ARCHITECTURES and isinstance(rope_dims, int)
    if rope_dims != head_dim and not (partial and 0 < rope_dims < (head_dim or 0)):
        problems.append(f"rope.dimension_count {rope_dims} != head_dim {head_dim} (partial rope)")
    value_dim = meta.get(f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:
        problems.append(f"attention.value_length {value_dim} != key_length {head_dim}")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    # LongRoPE is its rope_factors tensors (read_gguf); llama.cpp's converter names no type.
    # gemma3's linear scaling applies to its full-attention layers (gemma_switches).
    if scaling not in ("none", None) and not (
        (arch == "phi3" and scaling == "longrope") or (arch == "gemma3" and scaling == "linear")
    ):
        problems.append(f"rope.scaling.type {scaling!r} (only plain rotary embeddings)")
    if meta.get(f"{arch}.expert_count", 0):
        problems.append("a mixture of experts (expert_count > 0)")
    vocab: Any = meta.get("tokenizer.ggml.tokens", meta.get(f"{arch}.vocab_size"))
    if vocab is None:
        problems.append("no tokenizer.ggml.tokens nor vocab_size")
    eos: Any = meta.get("tokenizer.ggml.eos_token_id")
    if eos is None:
        problems.append("tokenizer.ggml.eos_token_id is missing")
    values = {
        "hidden": hidden,
        "layers": get("block_count"),
        "ffn": get("feed_forward_length"),
        "eps": get("attention.layer_norm_rms_epsilon"),
    }
    if problems:
        raise GGUFImportError("unsupported GGUF model: " + "; ".join(problems))
    eos_ids = [int(eos)]
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos_ids:
        eos_ids.append(int(eot))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    pad = meta.get("tokenizer.ggml.padding_token_id")
    # Mistral's (a llama file) and Phi-3's, in every layer; Phi-3's 0 is none (Phi-4-mini)
    window = meta.get(f"{arch}.attention.sliding_window") if arch in ("llama", "phi3") else None
    fields: dict[str, Any] = {
        "family": "mistral" if window and arch == "llama" else arch,
        "sliding_window": int(window) if window else None,
    }
    if arch in GEMMA_ARCHITECTURES:
        fields.update(gemma_switches(meta, int(values["layers"])))
    try:
        return DecoderConfig(
            vocab_size=int(vocab),
            hidden_size=int(values["hidden"]),
            num_layers=int(values["layers"]),
            num_heads=int(heads),
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            intermediate_size=int(values["ffn"]),
            rms_norm_eps=_float32(values["eps"]),
            rope_theta=_float32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            max_positions=int(get("context_length", 2048)),
            tie_embeddings=True,  # set from the tensors by read_gguf
            bos_id=None if bos is None else int(bos),
            eos_ids=tuple(eos_ids),
            pad_id=eos_ids[0] if pad is None else int(pad),
            rotary_dim=int(rope_dims) if rope_dims != head_dim else None,
            **fields,
        )
    except ValueError as exc:
        raise GGUFImportError(f"unsupported GGUF config: {exc}") from exc


def gemma_switches(meta: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The DecoderConfig fields a gemma2 / gemma3 file sets beyond Llama's, as llama.cpp reads
    them (the module docstring says what it fixes rather than stores)."""
    arch = meta["general.architecture"]
    family, every, layers_27b = GEMMA_ARCHITECTURES[arch]
    window = meta.get(f"{arch}.attention.sliding_window")
    if window is None and arch == "gemma2":
        window = GEMMA2_SLIDING_WINDOW
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", every)
    if isinstance(pattern, list):  # per layer: True = sliding
        full = tuple(i for i, sliding in enumerate(pattern) if not sliding)
    else:
        full = tuple(i for i in range(num_layers) if (i + 1) % int(pattern) == 0)
    if window is None or len(full) == num_layers:
        window, full = None, ()
    hidden, heads = meta[f"{arch}.embedding_length"], meta[f"{arch}.attention.head_count"]
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
    out: dict[str, Any] = {
        "family": family,
        "norm_unit_offset": True,
        "sandwich_norms": True,
        "activation": "gelu_tanh",
        "scale_embeddings": True,
        "query_pre_attn_scalar": float(hidden // heads if num_layers == layers_27b else head_dim),
        "sliding_window": None if window is None else int(window),
        "full_attention_layers": full,
    }
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = meta.get(f"{arch}.{cap}")
        out[cap] = None if value is None else _float32(value)
    if arch == "gemma3" and window is not None:
        base = meta.get(f"{arch}.rope.freq_base_swa", GEMMA_LOCAL_ROPE_THETA)
        out["local_rope_theta"] = _float32(base)
    if meta.get(f"{arch}.rope.scaling.type") == "linear":
        out["rope_scaling"] = {
            "rope_type": "linear",
            "factor": _float32(meta[f"{arch}.rope.scaling.factor"]),
        }
    return out


def llama3_scaling(
    divisors: np.ndarray, config: DecoderConfig, meta: dict[str, Any]
) -> dict[str, Any] | None:
    """The `llama3` rope_scaling whose frequencies (model/rope.py) are the plain ones divided by
    `divisors` (a file's rope_freqs), None when it gives other frequencies."""
    from attnserve.model.rope import plain_frequencies, rope_frequencies

    plain = plain_frequencies(config.head_dim, config.rope_theta)
    if divisors.shape != plain.shape:
        return None
    arch = meta.get("general.architecture")
    original = meta.get(f"{arch}.rope.scaling.original_context_length", LLAMA3_ORIGINAL_CONTEXT)
    scaling = {
        "rope_type": "llama3",
        "factor": float(divisors.max()),
        **LLAMA3_ROPE,
        "original_max_position_embeddings": int(original),
    }
    try:
        scaled, _ = rope_frequencies(config.replace(rope_scaling=scaling))
    except ValueError:
        return None
    target = plain / torch.from_numpy(divisors)
    return scaling if torch.allclose(scaled, target, rtol=1e-6, atol=0.0) else None


def unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k `permute` (interleaved rotary pairs -> rotate-half order)."""
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise GGUFImportError(f"{rows} rows cannot hold {n_head} heads of rotary pairs")
    w = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def _our_name(gguf_name: str, num_layers: int, gemma: bool = False) -> str | None:
    if gguf_name.endswith(".weight") and gguf_name[: -len(".weight")] in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name[: -len(".weight")]]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or int(match.group(1)) >= num_layers:
        return None
    kind = match.group(2) if match.group(3) == "weight" else f"{match.group(2)}.bias"
    names = _GEMMA_LAYER_NAMES if gemma else _LAYER_NAMES
    if kind not in names:
        return None
    return f"layers.{match.group(1)}.{names[kind]}"


def tensor_to_float32(tensor: Any) -> np.ndarray:
    """A ReaderTensor's values as float32 in numpy order (GGUF's dimensions reversed)."""
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise GGUFImportError(
            f"{tensor.name}: tensor type {tensor.tensor_type.name} is not supported: {exc}"
        ) from exc
    # a copy: F32 data is a view of the read-only memory map
    return np.array(values, dtype=np.float32, order="C", copy=True).reshape(shape)


def read_gguf(path: str | Path) -> tuple[DecoderConfig, dict[str, torch.Tensor]]:
    """Config and DecoderOnly state dict (float32; no lm_head when tied) of a GGUF file."""
    reader = open_gguf(path)
    meta = metadata(reader)
    config = config_from_gguf(meta)
    arch = meta["general.architecture"]
    permuted = arch in _PERMUTED_ARCHITECTURES
    gemma = config.norm_unit_offset
    if gemma:
        config = config.replace(eos_ids=_with_end_of_turn(config.eos_ids, reader))
    state: dict[str, torch.Tensor] = {}
    unexpected = []
    rope_factors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = _our_name(tensor.name, config.num_layers, gemma)
        if name is not None and permuted and name.endswith(".qkv_proj.weight"):
            name = None  # fused rows we would have to un-permute: no converter writes them
        if name is None:
            if tensor.name == ROPE_FREQS:
                config = _with_rope_freqs(config, tensor_to_float32(tensor), meta, path)
            elif tensor.name in ROPE_FACTORS and arch == "phi3":
                rope_factors[ROPE_FACTORS[tensor.name]] = tensor_to_float32(tensor)
            else:
                unexpected.append(tensor.name)
            continue
        values = tensor_to_float32(tensor)
        if permuted and ".q_proj." in name:
            values = unpermute_rows(values, config.num_heads)
        elif permuted and ".k_proj." in name:
            values = unpermute_rows(values, config.num_kv_heads)
        elif gemma and name.endswith("norm.weight"):  # llama.cpp stored 1 + w
            values = values - np.float32(1.0)
        if arch in _FUSED_UP_ARCHITECTURES and name.endswith(".mlp.up_proj.weight"):
            name = name.replace(".mlp.up_proj.", ".mlp.gate_up_proj.")  # gate and up stacked
        try:
            state.update(split_fused(name, torch.from_numpy(values), config))
        except ModelDirError as exc:
            raise GGUFImportError(f"{path}: {exc}") from exc
    if unexpected:
        raise GGUFImportError(f"unsupported tensors in {path}: {sorted(unexpected)[:10]}")
    if rope_factors:
        config = _with_rope_factors(config, rope_factors, meta, path)
    return (
        config.replace(
            tie_embeddings="lm_head.weight" not in state,
            attention_bias="layers.0.self_attn.q_proj.bias" in state,
            attention_out_bias="layers.0.self_attn.o_proj.bias" in state,
            qk_norm="layers.0.self_attn.q_norm.weight" in state,
        ),
        state,
    )


def _with_end_of_turn(eos_ids: tuple[int, ...], reader: GGUFReader) -> tuple[int, ...]:
    """`eos_ids` and, when the vocabulary has it, the id of Gemma's `<end_of_turn>` (llama.cpp
    ends a generation on it by its text)."""
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        return eos_ids
    tokens = field.contents()
    if END_OF_TURN not in tokens or tokens.index(END_OF_TURN) in eos_ids:
        return eos_ids
    return (*eos_ids, tokens.index(END_OF_TURN))


def _with_rope_freqs(
    config: DecoderConfig, divisors: np.ndarray, meta: dict[str, Any], path: str | Path
) -> DecoderConfig:
    """`config` with the rope scaling a rope_freqs tensor stands for (all ones: none)."""
    if np.all(divisors == 1.0):
        return config
    scaling = llama3_scaling(divisors, config, meta)
    if scaling is None:
        raise GGUFImportError(
            f"{path}: {ROPE_FREQS} scales the rotary frequencies in a way no llama3 "
            "rope_scaling reproduces: import the model's Hugging Face directory instead"
        )
    return config.replace(rope_scaling=scaling)


def longrope_scaling(
    config: DecoderConfig, factors: dict[str, np.ndarray], meta: dict[str, Any]
) -> dict[str, Any]:
    """The `longrope` rope_scaling of a Phi-3 file: its short and long factors, the original
    context length, and its attention factor where it is not the one transformers computes
    from max_positions / original (as llama.cpp's converter computes it)."""
    from attnserve.model.rope import longrope_attention_factor

    arch = meta.get("general.architecture")
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original is None or set(factors) != {"short_factor", "long_factor"}:
        raise ValueError(
            "LongRoPE needs rope_factors_short, rope_factors_long and "
            "rope.scaling.original_context_length"
        )
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        **{key: [_float32(v) for v in values.tolist()] for key, values in factors.items()},
        "original_max_position_embeddings": int(original),
    }
    attention = meta.get(f"{arch}.rope.scaling.attn_factor")
    if attention is not None:
        computed = longrope_attention_factor(config.replace(rope_scaling=scaling))
        if np.float32(computed) != np.float32(attention):
            scaling["attention_factor"] = _float32(attention)
    return scaling


def _with_rope_factors(
    config: DecoderConfig, factors: dict[str, np.ndarray], meta: dict[str, Any], path: str | Path
) -> DecoderConfig:
    """`config` with the LongRoPE scaling its rope_factors tensors stand for."""
    try:
        return config.replace(rope_scaling=longrope_scaling(config, factors, meta))
    except ValueError as exc:
        raise GGUFImportError(f"{path}: unsupported LongRoPE scaling: {exc}") from exc


def convert_gguf(path: str | Path) -> DecoderOnly:
    """A DecoderOnly (eval mode) with the weights of a GGUF file."""
    config, state = read_gguf(path)
    try:
        return build_decoder(config, state)
    except ModelDirError as exc:
        raise GGUFImportError(f"{path}: {exc}") from exc


def tokenizer_fields(reader: GGUFReader) -> dict[str, Any]:
    """Every `tokenizer.*` metadata value, arrays (vocabulary, merges, types) in full, and
    `general.architecture` (a SentencePiece vocabulary's details depend on the family)."""
    return {
        key: field.contents()
        for key, field in reader.fields.items()
        if (key.startswith("tokenizer.") or key == "general.architecture") and field.types
    }


def generation_config(config: DecoderConfig, stop_ids: list[int]) -> dict[str, Any]:
    """generation_config.json of an imported model (Hugging Face's format): greedy, and every
    token that ends a turn as an eos id."""
    eos = list(dict.fromkeys([*config.eos_ids, *stop_ids]))
    return {
        "bos_token_id": config.bos_id,
        "eos_token_id": eos if len(eos) > 1 else eos[0],
        "pad_token_id": config.pad_id,
        "do_sample": False,
    }


def import_gguf(path: str | Path, out_dir: str | Path) -> Path:
    """A GGUF file -> a decoder-only model directory: config.json, model.safetensors,
    tokenizer.json + tokenizer_config.json (with the chat template), generation_config.json."""
    from attnserve.convert.gguf_tokenizer import GGUFTokenizerError, gguf_text_tokenizer

    path = Path(path)
    if not is_gguf_file(path):
        raise ModelFileInvalidError(f"{path} is not a GGUF file (no GGUF magic)")
    tokenizer = None
    try:
        tokenizer = gguf_text_tokenizer(tokenizer_fields(open_gguf(path)))
    except GGUFTokenizerError as exc:  # the weights are still usable with token ids
        logger.warning("%s: the tokenizer is not imported (%s): generate needs one", path, exc)
    model = convert_gguf(path)
    logger.info("imported %s (%d parameters)", path, model.num_parameters())
    out = save_decoder_dir(model, out_dir, {"source": str(path), "format": "gguf"})
    stop_ids: list[int] = []
    if tokenizer is not None:
        tokenizer.save(out)
        stop_ids = tokenizer.stop_ids
    text = json.dumps(generation_config(model.config, stop_ids), indent=2)
    (out / GENERATION_CONFIG).write_text(text + "\n", encoding="utf-8")
    return out
