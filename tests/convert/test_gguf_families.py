"""GGUF import of the families beyond plain Llama: tiny random Qwen2 (q/k/v biases), Qwen3
(per-head q/k norms, head_dim from key_length), Mistral (a `llama` file with a sliding
window) and Phi-3 (fused attn_qkv and ffn_up; a window; partial rotation with LongRoPE's
rope_factors tensors) models, and Llama 3's rope scaling (`rope_freqs`), written as llama.cpp's
converter writes them, give transformers' logits, and a Phi-3 file the model its Hugging Face
directory imports as; rope_freqs no llama3 setting reproduces are refused. Gemma 2 and Gemma 3
files (norm weights plus 1, Gemma's tensor and metadata names, the window pattern llama.cpp
fixes or one the file states) give transformers' logits and the config of the Hugging Face
import, `<end_of_turn>` among the stop tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from attnserve.convert import import_model
from attnserve.convert.gguf import GGUFImportError, convert_gguf, read_gguf
from attnserve.convert.hf_decoder import (
    build_decoder,
    convert_decoder_state_dict,
    decoder_config_from_hf,
)
from attnserve.model.decoder_checkpoint import load_decoder_dir
from attnserve.model.rope import longrope_frequencies
from tests.convert.test_gguf import HF_TO_GGUF, IDS, TINY, Q, write_gguf

transformers = pytest.importorskip("transformers")

LLAMA3 = {
    "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
}  # fmt: skip
# Phi-4-mini's shape: 3 of 4 channel pairs rotate (head 8), LongRoPE past 4 positions (IDS: 8)
LONGROPE = {
    "rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
    "short_factor": [1.0, 1.25, 1.5], "long_factor": [2.0, 5.0, 11.0],
}  # fmt: skip
# family -> (model class, arch in the file, config settings beyond TINY)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen2": ("Qwen2ForCausalLM", "qwen2", {"bos_token_id": None}),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", {"head_dim": 16, "bos_token_id": None}),
    "mistral": ("MistralForCausalLM", "llama", {"sliding_window": 3}),
    "llama3": ("LlamaForCausalLM", "llama", {"num_attention_heads": 2,
                                              "num_key_value_heads": 1, "rope_parameters": LLAMA3}),
    "phi3": ("Phi3ForCausalLM", "phi3", {"sliding_window": 3}),
    "phi3-longrope": ("Phi3ForCausalLM", "phi3", {"original_max_position_embeddings": 4,
                                                  "rope_parameters": LONGROPE}),
}  # fmt: skip


# name -> (model class, config settings beyond TINY, a per-layer window pattern to write)
GEMMA_CASES: dict[str, tuple[str, dict[str, Any], list[bool] | None]] = {
    "gemma2": (
        "Gemma2ForCausalLM",
        {"num_hidden_layers": 3, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0},
        None,
    ),
    # 6 layers: llama.cpp's pattern leaves the last one unwindowed
    "gemma3": (
        "Gemma3ForCausalLM",
        {
            "num_hidden_layers": 6, "final_logit_softcapping": 5.0,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
        None,
    ),
    "gemma3-pattern": (
        "Gemma3ForCausalLM",
        {
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
        [True, False, True],
    ),
}  # fmt: skip
GEMMA_TO_GGUF = {
    **HF_TO_GGUF,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
END_OF_TURN = 90  # the vocabulary's <end_of_turn> (TINY has 96 tokens)


def hf_model(family: str) -> Any:
    model_class, _, settings = CASES[family]
    settings = {**TINY, **settings}
    settings.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 1e6})
    settings.pop("rope_theta")
    torch.manual_seed(0)
    config = getattr(transformers, model_class).config_class(**settings)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # norms and biases away from their init so that a misplaced one shows
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


def llama_cpp_rope_freqs(head_dim: int, params: dict[str, Any]) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel rope_freqs: divisors of the plain frequencies."""
    freqs = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    divisors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def write_phi3(hf: Any, path: Path, qtype: Any = Q.F32) -> None:
    """convert_hf_to_gguf.py's Phi3MiniModel: fused tensors as they are (q/k not permuted),
    the rotated channels, the original context, a window of 0 for none, and for LongRoPE its
    factors as tensors with the attention factor it computes."""
    cfg = hf.config
    rope = cfg.rope_parameters
    rope_dims = int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // (
        cfg.num_attention_heads
    )
    original = rope.get("original_max_position_embeddings", cfg.original_max_position_embeddings)
    extra, attn_factor = None, None
    if rope["rope_type"] == "longrope":
        scale = cfg.max_position_embeddings / original
        attn_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        extra = {
            "rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
            "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32),
        }

    def configure(writer: GGUFWriter) -> None:
        writer.add_rope_scaling_orig_ctx_len(original)
        if attn_factor is not None:
            writer.add_rope_scaling_attn_factors(attn_factor)

    write_gguf(
        hf, path, qtype, arch="phi3", extra=extra, sliding_window=cfg.sliding_window or 0,
        rope_dims=rope_dims, configure=configure,
    )  # fmt: skip


def write(family: str, path: Path) -> Any:
    hf = hf_model(family)
    _, arch, settings = CASES[family]
    cfg = hf.config
    if arch == "phi3":
        write_phi3(hf, path)
        return hf
    extra = None
    if family == "llama3":
        extra = {"rope_freqs.weight": llama_cpp_rope_freqs(cfg.head_dim, LLAMA3)}
    write_gguf(
        hf, path, Q.F32, arch=arch, extra=extra, sliding_window=settings.get("sliding_window")
    )
    return hf


@pytest.mark.parametrize("family", list(CASES))
def test_logits_match_transformers(tmp_path: Path, family: str) -> None:
    hf = write(family, tmp_path / "m.gguf")
    config, _ = read_gguf(tmp_path / "m.gguf")
    _, arch, settings = CASES[family]
    assert config.family == ("mistral" if family == "mistral" else arch)
    assert config.attention_bias == (family == "qwen2") and not config.attention_out_bias
    assert config.qk_norm == (family == "qwen3")
    cfg = hf.config
    assert config.head_dim == getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    assert config.sliding_window == settings.get("sliding_window")
    assert config.rotary_dim == (6 if family == "phi3-longrope" else None)
    if family == "llama3":
        assert config.rope_scaling == {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
    model = convert_gguf(tmp_path / "m.gguf")
    with torch.no_grad():
        torch.testing.assert_close(
            model(IDS, torch.ones_like(IDS)), hf(IDS).logits, rtol=1e-4, atol=1e-5
        )


@pytest.mark.parametrize("family", ["phi3", "phi3-longrope"])
def test_a_phi3_file_imports_as_its_hugging_face_directory(tmp_path: Path, family: str) -> None:
    """The same config (LongRoPE's factors read back from float32 tensors: the same frequencies)
    and logits as the Hugging Face import, prompts shorter and longer than the original
    context; a Q8_0 file (llama.cpp's usual) within its quantization error."""
    hf = write(family, tmp_path / "m.gguf")
    from_hf = decoder_config_from_hf(json.loads(hf.config.to_json_string()))
    ours = build_decoder(from_hf, convert_decoder_state_dict(hf.state_dict(), from_hf))
    model = convert_gguf(tmp_path / "m.gguf")
    config = model.config
    assert config.replace(rope_scaling=None) == from_hf.replace(rope_scaling=None)
    if from_hf.rope_scaling is not None:
        assert config.rope_scaling is not None
        assert set(config.rope_scaling) == set(from_hf.rope_scaling)  # no attention_factor
        for ours_freqs, hf_freqs in zip(
            longrope_frequencies(config), longrope_frequencies(from_hf), strict=True
        ):
            assert torch.equal(ours_freqs, hf_freqs)
    write_phi3(hf, tmp_path / "q8.gguf", Q.Q8_0)
    quantized = convert_gguf(tmp_path / "q8.gguf")
    for ids in (IDS[:, :4], IDS):
        mask = torch.ones_like(ids)
        with torch.no_grad():
            expected = ours(ids, mask)
            torch.testing.assert_close(model(ids, mask), expected, rtol=0, atol=1e-6)
            torch.testing.assert_close(quantized(ids, mask), expected, rtol=0, atol=0.05)


def test_rope_factors_without_the_original_context_are_refused(tmp_path: Path) -> None:
    hf = hf_model("phi3-longrope")
    factors = {
        f"rope_factors_{kind}.weight": np.array(LONGROPE[f"{kind}_factor"], dtype=np.float32)
        for kind in ("short", "long")
    }
    write_gguf(hf, tmp_path / "m.gguf", Q.F32, arch="phi3", extra=factors, rope_dims=6)
    with pytest.raises(GGUFImportError, match="LongRoPE needs rope_factors_short"):
        read_gguf(tmp_path / "m.gguf")


def test_rope_freqs_no_llama3_setting_reproduces_are_refused(tmp_path: Path) -> None:
    hf = hf_model("llama3")
    other = {**LLAMA3, "original_max_position_embeddings": 1024}  # not in the file's metadata
    freqs = llama_cpp_rope_freqs(hf.config.head_dim, other)
    write_gguf(hf, tmp_path / "m.gguf", Q.F32, extra={"rope_freqs.weight": freqs})
    with pytest.raises(GGUFImportError, match="no llama3 rope_scaling reproduces"):
        read_gguf(tmp_path / "m.gguf")


def gemma_model(name: str) -> Any:
    """A tiny random Gemma 2 / Gemma 3 (head_dim 16, apart from hidden / heads; the
    query_pre_attn_scalar that llama.cpp assumes for a model that is not a 27B: head_dim)."""
    model_class, settings, _ = GEMMA_CASES[name]
    settings = {
        **TINY,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 3,
        **settings,
    }
    settings.pop("rope_theta")
    torch.manual_seed(0)
    config = getattr(transformers, model_class).config_class(**settings)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # norms away from their init so that a misplaced one shows
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(-0.5, 0.5)
    return model


def write_gemma_gguf(model: Any, path: Path, pattern: list[bool] | None) -> None:
    """As convert_hf_to_gguf.py's Gemma2Model / Gemma3Model write it: Gemma's metadata, norm
    weights plus 1, the tied head left out, a SentencePiece vocabulary with <end_of_turn>."""
    cfg = model.config
    arch = "gemma2" if cfg.model_type == "gemma2" else "gemma3"
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    else:
        full = cfg.rope_parameters["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        if full["rope_type"] == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
        if cfg.final_logit_softcapping:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        if pattern is not None:
            writer.add_sliding_window_pattern(pattern)
    writer.add_tokenizer_model("llama")
    tokens = [f"<t{i}>" for i in range(cfg.vocab_size)]
    tokens[END_OF_TURN] = "<end_of_turn>"
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * cfg.vocab_size)
    writer.add_token_types([1] * cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_pad_token_id(cfg.pad_token_id)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        values = tensor.detach().float().numpy()
        if name.endswith("norm.weight"):
            values = values + np.float32(1.0)
        base, _, suffix = name.rpartition(".")
        fixed = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
        if base in fixed:
            gguf_name = f"{fixed[base]}.{suffix}"
        else:
            _, _, index, rest = base.split(".", 3)
            gguf_name = f"blk.{index}.{GEMMA_TO_GGUF[rest]}.{suffix}"
        writer.add_tensor(gguf_name, values, raw_dtype=Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name", list(GEMMA_CASES))
def test_gemma_files_equal_the_hugging_face_import(tmp_path: Path, name: str) -> None:
    hf = gemma_model(name)
    write_gemma_gguf(hf, tmp_path / "m.gguf", GEMMA_CASES[name][2])
    config, state = read_gguf(tmp_path / "m.gguf")
    expected = decoder_config_from_hf(json.loads(hf.config.to_json_string()))
    assert config == expected.replace(eos_ids=(*expected.eos_ids, END_OF_TURN))
    assert config.full_attention_layers == {"gemma2": (1,), "gemma3": (5,)}.get(name, (1,))
    norm = state["layers.0.post_feedforward_layernorm.weight"]  # Gemma's w again, not 1 + w
    theirs = hf.model.layers[0].post_feedforward_layernorm.weight
    torch.testing.assert_close(norm, theirs, atol=1e-7, rtol=0)
    # the directory: Gemma's family, <end_of_turn> a stop token (the SentencePiece vocabulary
    # itself is not imported: gguf_tokenizer builds byte-level BPE only)
    assert import_model(tmp_path / "m.gguf", tmp_path / "out") == expected.family
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [*expected.eos_ids, END_OF_TURN]
    model = load_decoder_dir(tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(
            model(IDS, torch.ones_like(IDS)), hf(IDS).logits, rtol=1e-4, atol=1e-5
        )
