"""Answers kept in the prefix cache (engine/prefix_cache.py, Scheduler._keep_answer): the next
turn of a conversation finds the previous answer's blocks cached, and its answer is the one it
gets without the cache and with the previous prompt's blocks only (greedy and seeded sampling,
token ids and logprobs; bit for bit on the GroupQueryAttention graph, whose decoding steps
write the very K/V a prefill of the same tokens writes). In a batch whose requests finish,
are cancelled and join at different steps (join padding, dead rows taken over, compaction,
a beam request's rows among them), each request's cached blocks are a fresh prefill's of the
tokens its row was fed: its prompt and every generated token but the last."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attnserve.engine.onnx.lm_open import open_lm_backend
from attnserve.engine.options import DecodingOptions
from attnserve.engine.prefix_cache import PrefixCache
from attnserve.engine.scheduler import Outcome, Request, lm_request
from attnserve.engine.search import GreedySearch
from attnserve.model.decoder_only import DecoderOnly
from tests.engine import test_prefix_cache as prompts
from tests.engine.test_prefix_cache import (
    BACKENDS,
    BLOCK,
    CONFIG,
    SYSTEM,
    backend_of,
    run,
    scheduler,
    tokens,
)

model = prompts.model  # the fixtures: the same tiny model, exported to both graphs
exported = prompts.exported

ANSWER = 20  # tokens of the first turn's answer
OPTIONS = {
    "greedy": DecodingOptions(max_new_tokens=ANSWER, min_new_tokens=ANSWER, logprobs=2),
    "sampling": DecodingOptions(
        max_new_tokens=ANSWER, min_new_tokens=ANSWER, sampling=True, temperature=0.9, seed=7,
        logprobs=2,
    ),
}  # fmt: skip


# Logprobs of a turn with cached blocks against the same turn without (default 1e-4): the
# GroupQueryAttention graph's are the same bits; the plain graph's softmax sums cached and new
# columns in another order, and its int4 products quantize their inputs, which turns a last-bit
# difference into a quantization step now and then (so with cached prompts alone, too). Without
# attnserve's integer kernels (AVX-512 VNNI) the int4 products are a float GEMM whose sums follow
# the number of rows (last bits), and the plain graph's int8 products meet the int4 ones' case.
TOLERANCE = {f"gqa-{v}": 0.0 for v in ("fp32", "int8", "int4")} | {"plain-int4": 0.05}
if not prompts.EXACT_INT4:
    TOLERANCE |= {"gqa-int4": 1e-4, "plain-int8": 0.05}


def outputs(request: Request) -> list[tuple[tuple[int, ...], Any]]:
    return [(h.tokens, h.logprobs) for h in request.hypotheses]


def same_outputs(got: Request, expected: Request, tolerance: float) -> None:
    """The same tokens, and logprobs bit for bit (`tolerance` 0) or to `tolerance`."""
    if tolerance == 0:
        assert outputs(got) == outputs(expected)
        return
    for (tokens_got, scores_got), (tokens_expected, scores_expected) in zip(
        outputs(got), outputs(expected), strict=True
    ):
        assert tokens_got == tokens_expected
        assert [s.token for s in scores_got] == [s.token for s in scores_expected]
        np.testing.assert_allclose(
            [s.logprob for s in scores_got], [s.logprob for s in scores_expected], atol=tolerance
        )


def fed(request: Request) -> list[int]:
    """The tokens a single-sequence request's row was fed: its prompt and its answer but the
    last token (the stop token, or the last of `max_new_tokens`, never goes in)."""
    search = request.search
    assert isinstance(search, GreedySearch)
    return [*request.prefix, *search.tokens][: len(request.source) + search.steps]


def assert_cached_as_prefilled(backend: Any, cache: PrefixCache, request: Request) -> None:
    """The pool holds the full blocks of the tokens the request's row was fed, and none past
    them: the numbers a fresh prefill of those tokens writes (GroupQueryAttention: the same
    bits)."""
    sequence = fed(request)
    n = len(sequence) // BLOCK * BLOCK
    search = request.search
    assert isinstance(search, GreedySearch)
    beyond = [*request.prefix, *search.tokens, *[0] * BLOCK]  # the unfed token, and more
    assert cache.lookup(beyond).tokens == n
    hit = cache.lookup(sequence)
    assert hit.tokens == n and hit.columns is not None
    fresh = backend.encode(np.array([sequence]), np.array([len(sequence)]))
    whole = backend.prefix_columns(fresh, 0, n)
    if getattr(backend, "attention", None) == "gqa":
        assert np.array_equal(hit.columns, whole)
    else:
        np.testing.assert_allclose(hit.columns, whole, atol=1e-4)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("search", list(OPTIONS))
def test_a_conversations_next_turn_reuses_the_answer(
    name: str, search: str, model: DecoderOnly, exported: Path
) -> None:
    """Turn 2's prompt is turn 1's, its answer and a new message: its answer is the same
    with no cache, with turn 1's prompt cached and with turn 1's answer cached too, and
    `cached_tokens` counts the answer's full blocks."""
    backend = backend_of(name, model, exported)
    options = OPTIONS[search]
    turn1 = [*SYSTEM, *tokens(6, 1)]
    (first,) = run(scheduler(backend, None), [lm_request("t1", turn1, options)])
    answer = list(first.hypotheses[0].tokens)
    assert len(answer) == ANSWER
    turn2 = [*turn1, *answer, *tokens(9, 2)]
    (alone,) = run(scheduler(backend, None), [lm_request("alone", turn2, options)])

    prompt_only = PrefixCache(1 << 24, block=BLOCK)  # turn 1 fed its prompt alone
    sched = scheduler(backend, prompt_only)
    run(sched, [lm_request("t1", turn1, DecodingOptions(max_new_tokens=1))])
    (after_prompt,) = run(sched, [lm_request("t2", turn2, options)])

    cache = PrefixCache(1 << 24, block=BLOCK)
    sched = scheduler(backend, cache)
    (again,) = run(sched, [lm_request("t1", turn1, options)])
    assert outputs(again) == outputs(first)
    (reused,) = run(sched, [lm_request("t2", turn2, options)])

    assert after_prompt.cached_tokens == 40  # turn 1's prompt but its last token: 5 blocks
    # turn 1's prompt and answer but the answer's last token (never fed): 62 tokens, 7 blocks
    assert reused.cached_tokens == (len(turn1) + ANSWER - 1) // BLOCK * BLOCK == 56
    tolerance = TOLERANCE.get(name, 1e-4)
    same_outputs(after_prompt, alone, tolerance)
    same_outputs(reused, alone, tolerance)


@pytest.mark.parametrize("name", ["gqa-fp32", "gqa-int4", "plain-fp32", "plain-int8", "torch"])
def test_rows_that_leave_at_different_steps_keep_their_own_columns(
    name: str, model: DecoderOnly, exported: Path
) -> None:
    """Requests of different lengths finish at different steps, one is cancelled, others
    join the running batch on the way (into dead rows, or padded: shorter and longer than its
    rows, one after a cached prefix), a beam request holds rows between them: each greedy or
    sampling request's cached blocks are a fresh prefill's of what its row was fed; the
    beam's answer is not kept."""
    backend = backend_of(name, model, exported)
    cache = PrefixCache(1 << 24, block=BLOCK)
    sched = scheduler(backend, cache)

    def greedy(n: int) -> DecodingOptions:
        return DecodingOptions(max_new_tokens=n, min_new_tokens=n)

    sampled = DecodingOptions(
        max_new_tokens=30, min_new_tokens=30, sampling=True, temperature=0.9, seed=3
    )
    first = [
        lm_request("a", [*SYSTEM, *tokens(5, 20)], greedy(9)),
        lm_request("b", tokens(23, 21), greedy(25)),
        lm_request("beam", tokens(30, 22), DecodingOptions(max_new_tokens=16, beam_size=3)),
        lm_request("c", tokens(41, 23), sampled),
        lm_request("d", tokens(21, 24), greedy(40)),  # cancelled after 6 steps, in row 1
        lm_request("h", tokens(19, 28), greedy(35)),
        lm_request("i", tokens(27, 29), greedy(33)),
    ]
    for request in first:
        sched.submit(request)
    for _ in range(6):
        sched.step()
    sched.cancel("d")
    for _ in range(5):  # "a" finishes at the 9th
        sched.step()
    assert first[0].outcome is Outcome.DONE and first[4].outcome is Outcome.CANCELLED
    (cohort,) = sched.cohorts
    assert cohort.dead_rows == 2
    joining = [
        lm_request("e", tokens(9, 25), greedy(20)),  # shorter than the running rows
        lm_request("f", [*SYSTEM, *tokens(30, 26)], greedy(14)),  # after a cached prefix
    ]
    for request in joining:
        sched.submit(request)
    sched.step()
    assert joining[1].cached_tokens == 32
    for _ in range(3):
        sched.step()
    last = lm_request("g", tokens(70, 27), greedy(11))  # longer than any running row
    sched.submit(last)
    sched.step()
    assert sched.cohorts == [cohort]
    assert all(r.outcome is None for r in [*joining, last])
    run(sched, [])
    requests = [*first, *joining, last]
    assert all(r.outcome is Outcome.DONE for r in requests if r.id != "d")
    for request in requests:
        if request.id == "beam":
            sequence = [*request.prefix, *request.hypotheses[0].tokens]
            assert cache.lookup(sequence).tokens == len(request.source) // BLOCK * BLOCK
        else:
            assert_cached_as_prefilled(backend, cache, request)


def test_stop_tokens_stop_strings_and_a_full_pool(model: DecoderOnly, exported: Path) -> None:
    """An answer that ends with a stop token keeps its last generated token (fed) but not the
    stop token; one that ends with a stop string not the token completing it; a pool smaller
    than a sequence keeps that sequence's first blocks and reads no more of its row."""
    directory = exported / "gqa" / "fp32"
    backend = backend_of("gqa-fp32", model, exported)
    prompt = [*SYSTEM, *tokens(4, 30)]
    options = DecodingOptions(max_new_tokens=30)
    (probe,) = run(scheduler(backend, None), [lm_request("p", prompt, options)])
    answer = list(probe.hypotheses[0].tokens)
    assert len(answer) == 30
    stop_at = next(i for i in range(10, 30) if answer[i] not in answer[:i])
    stopping = open_lm_backend(CONFIG, directory, provider="cpu", threads=1,
                               stop_ids=(answer[stop_at],))  # fmt: skip
    cache = PrefixCache(1 << 24, block=BLOCK)
    (stopped,) = run(scheduler(stopping, cache), [lm_request("s", prompt, options)])
    hypothesis = stopped.hypotheses[0]
    assert hypothesis.ended_with_eos and list(hypothesis.tokens) == answer[:stop_at]
    assert fed(stopped) == [*prompt, *answer[:stop_at]]
    assert_cached_as_prefilled(backend, cache, stopped)

    cache = PrefixCache(1 << 24, block=BLOCK)
    request = lm_request("t", prompt, options, stopper=lambda t: len(t) == 13)
    (ended,) = run(scheduler(backend, cache), [request])
    assert ended.hypotheses[0].stopped and len(ended.hypotheses[0].tokens) == 13
    assert fed(ended) == [*prompt, *answer[:12]]
    assert_cached_as_prefilled(backend, cache, ended)

    small = PrefixCache(3 * cache.block_bytes, block=BLOCK)
    sched = scheduler(backend, small)
    run(sched, [lm_request("w", tokens(10, 31), DecodingOptions(max_new_tokens=1))])
    assert small.block_bytes == cache.block_bytes  # known from now on
    reads: list[tuple[int, int]] = []
    read = backend.prefix_columns

    def counted(state: Any, row: int, n: int, start: int = 0) -> Any:
        reads.append((start, n))
        return read(state, row, n, start)

    backend.prefix_columns = counted  # type: ignore[method-assign]
    run(sched, [lm_request("u", prompt, options)])
    del backend.prefix_columns
    assert small.snapshot().blocks == 3 and small.lookup(fed(probe)).tokens == 3 * BLOCK
    # the prompt's 5 blocks capped to 3 at admission; its answer's 8: the same 3, none read
    assert reads == [(0, 3 * BLOCK)]
