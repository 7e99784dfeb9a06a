"""Decoding through the torch backend: cached == uncached, batched == one by one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnserve.engine.options import DecodingOptions
from attnserve.engine.torch_backend import TorchBackend
from attnserve.engine.translator import decode_batch
from attnserve.model.config import ModelConfig
from attnserve.model.transformer import EncoderDecoder
from tests.engine.fakes import UncachedTorchBackend

SOURCES = [[5, 6, 7, 8, 9, 10, 0], [11, 12, 0], [13, 14, 15, 16, 0], [17, 0]]
OPTIONS = [
    DecodingOptions(max_new_tokens=12),
    DecodingOptions(beam_size=4, num_hypotheses=3, max_new_tokens=12),
    DecodingOptions(beam_size=3, length_penalty=0.6, no_repeat_ngram_size=2, max_new_tokens=12),
    DecodingOptions(sampling=True, seed=11, top_k=10, top_p=0.9, max_new_tokens=12),
]


@pytest.fixture(scope="module")
def model() -> EncoderDecoder:
    torch.manual_seed(1)
    cfg = ModelConfig.preset("tiny", vocab_size=40)
    model = EncoderDecoder(cfg).eval()
    with torch.no_grad():  # make EOS unlikely early so outputs have some length
        assert model.logits_bias is not None
        model.logits_bias[cfg.eos_id] = -2.0
    return model


def tokens(nbest) -> list[list[tuple[int, ...]]]:
    return [[h.tokens for h in hyps] for hyps in nbest]


@pytest.mark.parametrize("options", OPTIONS, ids=["greedy", "beam4", "beam3-lp-ngram", "sampling"])
def test_cached_equals_uncached(model: EncoderDecoder, options: DecodingOptions) -> None:
    cached = decode_batch(TorchBackend(model), SOURCES, [options] * len(SOURCES))
    uncached = decode_batch(UncachedTorchBackend(model), SOURCES, [options] * len(SOURCES))
    assert tokens(cached) == tokens(uncached)
    for a, b in zip(cached, uncached, strict=True):
        np.testing.assert_allclose([h.score for h in a], [h.score for h in b], atol=1e-5)
    assert any(len(h[0].tokens) > 2 for h in cached)


def test_step_log_probs_equal_uncached(model: EncoderDecoder) -> None:
    """Per-step log-probs of the cached backend match full recomputation (allclose 1e-5)."""
    cached, uncached = TorchBackend(model), UncachedTorchBackend(model)
    from attnserve.engine.backend import pad_batch

    ids, lengths = pad_batch(SOURCES, model.config.pad_id)
    sc, su = cached.encode(ids, lengths), uncached.encode(ids, lengths)
    tokens_ = np.full(len(SOURCES), model.config.start_id)
    rng = np.random.default_rng(0)
    for _ in range(6):
        lc, sc = cached.step(tokens_, sc)
        lu, su = uncached.step(tokens_, su)
        np.testing.assert_allclose(lc, lu, atol=1e-5, rtol=1e-5)
        tokens_ = rng.integers(2, 40, size=len(SOURCES))


@pytest.mark.parametrize("options", OPTIONS, ids=["greedy", "beam4", "beam3-lp-ngram", "sampling"])
def test_batch_equals_one_by_one(model: EncoderDecoder, options: DecodingOptions) -> None:
    backend = TorchBackend(model)
    together = decode_batch(backend, SOURCES, [options] * len(SOURCES))
    alone = [decode_batch(backend, [src], [options])[0] for src in SOURCES]
    assert tokens(together) == tokens(alone)
    for a, b in zip(together, alone, strict=True):
        np.testing.assert_allclose([h.score for h in a], [h.score for h in b], atol=1e-5)


def test_mixed_requests_in_one_batch(model: EncoderDecoder) -> None:
    """Greedy, beam and sampling requests share a batch and each gets its own answer."""
    backend = TorchBackend(model)
    mixed = decode_batch(backend, SOURCES, OPTIONS)
    alone = [decode_batch(backend, [s], [o])[0] for s, o in zip(SOURCES, OPTIONS, strict=True)]
    assert tokens(mixed) == tokens(alone)
