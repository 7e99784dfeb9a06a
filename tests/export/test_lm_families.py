"""The families' switches in the exported step graph: q/k/v and output biases, per-head q/k norms
with a head size apart from hidden / heads, llama3 and yarn rotary scaling, a sliding window
(in some layers), and Gemma 2's and Gemma 3's (norms of 1 + w around both branches, GELU-tanh,
scaled embeddings, query_pre_attn_scalar, attention and final soft caps, a second rotary base
for the windowed layers), each exported with both attentions. fp32 equals torch (the export's
own gate, plus decoded tokens here), int8 (and for Gemma int4) passes its gate, a batch decodes
as each prompt alone, and a GroupQueryAttention graph whose windowed or soft-capped layers stay
on ONNX Runtime's node says so in its manifest."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch

from attnserve.engine.generator import Generator
from attnserve.engine.onnx.lm_open import open_lm_backend
from attnserve.engine.options import DecodingOptions
from attnserve.engine.torch_lm import TorchLMBackend
from attnserve.export.lm_export import attention_fallback, export_lm_variants
from attnserve.model.decoder_config import DecoderConfig
from attnserve.model.decoder_only import DecoderOnly
from tests.export.test_lm_export import IdTokenizer

# longer than the window (4), so that it hides tokens; one row joins with a short prompt
PROMPTS = [[5, 17, 33, 8, 91, 40, 12, 7, 7, 3], [7, 64], [1, 9, 88, 23, 4], [44]]
LLAMA3 = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}  # fmt: skip
SWITCHES: dict[str, dict[str, Any]] = {
    "qwen2": {"family": "qwen2", "attention_bias": True, "rope_theta": 1e6},
    "qwen3": {"family": "qwen3", "qk_norm": True, "hidden_size": 48, "tie_embeddings": False},
    "llama3": {"rope_scaling": LLAMA3, "rope_theta": 5e5},
    "yarn": {
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        "attention_bias": True,
        "attention_out_bias": True,
    },
    "mistral": {"family": "mistral", "sliding_window": 4, "full_attention_layers": (0,)},
}
GEMMA: dict[str, Any] = {
    "norm_unit_offset": True, "sandwich_norms": True, "activation": "gelu_tanh",
    "scale_embeddings": True, "hidden_size": 48, "query_pre_attn_scalar": 24.0,
    "sliding_window": 4, "full_attention_layers": (1,),
}  # fmt: skip
SWITCHES["gemma2"] = {
    **GEMMA, "family": "gemma2", "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0,
}  # fmt: skip
SWITCHES["gemma3"] = {
    **GEMMA, "family": "gemma3_text", "qk_norm": True, "rope_theta": 1e6,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "local_rope_theta": 10000.0,
    "final_logit_softcapping": 5.0,
}  # fmt: skip


def family_model(name: str) -> DecoderOnly:
    shape = {"hidden_size": 64, "head_dim": 16, "intermediate_size": 128}
    config = DecoderConfig.preset("tiny", **{**shape, **SWITCHES[name]})
    torch.manual_seed(0)
    model = DecoderOnly(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
            elif pname.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
            else:
                p.copy_(0.5 + torch.rand(p.shape, generator=generator))
    return model


@pytest.fixture(
    scope="module",
    params=[(f, a) for f in SWITCHES for a in ("plain", "gqa")],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def exported(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> tuple[str, str, DecoderOnly, Path]:
    name, attention = request.param
    model = family_model(name)
    root = tmp_path_factory.mktemp(f"lm-{name}-{attention}") / "onnx"
    variants = ("fp32", "int8", "int4") if name.startswith("gemma") else ("fp32", "int8")
    export_lm_variants(model, root, variants, attention=attention)  # raises if off
    return name, attention, model, root


def test_fp32_decodes_as_torch_and_a_batch_as_each_prompt_alone(
    exported: tuple[str, str, DecoderOnly, Path],
) -> None:
    _, _, model, root = exported
    ours = Generator(open_lm_backend(model.config, root / "fp32"), IdTokenizer())
    torch_generator = Generator(TorchLMBackend(model), IdTokenizer())
    for options in (
        DecodingOptions(max_new_tokens=10),
        DecodingOptions(beam_size=3, num_hypotheses=2, max_new_tokens=8),
    ):
        batch = ours.generate(PROMPTS, options)
        expected = torch_generator.generate(PROMPTS, options)
        for prompt, got, want in zip(PROMPTS, batch, expected, strict=True):
            (alone,) = ours.generate([prompt], options)
            for a, b, c in zip(got.completions, want.completions, alone.completions, strict=True):
                assert a.token_ids == b.token_ids == c.token_ids
                assert a.score == pytest.approx(b.score, abs=1e-4)


@pytest.mark.parametrize("chunk", [512, 3])
def test_prefill_in_chunks_equals_torch(
    exported: tuple[str, str, DecoderOnly, Path], chunk: int
) -> None:
    """Chunks of 3 split the window across calls: the past's positions must still count."""
    _, _, model, root = exported
    backend = open_lm_backend(model.config, root / "fp32", provider="cpu", prefill_chunk=chunk)
    reference = TorchLMBackend(model)
    ids = np.zeros((len(PROMPTS), 10), dtype=np.int64)
    lengths = np.array([len(p) for p in PROMPTS], dtype=np.int64)
    for row, prompt in enumerate(PROMPTS):
        ids[row, : len(prompt)] = prompt
    state, expected_state = backend.encode(ids, lengths), reference.encode(ids, lengths)
    tokens = np.array([3, 4, 5, 6], dtype=np.int64)
    for _ in range(6):
        logits, state = backend.step(tokens, state)
        expected, expected_state = reference.step(tokens, expected_state)
        np.testing.assert_allclose(logits, expected, atol=1e-4)
        tokens = expected.argmax(-1)


def test_manifests_record_parity_and_the_attention(
    exported: tuple[str, str, DecoderOnly, Path],
) -> None:
    _, attention, model, root = exported
    fp32 = json.loads((root / "fp32" / "manifest.json").read_text())
    int8 = json.loads((root / "int8" / "manifest.json").read_text())
    assert fp32["parity"]["max_abs_log_prob_diff"] < 1e-4
    assert int8["parity"]["top1_agreement"] >= int8["parity"]["gate"]["top1_agreement"]
    manifests = [fp32, int8]
    if (root / "int4").is_dir():
        int4 = json.loads((root / "int4" / "manifest.json").read_text())
        assert int4["parity"]["top1_agreement"] >= int4["parity"]["gate"]["top1_agreement"]
        manifests.append(int4)
    cfg = model.config
    fallback = attention_fallback(cfg) if attention == "gqa" else None
    assert (fallback is not None) == (
        attention == "gqa"
        and (cfg.sliding_window is not None or cfg.attn_logit_softcapping is not None)
    )
    for manifest in manifests:
        options = manifest["options"]
        assert options["attention"] == attention
        assert options.get("attention_fallback") == fallback
    graph = onnx.load(str(root / "fp32" / "step.onnx"), load_external_data=False)
    ops = Counter(node.op_type for node in graph.graph.node)
    if (
        attention == "gqa"
    ):  # a windowed or capped layer keeps ONNX Runtime's node, others the kernel
        capped = cfg.attn_logit_softcapping is not None
        stock = sum(capped or cfg.window(i) is not None for i in range(cfg.num_layers))
        assert ops["GroupQueryAttention"] == stock
        assert ops["CausalGroupAttention"] == cfg.num_layers - stock
