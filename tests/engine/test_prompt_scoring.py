"""Prompt logprobs: the scheduler scores a prompt while it prefills it, and the scores are the
model's teacher-forced log-probs (log_softmax of one full forward over the prompt), on the torch
backend and on both ONNX graphs, the same in any batch as alone, across scoring chunks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from attnserve.engine.onnx.lm_backend import PromptScoringUnsupported
from attnserve.engine.onnx.lm_open import open_lm_backend
from attnserve.engine.options import DecodingOptions
from attnserve.engine.scheduler import Outcome, Request, Scheduler, SchedulerLimits, lm_request
from attnserve.engine.scoring import score_positions, score_tokens
from attnserve.engine.torch_lm import TorchLMBackend
from attnserve.export.lm_export import export_lm_variants
from attnserve.model.decoder_config import DecoderConfig
from attnserve.model.decoder_only import DecoderOnly

# The log-prob difference an fp32 graph may have from torch (export's fp32 gate is ~1e-4).
FP32_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model() -> DecoderOnly:
    config = DecoderConfig.preset("tiny", max_positions=256, eos_ids=(2,), head_dim=16)
    torch.manual_seed(0)
    model = DecoderOnly(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model


@pytest.fixture(scope="module")
def graphs(model: DecoderOnly, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("scored-lm")
    for attention in ("plain", "gqa"):
        export_lm_variants(model, root / attention, ("fp32",), attention=attention)
    return root


@pytest.fixture(scope="module", params=["torch", "onnx-gqa", "onnx-plain", "onnx-plain-io"])
def backend(request: pytest.FixtureRequest, model: DecoderOnly, graphs: Path) -> Any:
    if request.param == "torch":
        return TorchLMBackend(model)
    attention = request.param.split("-")[1]
    io_binding = request.param.endswith("-io")
    return open_lm_backend(
        model.config, graphs / attention / "fp32", provider="cpu", io_binding=io_binding
    )


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (length,), generator=g).tolist()


def teacher_forced(model: DecoderOnly, tokens: list[int]) -> np.ndarray:
    """log_softmax of one full forward over the prompt: (T - 1, V), position t scoring t + 1."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(ids, torch.ones_like(ids))[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1].numpy()


def run(scheduler: Scheduler, *requests: Request) -> None:
    for request in requests:
        scheduler.submit(request)
    for _ in range(500):
        if not scheduler.has_work:
            return
        scheduler.step()
    raise AssertionError("the scheduler did not finish")


def scored(top: int = 3, **options: Any) -> DecodingOptions:
    return DecodingOptions(max_new_tokens=4, prompt_logprobs=top, logprobs=1, **options)


def test_prompt_logprobs_are_the_teacher_forced_scores(backend: Any, model: DecoderOnly) -> None:
    tokens = prompt(40, 1)
    # chunks of 16 tokens: the scores of later chunks read the cache of earlier ones
    scheduler = Scheduler(backend, SchedulerLimits(max_new_tokens=4, prefill_chunk=16))
    request = lm_request("p", tokens, scored())
    run(scheduler, request)
    assert request.outcome is Outcome.DONE
    got = request.prompt_logprobs
    assert got is not None and len(got) == len(tokens) and got[0] is None
    expected = teacher_forced(model, tokens)
    for position, entry in enumerate(got[1:]):
        assert entry is not None and entry.token == tokens[position + 1]
        row = expected[position]
        assert entry.logprob == pytest.approx(float(row[entry.token]), abs=FP32_TOLERANCE)
        assert entry.rank == 1 + int((row > row[entry.token]).sum())
        best = np.argsort(-row, kind="stable")[:3]
        assert [t for t, _ in entry.top] == best.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(row[best].tolist(), abs=FP32_TOLERANCE)
    # and the generated tokens are those of the same request without scores
    plain = lm_request("q", tokens, DecodingOptions(max_new_tokens=4, logprobs=1))
    run(Scheduler(backend, SchedulerLimits(max_new_tokens=4, prefill_chunk=16)), plain)
    assert request.hypotheses[0].tokens == plain.hypotheses[0].tokens


def test_a_batch_scores_each_prompt_as_alone(backend: Any) -> None:
    """Scored requests among others (short, chunked, sampled, beams) arriving together and
    joining a running batch: each gets the scores and tokens it gets alone, bit for bit."""
    limits = SchedulerLimits(max_new_tokens=6, prefill_chunk=12, max_join_padding=10**6)
    cases = [
        (prompt(30, 2), scored(top=2)),
        (prompt(5, 3), DecodingOptions(max_new_tokens=6)),
        (prompt(20, 4), scored(top=0, sampling=True, seed=7)),
        (prompt(1, 5), scored(top=1)),  # nothing to score but the first token's null
        (prompt(26, 6), DecodingOptions(max_new_tokens=6, beam_size=2)),
        (prompt(9, 7), scored(top=4)),
    ]

    def requests(tag: str) -> list[Request]:
        return [lm_request(f"{tag}{i}", t, o) for i, (t, o) in enumerate(cases)]

    alone = requests("alone")
    for request in alone:
        run(Scheduler(backend, limits), request)
    together = requests("batch")
    scheduler = Scheduler(backend, limits)
    scheduler.submit(lm_request("early", prompt(12, 8), DecodingOptions(max_new_tokens=6)))
    scheduler.step()  # a running batch the others join
    run(scheduler, *together)
    for a, b in zip(alone, together, strict=True):
        assert a.outcome is b.outcome is Outcome.DONE
        assert b.prompt_logprobs == a.prompt_logprobs
        assert [h.tokens for h in b.hypotheses] == [h.tokens for h in a.hypotheses]
    assert together[3].prompt_logprobs == [None]
    assert together[1].prompt_logprobs is None


def test_score_positions_ranks_and_ties() -> None:
    logits = np.array([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 5.0]], dtype=np.float32)
    first, second = score_positions(logits, [3, 1], top=2)
    assert first.token == 3 and first.rank == 3  # two tokens are more likely
    assert [t for t, _ in first.top] == [1, 2]  # a tie goes to the lower id
    assert second.rank == 4 and [t for t, _ in second.top] == [0, 2]
    total = np.log(np.exp(logits[1]).sum())
    assert second.logprob == pytest.approx(-1.0 - total, abs=1e-6)
    assert score_positions(logits[:0], [], top=2) == []
    assert score_tokens(49152) == 341 and score_tokens(49152, 128) == 128
    assert score_tokens(10**9) == 1


def test_a_graph_that_cannot_score_refuses(graphs: Path, model: DecoderOnly) -> None:
    backend = open_lm_backend(model.config, graphs / "gqa" / "fp32", provider="cpu")
    backend.scores_prompts = False  # as a graph exported before `logit_positions`
    ids = np.array([[5, 6, 7]], dtype=np.int64)
    with pytest.raises(PromptScoringUnsupported):
        backend.extend(backend.empty(1), ids, np.ones_like(ids), all_positions=True)
    request = lm_request("x", prompt(6, 9), scored())
    run(Scheduler(backend), request)
    assert request.outcome is Outcome.FAILED and "score prompts" in str(request.error)
