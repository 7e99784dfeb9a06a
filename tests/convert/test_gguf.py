"""GGUF import: a tiny random LlamaForCausalLM written as GGUF (as llama.cpp's converter does,
q/k permuted) in F32, F16, Q8_0, Q4_0 and Q4_1 is read back into the same weights and logits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from attnserve.convert import import_model
from attnserve.convert.gguf import GGUFImportError, convert_gguf, read_gguf
from attnserve.model.checkpoint import ModelFileInvalidError, read_model_config
from attnserve.model.decoder_checkpoint import (
    directory_family,
    load_decoder_dir,
    read_decoder_config,
)
from attnserve.model.decoder_config import DecoderConfig

transformers = pytest.importorskip("transformers")

Q = GGMLQuantizationType
TINY: dict[str, Any] = {
    "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "rope_theta": 100000.0,
}  # fmt: skip
HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused ones
}  # fmt: skip
# max |error| of a block format relative to the block's largest |value|
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.Q8_0: 1 / 127, Q.Q4_0: 1 / 7, Q.Q4_1: 1 / 15}


def hf_model(tied: bool = True) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1 so that a misplaced norm shows
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


def permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `permute` (n_head already the kv heads for k)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_name(hf_name: str) -> str:
    name, _, suffix = hf_name.rpartition(".")  # weight or bias
    fixed = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if name in fixed:
        return f"{fixed[name]}.{suffix}"
    _, _, index, rest = name.split(".", 3)
    return f"blk.{index}.{HF_TO_GGUF[rest]}.{suffix}"


def write_gguf(
    model: Any,
    path: Path,
    qtype: GGMLQuantizationType,
    arch: str = "llama",
    extra: dict[str, np.ndarray] | None = None,
    sliding_window: int | None = None,
    rope_dims: int | None = None,
    configure: Callable[[GGUFWriter], None] | None = None,
) -> dict[str, np.ndarray]:
    """Write `model` as llama.cpp would (q/k permuted for `llama` only; plus `extra` GGUF
    tensors, float32; `rope_dims` rotated channels of a head, default all; `configure` adds
    metadata); returns the HF tensors (float32) by HF name."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None)
    writer = GGUFWriter(str(path), arch)
    if head_dim is not None:  # convert_hf_to_gguf.py writes a config's head_dim
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if sliding_window is not None:
        writer.add_sliding_window(sliding_window)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(
        rope_dims or head_dim or cfg.hidden_size // cfg.num_attention_heads
    )
    if configure is not None:
        configure(writer)
    writer.add_file_type(int(qtype))
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])
    writer.add_token_scores([0.0] * cfg.vocab_size)
    writer.add_token_types([1] * cfg.vocab_size)
    if cfg.bos_token_id is not None:
        writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_pad_token_id(cfg.pad_token_id)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        del state["lm_head.weight"]
    for name, values in state.items():
        if arch == "llama" and ".q_proj." in name:
            values = permute(values, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            values = permute(values, cfg.num_key_value_heads)
        kind = qtype if values.ndim == 2 else Q.F32  # llama.cpp keeps norms in F32
        writer.add_tensor(gguf_name(name), quantize(values, kind), raw_dtype=kind)
    for name, values in (extra or {}).items():
        writer.add_tensor(name, values.astype(np.float32), raw_dtype=Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


def max_block_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    """max |ours - theirs| over each 32-value block, relative to the block's largest |value|."""
    error = np.abs(ours - theirs).reshape(-1, 32).max(axis=1)
    scale = np.abs(theirs).reshape(-1, 32).max(axis=1)
    return float((error / np.maximum(scale, 1e-12)).max())


IDS = torch.tensor([[5, 17, 3, 88, 42, 9, 61, 30]])


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_weights_and_logits_match_hugging_face(tmp_path: Path, qtype: GGMLQuantizationType) -> None:
    hf = hf_model()
    state = write_gguf(hf, tmp_path / "m.gguf", qtype)
    config, ours = read_gguf(tmp_path / "m.gguf")
    assert config == DecoderConfig.preset("tiny", rope_theta=100000.0)
    assert "lm_head.weight" not in ours and len(ours) == len(state)
    for hf_name, theirs in state.items():
        mine = ours[hf_name.removeprefix("model.")].numpy()
        assert mine.shape == theirs.shape and mine.dtype == np.float32
        if qtype == Q.F32 or theirs.ndim == 1:
            np.testing.assert_array_equal(mine, theirs, err_msg=hf_name)
        else:
            assert max_block_error(mine, theirs) <= TOLERANCE[qtype] * 1.01, hf_name
    model = convert_gguf(tmp_path / "m.gguf")
    mask = torch.ones_like(IDS)
    with torch.no_grad():
        logits = model(IDS, mask)
        expected = hf(IDS).logits
    if qtype in (Q.F32, Q.F16):
        # F16 weights differ from HF's float32 ones: compare with the rounded weights
        if qtype == Q.F16:
            rounded = hf_model()
            with torch.no_grad():
                for p in rounded.parameters():
                    if p.dim() == 2:
                        p.copy_(p.half().float())
                expected = rounded(IDS).logits
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    else:
        assert (logits - expected).abs().max() < 0.25 * expected.abs().max()
    # transformers' own GGUF loader, on the same file, gives our logits
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="m.gguf", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(logits, reference(IDS).logits, rtol=1e-4, atol=1e-5)


def test_untied_head_and_model_directory(tmp_path: Path) -> None:
    hf = hf_model(tied=False)
    write_gguf(hf, tmp_path / "m.gguf", Q.F32)
    out = tmp_path / "out"
    assert import_model(tmp_path / "m.gguf", out) == "llama"
    assert directory_family(out) == "llama"
    assert read_decoder_config(out).tie_embeddings is False
    model = load_decoder_dir(out)
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)
    with torch.no_grad():
        torch.testing.assert_close(
            model(IDS, torch.ones_like(IDS)), hf(IDS).logits, rtol=1e-4, atol=1e-5
        )
    with pytest.raises(ModelFileInvalidError, match="decoder-only"):
        read_model_config(out)  # the encoder-decoder reader refuses it clearly


def test_hugging_face_llama_directory_is_imported(tmp_path: Path) -> None:
    hf = hf_model()
    hf.save_pretrained(tmp_path / "hf")
    out = tmp_path / "out"
    assert import_model(tmp_path / "hf", out) == "llama"
    model = load_decoder_dir(out)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    with torch.no_grad():
        torch.testing.assert_close(
            model(IDS, torch.ones_like(IDS)), hf(IDS).logits, rtol=1e-4, atol=1e-5
        )


def test_scaled_rotary_frequencies_are_refused_unit_ones_ignored(tmp_path: Path) -> None:
    """llama.cpp writes Llama 3's rope scaling as per-frequency divisors (rope_freqs)."""
    hf = hf_model()
    half = hf.config.hidden_size // hf.config.num_attention_heads // 2
    write_gguf(hf, tmp_path / "ones.gguf", Q.F32, extra={"rope_freqs.weight": np.ones(half)})
    read_gguf(tmp_path / "ones.gguf")
    scaled = np.linspace(1.0, 8.0, half)
    write_gguf(hf, tmp_path / "scaled.gguf", Q.F32, extra={"rope_freqs.weight": scaled})
    with pytest.raises(GGUFImportError, match=r"rope_freqs\.weight scales the rotary"):
        read_gguf(tmp_path / "scaled.gguf")


def test_other_architectures_are_refused(tmp_path: Path) -> None:
    write_gguf(hf_model(), tmp_path / "m.gguf", Q.F32, arch="gemma")
    with pytest.raises(GGUFImportError, match="architecture 'gemma' is not supported"):
        import_model(tmp_path / "m.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_file_named_gguf_that_is_not_one_is_refused(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"not gguf at all")
    with pytest.raises(ModelFileInvalidError, match="not a GGUF file"):
        import_model(tmp_path / "m.gguf", tmp_path / "out")
