"""GGUF import of the families beyond plain Llama: tiny random Qwen2 (q/k/v biases), Qwen3
(per-head q/k norms, head_dim from key_length) and Mistral (a `llama` file with a sliding
window) models, and Llama 3's rope scaling (`rope_freqs`), written as llama.cpp's converter
writes them, give transformers' logits; rope_freqs no llama3 setting reproduces are refused."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from attnserve.convert.gguf import GGUFImportError, convert_gguf, read_gguf
from tests.convert.test_gguf import IDS, TINY, Q, write_gguf

transformers = pytest.importorskip("transformers")

LLAMA3 = {
    "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
}  # fmt: skip
# family -> (model class, arch in the file, config settings beyond TINY)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen2": ("Qwen2ForCausalLM", "qwen2", {"bos_token_id": None}),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", {"head_dim": 16, "bos_token_id": None}),
    "mistral": ("MistralForCausalLM", "llama", {"sliding_window": 3}),
    "llama3": ("LlamaForCausalLM", "llama", {"num_attention_heads": 2,
                                              "num_key_value_heads": 1, "rope_parameters": LLAMA3}),
}  # fmt: skip


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


def write(family: str, path: Path) -> Any:
    hf = hf_model(family)
    _, arch, settings = CASES[family]
    cfg = hf.config
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
    assert config.family == ("llama" if family == "llama3" else family)
    assert config.attention_bias == (family == "qwen2") and not config.attention_out_bias
    assert config.qk_norm == (family == "qwen3")
    cfg = hf.config
    assert config.head_dim == getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    assert config.sliding_window == (3 if family == "mistral" else None)
    if family == "llama3":
        assert config.rope_scaling == {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
    model = convert_gguf(tmp_path / "m.gguf")
    with torch.no_grad():
        torch.testing.assert_close(
            model(IDS, torch.ones_like(IDS)), hf(IDS).logits, rtol=1e-4, atol=1e-5
        )


def test_rope_freqs_no_llama3_setting_reproduces_are_refused(tmp_path: Path) -> None:
    hf = hf_model("llama3")
    other = {**LLAMA3, "original_max_position_embeddings": 1024}  # not in the file's metadata
    freqs = llama_cpp_rope_freqs(hf.config.head_dim, other)
    write_gguf(hf, tmp_path / "m.gguf", Q.F32, extra={"rope_freqs.weight": freqs})
    with pytest.raises(GGUFImportError, match="no llama3 rope_scaling reproduces"):
        read_gguf(tmp_path / "m.gguf")
