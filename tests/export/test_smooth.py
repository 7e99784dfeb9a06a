"""SmoothQuant: the smoothed model computes the same function, and its activations lose their
outlier channels (what per-row int8 needs)."""

from __future__ import annotations

import torch

from attnserve.export.smooth import activation_maxima, smooth
from attnserve.model.decoder_config import DecoderConfig
from attnserve.model.decoder_only import DecoderOnly

PROMPTS = [[5, 17, 33, 8, 91, 40, 12], [7, 64, 3], [1, 9, 88, 23, 4, 4, 4, 4]]


def with_outliers() -> DecoderOnly:
    """A tiny model whose norms blow up two channels 50x (as real language models' do)."""
    torch.manual_seed(0)
    model = DecoderOnly(DecoderConfig.preset("tiny", tie_embeddings=True)).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
        for layer in model.layers:
            layer.input_layernorm.weight[[3, 17]] = 50.0
            layer.post_attention_layernorm.weight[[5]] = 40.0
    return model


def logits(model: DecoderOnly, prompt: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        return model(ids, torch.ones_like(ids, dtype=torch.bool))


def test_smoothing_keeps_the_function_and_the_input_embedding() -> None:
    model = with_outliers()
    smoothed = smooth(model, activation_maxima(model, PROMPTS), alpha=0.5)
    for prompt in [*PROMPTS, [44, 45, 46]]:
        torch.testing.assert_close(
            logits(smoothed, prompt), logits(model, prompt), atol=2e-4, rtol=1e-4
        )
    assert torch.equal(smoothed.embed_tokens.weight, model.embed_tokens.weight)
    assert smoothed.lm_head.weight is not smoothed.embed_tokens.weight  # the head is untied
    assert model.layers[0].input_layernorm.weight[3] == 50.0  # the original is unchanged


def test_smoothing_flattens_the_outlier_channels() -> None:
    model = with_outliers()
    before = activation_maxima(model, PROMPTS)
    smoothed = smooth(model, before, alpha=0.5)
    after = activation_maxima(smoothed, PROMPTS)

    def spread(maxima: torch.Tensor) -> float:  # largest channel / median channel
        return float(maxima.max() / maxima.median())

    for name in ("layers.0.self_attn.q_proj", "layers.1.mlp.gate_proj", "layers.0.mlp.down_proj"):
        assert spread(after[name]) < spread(before[name]) / 2


def test_smoothing_in_place_smooths_the_model_itself() -> None:
    model, copy = with_outliers(), with_outliers()
    maxima = activation_maxima(model, PROMPTS)
    expected = smooth(copy, maxima, alpha=0.5)
    assert smooth(model, maxima, alpha=0.5, in_place=True) is model
    for name, tensor in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
