"""The families' switches in the exported step graph: q/k/v and output biases, per-head q/k norms
with a head size apart from hidden / heads, llama3 and yarn rotary scaling, a sliding window
(in some layers), Phi-3's partial rotation with LongRoPE and a window, dynamic NTK scaling,
Gemma 2's and Gemma 3's switches (norms of 1 + w around both branches, GELU-tanh, scaled
embeddings, query_pre_attn_scalar, attention and final soft caps, a second rotary base for the
windowed layers), and Gemma 3's with Phi-3's partial rotation and LongRoPE (the windowed layers'
own plain base beside the others' per-row frequencies), each exported with both attentions. fp32
equals torch (the export's own gate, plus decoded tokens here, prompts prefilled at once and in
chunks), int8 (and int4 for the length-dependent scalings and Gemma) passes its gate, a batch
decodes as each prompt alone, and a GroupQueryAttention graph that keeps ONNX Runtime's node (a
window; q and k rotated before the node; a soft cap) says why in its manifest."""

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
from attnserve.export.lm_export import (
    ROTARY_FALLBACK,
    SOFTCAP_FALLBACK,
    WINDOW_FALLBACK,
    export_lm_variants,
    gqa_fallback,
)
from attnserve.export.lm_graph import rotates_outside
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
    # LongRoPE switches at 8 positions: the longest prompt starts past it, the others cross it
    "phi3": {
        "family": "phi3", "rotary_dim": 12, "sliding_window": 6,
        "rope_scaling": {
            "rope_type": "longrope", "original_max_position_embeddings": 8,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 13.0],
        },
    },
    "dynamic": {
        "rope_scaling": {
            "rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8,
        },
    },
}  # fmt: skip
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
# both sides' rotary switches at once: Gemma 3's windowed layers rotate by their own plain base,
# the full-attention layer by LongRoPE's per-row frequencies, all over 12 of 16 channels
SWITCHES["gemma3-phi3"] = {
    **SWITCHES["gemma3"], "rotary_dim": 12,
    "rope_scaling": {**SWITCHES["phi3"]["rope_scaling"]},
}  # fmt: skip
# the models whose graphs take `rope_lengths` (a length-dependent scaling)
LENGTH_DEPENDENT = ("phi3", "dynamic", "gemma3-phi3")
# the variants exported beyond fp32 and int8
MORE_VARIANTS = {name: ("int4",) for name in (*LENGTH_DEPENDENT, "gemma2", "gemma3")}
# the models whose matrices are put on a Q4_1 grid (on_q4_1_grid)
ON_GRID = ("phi3", "dynamic")


def on_q4_1_grid(model: DecoderOnly) -> None:
    """Every matrix on a Q4_1 grid (per block of 32 inputs: w = d q + m, q in 0..15), as a GGUF
    file's weights are: what the int4 export keeps exactly, so its gate measures the rest
    (test_lm_export.test_int4_keeps_q4_1_weights)."""
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1 and p.shape[1] % 32 == 0:  # (out, in): blocks of 32 along `in`
                q = torch.randint(0, 16, p.shape, generator=generator).float()
                q[:, ::32], q[:, 1::32] = 0, 15  # every block spans its grid
                blocks = (p.shape[0], p.shape[1] // 32)
                d = torch.empty(blocks).uniform_(0.005, 0.02, generator=generator)
                m = torch.empty(blocks).uniform_(-0.2, 0.0, generator=generator)
                p.copy_(q * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1))


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
    if name in ON_GRID:
        on_q4_1_grid(model)
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
    variants = ("fp32", "int8", *MORE_VARIANTS.get(name, ()))
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
    name, attention, model, root = exported
    fp32 = json.loads((root / "fp32" / "manifest.json").read_text())
    int8 = json.loads((root / "int8" / "manifest.json").read_text())
    assert fp32["parity"]["max_abs_log_prob_diff"] < 1e-4
    assert int8["parity"]["top1_agreement"] >= int8["parity"]["gate"]["top1_agreement"]
    manifests = [fp32, int8]
    for variant in MORE_VARIANTS.get(name, ()):
        manifest = json.loads((root / variant / "manifest.json").read_text())
        assert manifest["parity"]["top1_agreement"] >= manifest["parity"]["gate"]["top1_agreement"]
        manifests.append(manifest)
    cfg = model.config
    fallback = gqa_fallback(cfg) if attention == "gqa" else None
    reasons = {  # every reason that applies is given, and only those
        WINDOW_FALLBACK: cfg.sliding_window is not None,
        ROTARY_FALLBACK: rotates_outside(cfg),
        SOFTCAP_FALLBACK: cfg.attn_logit_softcapping is not None,
    }
    for reason, applies in reasons.items():
        assert (fallback is not None and reason in fallback) == (attention == "gqa" and applies)
    assert (fallback is not None) == (attention == "gqa" and any(reasons.values()))
    for manifest in manifests:
        options = manifest["options"]
        assert options["attention"] == attention
        assert options.get("attention_fallback") == fallback
    graph = onnx.load(str(root / "fp32" / "step.onnx"), load_external_data=False)
    ops = Counter(node.op_type for node in graph.graph.node)
    inputs = {i.name for i in graph.graph.input}
    assert ("rope_lengths" in inputs) == (name in LENGTH_DEPENDENT)
    # a windowed or capped layer keeps ONNX Runtime's node, the others the kernel
    if attention == "gqa":
        capped = cfg.attn_logit_softcapping is not None
        kept = sum(capped or cfg.window(i) is not None for i in range(cfg.num_layers))
        if rotates_outside(cfg):  # q and k rotated before the node, which does not rotate
            kept = cfg.num_layers
        assert ops["GroupQueryAttention"] == kept
        assert ops["CausalGroupAttention"] == cfg.num_layers - kept
