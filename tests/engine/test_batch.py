"""RunningBatch keeps the rows of finished requests as dead rows until copying them out pays."""

from __future__ import annotations

import dataclasses
import itertools
import random
from typing import Any

import numpy as np
import pytest

from attnserve.engine.backend import Candidates
from attnserve.engine.batch import RunningBatch, encoder_chunks
from attnserve.engine.options import DecodingOptions
from attnserve.engine.search import make_search
from attnserve.engine.translator import decode_batch
from tests.engine.fakes import TableBackend, best_tokens

V = 4
EOS, A = 0, 2


def count_of_first(src: tuple[int, ...], prefix: tuple[int, ...]) -> list[float]:
    """src[0] tokens A, then EOS."""
    return [1.0, 0, 0, 0] if len(prefix) >= src[0] else [0.1, 0, 0.9, 0]


class CountingBackend(TableBackend):
    def __init__(self) -> None:
        super().__init__(count_of_first, V)
        self.selects: list[list[int]] = []

    def select(self, state: list, rows: Any) -> list:
        self.selects.append([int(r) for r in rows])
        return super().select(state, rows)


def test_finished_rows_stay_dead_until_a_quarter_of_the_batch() -> None:
    backend = CountingBackend()
    batch: RunningBatch[Any] = RunningBatch(backend)
    lengths = [1, 2, 6, 6, 6, 6, 6, 6]  # 8 greedy rows; the first two end at steps 2 and 3
    opts = DecodingOptions(max_new_tokens=8)
    searches = [make_search(opts, backend.spec) for _ in lengths]
    batch.join(searches, batch.encode([[n, EOS] for n in lengths]))
    finished = [[searches.index(s) for s in batch.step()] for _ in range(3)]
    assert finished == [[], [0], [1]]
    # Step 3 still decoded the dead row of request 0 (1/8 dead); two dead rows (1/4) are
    # dropped in one copy after step 3.
    assert backend.step_rows == [8, 8, 8]
    assert backend.selects == [[2, 3, 4, 5, 6, 7]]
    assert batch.num_rows == 6 and batch.dead_rows == 0
    while len(batch):
        batch.step()
    alone = decode_batch(TableBackend(count_of_first, V), [[n, EOS] for n in lengths], [opts] * 8)
    assert [s.hypotheses()[0].tokens for s in searches] == [h[0].tokens for h in alone]
    assert searches[0].hypotheses()[0].tokens == (A,)


def test_removed_rows_stay_dead_when_requests_join() -> None:
    backend = CountingBackend()
    batch: RunningBatch[Any] = RunningBatch(backend)
    opts = DecodingOptions(max_new_tokens=8)
    first = [make_search(opts, backend.spec) for _ in range(8)]
    batch.join(first, batch.encode([[6, EOS]] * 8))
    batch.step()
    batch.remove(first[:1])  # cancelled: a dead row, no copy
    assert backend.selects == [] and batch.num_rows == 7 and batch.dead_rows == 1
    late = make_search(opts, backend.spec)
    batch.join([late], batch.encode([[1, EOS]]))
    batch.step()
    assert backend.selects == [] and batch.dead_rows == 1 and backend.step_rows == [8, 9]
    assert len(batch) == 8 and late.tokens == [A]


def test_dead_rows_leave_before_they_would_pass_the_last_position() -> None:
    """Dead rows are still stepped, so an early request's dead row can outgrow the positions
    of the rows that joined after it: it must leave before its position passes the last."""
    backend = CountingBackend()
    backend._spec = dataclasses.replace(backend.spec, max_positions=12)
    batch: RunningBatch[Any] = RunningBatch(backend)
    opts = DecodingOptions(max_new_tokens=12)
    early = make_search(opts, backend.spec)
    batch.join([early], batch.encode([[10, EOS]]))  # ends after 11 steps
    batch.step()
    batch.step()
    late = [make_search(opts, backend.spec) for _ in range(7)]  # 12 steps each
    batch.join(late, batch.encode([[11, EOS]] * 7))
    while len(batch):
        batch.step()
    # The early row died after step 11 (1 of 8 rows) and was stepped at position 11 in step
    # 12; it was dropped before step 13 would have used position 12.
    assert backend.step_rows == [1, 1] + [8] * 10 + [7, 7]
    assert backend.selects == [list(range(1, 8))]
    assert all(s.hypotheses()[0].tokens == (A,) * 11 for s in late)


def test_a_failed_search_counts_the_step_its_rows_ran() -> None:
    """A search that raises has not counted the step the backend ran for its rows: the batch
    counts it, or the dead row would step past the last position one step late."""
    backend = CountingBackend()
    backend._spec = dataclasses.replace(backend.spec, max_positions=12)
    batch: RunningBatch[Any] = RunningBatch(backend)
    opts = DecodingOptions(max_new_tokens=12)
    early = make_search(opts, backend.spec)
    real_step = early.step

    def failing_step(log_probs: Any) -> Any:
        if early.steps == 2:
            raise RuntimeError("bad request")
        return real_step(log_probs)

    early.step = failing_step  # type: ignore[method-assign]
    batch.join([early], batch.encode([[10, EOS]]))
    batch.step()
    batch.step()
    late = [make_search(opts, backend.spec) for _ in range(7)]
    batch.join(late, batch.encode([[11, EOS]] * 7))
    while len(batch):
        batch.step()
    # `early` failed in step 3 (its rows ran 3 steps, its search counted 2); dead, its row
    # reached position 12 after step 12 and left before step 13.
    assert isinstance(early.error, RuntimeError) and early.error.__traceback__ is None
    assert backend.step_rows == [1, 1] + [8] * 10 + [7, 7]


def _brute_force_chunks(lengths: list[int], call_tokens: int) -> float:
    """The least cost over every split of `lengths` into runs (2^(n-1) of them)."""
    n = len(lengths)
    best = float("inf")
    for mask in range(1 << (n - 1)):
        cuts = [0] + [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
        cost = sum(call_tokens + (b - a) * max(lengths[a:b]) for a, b in itertools.pairwise(cuts))
        best = min(best, cost)
    return best


def test_encoder_chunks_are_the_cheapest_split() -> None:
    rng = random.Random(0)
    for _ in range(200):
        lengths = sorted(rng.randint(1, 80) for _ in range(rng.randint(1, 9)))
        if rng.random() < 0.5:
            lengths.reverse()
        call = rng.choice([0, 4, 16, 64])
        runs = encoder_chunks(lengths, call)
        assert [a for a, _ in runs] == [0] + [b for _, b in runs[:-1]]  # contiguous
        assert runs[-1][1] == len(lengths)
        cost = sum(call + (b - a) * max(lengths[a:b]) for a, b in runs)
        assert cost == _brute_force_chunks(lengths, call)
    assert encoder_chunks([], 16) == []
    assert encoder_chunks([10] * 20, 16) == [(0, 20)]  # equal lengths: one call
    assert encoder_chunks([3, 4, 60, 61], 16) == [(0, 2), (2, 4)]


def test_mixed_lengths_are_encoded_in_buckets_in_the_callers_order() -> None:
    backend = CountingBackend()
    calls: list[tuple[int, int]] = []
    encode = backend.encode

    def counting(ids: Any, lengths: Any) -> Any:
        calls.append(ids.shape)
        return encode(ids, lengths)

    backend.encode = counting  # type: ignore[method-assign]
    batch: RunningBatch[Any] = RunningBatch(backend)
    sources = [[1] * 40, [2] * 3, [3] * 41, [4] * 2]  # neither ascending nor descending
    state = batch.encode(sources)
    assert sorted(calls) == [(2, 3), (2, 41)]  # two buckets instead of 4 x 41 positions
    assert [src[0] for src, _ in state] == [1, 2, 3, 4]
    assert backend.selects == [[2, 1, 3, 0]]  # back to the caller's order: one copy
    backend.selects.clear()
    batch.encode(sorted(sources, key=len))  # sorted by the caller: no reordering copy
    assert backend.selects == []
    # A backend whose calls cost more than these sources' padding encodes them in one call.
    backend.encode_call_tokens = 1024  # type: ignore[attr-defined]
    calls.clear()
    assert [src[0] for src, _ in batch.encode(sources)] == [1, 2, 3, 4]
    assert calls == [(4, 41)]
    with pytest.raises(ValueError, match="at least one source"):
        batch.encode([])


class BestTokensBackend(TableBackend):
    """A table backend that also returns each row's k best tokens (as the ONNX decoder's TopK:
    stable, ties to the lower id), and records the k of every step (0: whole rows)."""

    def __init__(self, table: Any, vocab_size: int) -> None:
        super().__init__(table, vocab_size)
        self.candidates = True
        self.ks: list[int] = []

    def step(self, tokens: Any, state: list) -> tuple[Any, list]:
        self.ks.append(0)
        return super().step(tokens, state)

    def step_candidates(self, tokens: Any, state: list, k: int) -> tuple[Candidates, list]:
        log_probs, grown = super().step(tokens, state)
        assert 0 < k <= self.spec.vocab_size
        self.ks.append(k)
        return best_tokens(log_probs, k), grown


def noisy_table(src: tuple[int, ...], prefix: tuple[int, ...]) -> list[float]:
    """A random distribution over 12 tokens per (source, prefix), with ties; EOS likelier with
    length."""
    rng = np.random.default_rng(hash((src, prefix)) % 2**32)
    probs = rng.integers(1, 6, size=12).astype(np.float64)
    probs[0] += len(prefix)
    return list(probs / probs.sum())


def test_best_tokens_decode_as_whole_rows_with_joins_removals_and_dead_rows() -> None:
    """Greedy and beam requests (with a min length, so EOS is banned for a while) decode from
    the backend's best tokens, the same as from whole rows, while requests finish (dead rows),
    are removed and join mid-way; a sampling request in the batch makes every step read whole
    rows until it leaves. k is the largest any search wants (beam 4: 8, + the banned pad)."""
    options = [
        DecodingOptions(beam_size=4, num_hypotheses=3, max_new_tokens=9),
        DecodingOptions(max_new_tokens=9, min_new_tokens=3),
        DecodingOptions(beam_size=2, max_new_tokens=6, length_penalty=0.5),
        DecodingOptions(max_new_tokens=4),
    ]
    late = [DecodingOptions(beam_size=3, max_new_tokens=7), DecodingOptions(max_new_tokens=8)]
    sampling = DecodingOptions(sampling=True, seed=5, max_new_tokens=3)

    def run(backend: TableBackend, with_sampling: bool) -> list[Any]:
        batch: RunningBatch[Any] = RunningBatch(backend)
        first = [make_search(o, backend.spec) for o in options]
        if with_sampling:
            first.append(make_search(sampling, backend.spec))
        batch.join(first, batch.encode([[5 + i, EOS] for i in range(len(first))]))
        batch.step()
        batch.step()
        batch.remove(first[3:4])
        joined = [make_search(o, backend.spec) for o in late]
        batch.join(joined, batch.encode([[20, EOS], [21, 22, EOS]]))
        while len(batch):
            batch.step()
        return [s.hypotheses() for s in first[:3] + joined]

    for with_sampling in (False, True):
        best = BestTokensBackend(noisy_table, 12)
        whole = TableBackend(noisy_table, 12)
        assert run(best, with_sampling) == run(whole, with_sampling)
        assert max(best.ks) == 2 * 4 + 1  # beam 4 and the pad (the start id), banned
        if with_sampling:
            assert best.ks[:3] == [0, 0, 0] and best.ks[3] > 0  # the sampler leaves after 3
        else:
            assert 0 not in best.ks
