"""The model's KV cache and row operations against full recomputation."""

from __future__ import annotations

import pytest
import torch

from attnserve.model.cache import EncoderState, KVCache
from attnserve.model.config import ModelConfig
from attnserve.model.layers import sinusoidal_table
from attnserve.model.transformer import EncoderDecoder


def make_model(**overrides) -> EncoderDecoder:
    torch.manual_seed(0)
    return EncoderDecoder(ModelConfig.preset("tiny", **overrides)).eval()


def padded_sources() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[5, 6, 7, 8, 9, 0], [10, 11, 0, 1, 1, 1], [12, 13, 14, 0, 1, 1]])
    return ids, ids != 1


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"norm_placement": "pre", "activation": "gelu"},
        {
            "activation": "swish",
            "shared_embeddings": False,
            "tied_output": False,
            "tgt_vocab_size": 48,
        },
        {"scale_embedding": False, "final_logits_bias": False},
    ],
)
def test_cached_steps_equal_full_recomputation(overrides: dict) -> None:
    model = make_model(**overrides)
    src, src_mask = padded_sources()
    tgt = torch.tensor([[1, 20, 21, 22, 23], [1, 30, 31, 32, 33], [1, 40, 41, 42, 43]])
    with torch.no_grad():
        full = model(src, src_mask, tgt, torch.ones_like(tgt, dtype=torch.bool))  # (B, T, V)
        state = model.encode(src, src_mask)
        cache = model.empty_cache(3)
        for t in range(tgt.shape[1]):
            logits, cache = model.decode_step(tgt[:, t], state, cache)
            torch.testing.assert_close(logits, full[:, t], atol=1e-5, rtol=1e-5)
    assert cache.length == tgt.shape[1]


def test_rows_joining_with_shorter_history_match_alone() -> None:
    """Left-padded caches: a row that joins late decodes exactly as it would alone."""
    model = make_model()
    src, src_mask = padded_sources()
    with torch.no_grad():
        state = model.encode(src, src_mask)
        alone = []
        for row in range(3):
            s = state.select(torch.tensor([row]))
            c = model.empty_cache(1)
            outs = []
            for token in [1, 20 + row, 30 + row]:
                logits, c = model.decode_step(torch.tensor([token]), s, c)
                outs.append(logits[0])
            alone.append(outs)
        # Row 0 runs two steps alone, then rows 1 and 2 join with empty caches.
        s0 = state.select(torch.tensor([0]))
        c0 = model.empty_cache(1)
        for token in [1, 20]:
            _, c0 = model.decode_step(torch.tensor([token]), s0, c0)
        joined_state = EncoderState.concat([s0, state.select(torch.tensor([1, 2]))])
        joined_cache = KVCache.concat([c0, model.empty_cache(2)])
        assert joined_cache.mask.tolist() == [[True, True], [False, False], [False, False]]
        logits, joined_cache = model.decode_step(
            torch.tensor([30, 1, 1]), joined_state, joined_cache
        )
        torch.testing.assert_close(logits[0], alone[0][2], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits[1], alone[1][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits[2], alone[2][0], atol=1e-5, rtol=1e-5)
        # Row 0 leaves: the columns only it used are trimmed away.
        rest = joined_cache.select(torch.tensor([1, 2]))
        assert rest.length == 1
        logits, _ = model.decode_step(
            torch.tensor([21, 22]), joined_state.select(torch.tensor([1, 2])), rest
        )
        torch.testing.assert_close(logits[0], alone[1][1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits[1], alone[2][1], atol=1e-5, rtol=1e-5)


def test_encoder_ignores_padding() -> None:
    model = make_model()
    src, src_mask = padded_sources()
    with torch.no_grad():
        batch = model.encode_hidden(src, src_mask)
        one = model.encode_hidden(src[1:2, :3], src_mask[1:2, :3])
    torch.testing.assert_close(batch[1:2, :3], one, atol=1e-5, rtol=1e-5)


def test_sinusoidal_table_is_marian_layout() -> None:
    table = sinusoidal_table(4, 8)
    assert torch.allclose(table[0, :4], torch.zeros(4))  # sin(0)
    assert torch.allclose(table[0, 4:], torch.ones(4))  # cos(0)
    assert table[1, 0] == pytest.approx(torch.sin(torch.tensor(1.0)).item())


def test_tied_and_shared_weights() -> None:
    model = make_model()
    assert model.lm_head.weight is model.src_embed.weight
    assert model.tgt_embed is model.src_embed
    untied = make_model(shared_embeddings=False, tied_output=False, tgt_vocab_size=48)
    assert untied.lm_head.weight is not untied.tgt_embed.weight
    assert untied.lm_head.out_features == 48


def test_config_validation_and_presets() -> None:
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="preset"):
        ModelConfig.preset("huge")
    with pytest.raises(ValueError, match="unknown ModelConfig fields"):
        ModelConfig.from_dict({"d_modle": 3})
    base = ModelConfig.preset("base")
    assert (base.d_model, base.n_heads, base.ffn_dim, base.encoder_layers) == (512, 8, 2048, 6)
    assert ModelConfig.from_dict(base.to_dict()) == base
