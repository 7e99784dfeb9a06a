"""RunningBatch: the rows of many requests decoded together, step by step.

Requests join after their encoder pass and leave as soon as their search is done, so the batch
never waits for its longest member. This is the loop that both the offline translator and the
continuous-batching scheduler drive.

Removing rows copies the cache of every row that stays, so the rows of a request that finished
(or was cancelled) stay in the state as dead rows, decoded but never read, until they are a
quarter of the batch. A step then costs a few wasted rows instead of a copy of the whole cache
each time a request ends. Where the backend can write rows in place (`replace`: the language
model's GroupQueryAttention cache, whose rows each have their own length), requests of one row
that join take over dead rows instead of being appended: neither the leaving nor the joining
request copies the running batch's cache.

A caller may watch requests leave (`on_leave`): it gets each leaving search with the state
that holds its rows and the first of them, in the step it finished (or when it is removed),
before any row moves: where the prefix cache reads a finished answer's K/V.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic

import numpy as np

from attnserve.engine.backend import Backend, Candidates, FloatArray, IntArray, State, pad_batch
from attnserve.engine.constraints import GrammarError
from attnserve.engine.search import Search

log = logging.getLogger(__name__)


@dataclass
class _Dead:
    """Rows of a request that left, still in the state."""

    num_rows: int
    steps: int  # decoder steps its rows have seen (their next position)


class RunningBatch(Generic[State]):
    """Searches and the backend state holding their rows, in the same order."""

    # Dead rows are dropped (one copy of the cache) once they are this fraction of the batch.
    DEAD_FRACTION = 0.25
    # What one more encoder call costs, in padded source tokens: on one CPU thread a call's
    # fixed overhead is worth about 16 tokens of encoding (docs/BENCHMARKS.md). A backend may
    # say otherwise with an `encode_call_tokens` attribute (ORT on CUDA does).
    ENCODE_CALL_TOKENS = 16

    def __init__(self, backend: Backend[State], dead_fraction: float | None = None) -> None:
        self.backend = backend
        # 1.0: dead rows stay until every row is dead (static batching, engine/scheduler.py).
        self.dead_fraction = self.DEAD_FRACTION if dead_fraction is None else dead_fraction
        self.entries: list[Search | _Dead] = []  # in the state's row order
        self.state: State | None = None
        self.steps = 0  # decoding steps run since the batch started
        # Called with a search that leaves (finished, failed, removed), the state holding its
        # rows and the first of them there, before they can move; it must not raise.
        self.on_leave: Callable[[Search, State, int], None] | None = None

    @property
    def searches(self) -> list[Search]:
        return [e for e in self.entries if not isinstance(e, _Dead)]

    @property
    def num_rows(self) -> int:
        """Rows of running requests (dead rows are not counted: at most a third more)."""
        return sum(s.num_rows for s in self.searches)

    @property
    def dead_rows(self) -> int:
        return sum(e.num_rows for e in self.entries if isinstance(e, _Dead))

    def __len__(self) -> int:
        return len(self.searches)

    def encode(self, sources: Sequence[Sequence[int]]) -> State:
        """Encoder pass for new requests (one row each, in the order given).

        Sources of mixed lengths are encoded in length buckets (`encoder_chunks`), one encoder
        call each, so that a short source is not padded to the longest one of its group; the
        states are then concatenated. Callers that pass sources sorted by length (the
        scheduler, the offline translator; ascending or descending) skip the reordering copy."""
        if not sources:
            raise ValueError("encode needs at least one source")
        lengths = [len(s) for s in sources]
        order = list(range(len(sources)))
        pairs = list(itertools.pairwise(lengths))
        if not (all(a <= b for a, b in pairs) or all(a >= b for a, b in pairs)):
            order.sort(key=lambda i: lengths[i])
        call_tokens = getattr(self.backend, "encode_call_tokens", self.ENCODE_CALL_TOKENS)
        chunks = encoder_chunks([lengths[i] for i in order], call_tokens)
        pad = self.backend.spec.pad_id
        states = []
        for start, end in chunks:
            ids, lens = pad_batch([sources[i] for i in order[start:end]], pad)
            states.append(self.backend.encode(ids, lens))
        state = states[0] if len(states) == 1 else self.backend.concat(states)
        if any(i != k for k, i in enumerate(order)):
            inverse = np.argsort(np.asarray(order, dtype=np.int64))
            state = self.backend.select(state, inverse)
        return state

    def join(self, searches: Sequence[Search], state: State) -> None:
        """Add requests whose encoded rows are `state` (one row per search, same order)."""
        if not searches:
            return
        if self.state is not None and self._join_into_dead_rows(searches, state):
            return
        # The state first: if the backend fails to concatenate, the batch is as it was.
        self.state = state if self.state is None else self.backend.concat([self.state, state])
        self.entries.extend(searches)

    def _join_into_dead_rows(self, searches: Sequence[Search], state: State) -> bool:
        """Requests of one row each take over dead rows (the first ones), where the backend
        can write rows in place (`replace`): the running batch's cache is not copied and the
        batch does not grow. False (nothing done) if it cannot, or too few rows are dead."""
        replace = getattr(self.backend, "replace", None)
        if replace is None or any(s.num_rows != 1 for s in searches):
            return False
        rows: list[Search | _Dead] = []  # one entry a row for the dead, as they are in the state
        for entry in self.entries:
            if isinstance(entry, _Dead):
                rows.extend(_Dead(1, entry.steps) for _ in range(entry.num_rows))
            else:
                rows.append(entry)
        starts = np.cumsum([0] + [e.num_rows for e in rows])
        dead = [i for i, e in enumerate(rows) if isinstance(e, _Dead)][: len(searches)]
        if len(dead) < len(searches):
            return False
        # The state first: if the backend fails, the batch is as it was.
        self.state = replace(self.state, starts[dead], state)
        for i, search in zip(dead, searches, strict=True):
            rows[i] = search
        self.entries = rows
        return True

    def step(self) -> list[Search]:
        """One decoding step for every row; returns the searches that finished in it."""
        if not self.searches or self.state is None:
            return []
        if any(
            isinstance(e, _Dead) and e.steps >= self.backend.spec.max_positions
            for e in self.entries
        ):
            self._compact()  # a dead row would step past the last position
        pad = self.backend.spec.pad_id
        tokens = np.concatenate(
            [
                np.full(e.num_rows, pad, dtype=np.int64) if isinstance(e, _Dead) else e.last_tokens
                for e in self.entries
            ]
        )
        wanted = self._wanted()
        for entry in self.entries:  # a grammar's masks are computed while the step runs
            if not isinstance(entry, _Dead):
                entry.prefetch()
        scores: FloatArray | Candidates
        if wanted:
            scores, state = self.backend.step_candidates(tokens, self.state, wanted)  # type: ignore[attr-defined]
        else:
            scores, state = self.backend.step(tokens, self.state)
        self.steps += 1
        rows: list[IntArray] = []
        finished: list[Search] = []
        kept: list[Search | _Dead] = []
        offset = 0
        for entry in self.entries:
            n = entry.num_rows
            same = np.arange(offset, offset + n, dtype=np.int64)
            if isinstance(entry, _Dead):
                rows.append(same)
                kept.append(_Dead(n, entry.steps + 1))
                offset += n
                continue
            stepped = entry.steps + 1  # counted here: a search that raises did not count it
            try:
                rows_scores = scores[offset : offset + n]
                if isinstance(rows_scores, Candidates):
                    parents = entry.step_candidates(rows_scores)
                else:
                    parents = entry.step(rows_scores)
            except GrammarError as exc:  # the client's grammar passed llguidance's limits
                log.info("a request's grammar is too complex to follow; dropping its rows")
                entry.fail(exc.with_traceback(None))
            except Exception as exc:  # one request's failure must not stop the others
                log.exception("search of one request failed; dropping its rows")
                entry.fail(exc.with_traceback(None))  # its frames would pin the whole batch
            if entry.done:
                if self.on_leave is not None:
                    self.on_leave(entry, state, offset)
                finished.append(entry)
                rows.append(same)
                kept.append(_Dead(n, stepped))
            else:
                rows.append(parents + offset)
                kept.append(entry)
            offset += n
        self.entries = kept
        self.state = self._select(state, rows, offset, owned=True)
        self._drop_dead_if_many()
        return finished

    def _wanted(self) -> int:
        """Each row's best tokens this step needs, when the backend can return them instead of
        whole rows and every search can choose from them; 0: whole rows."""
        if not getattr(self.backend, "candidates", False):
            return 0
        wanted = 0
        for entry in self.entries:
            if not isinstance(entry, _Dead):
                n = entry.wanted()
                if n <= 0:
                    return 0
                wanted = max(wanted, n)
        return min(wanted, self.backend.spec.vocab_size)

    def remove(self, doomed: Sequence[Search]) -> None:
        """Drop requests (cancelled, deadline passed); their rows are dead from now on."""
        drop = {id(s) for s in doomed}
        if not drop or self.state is None:
            return
        if self.on_leave is not None:
            offset = 0
            for entry in self.entries:
                if id(entry) in drop and not isinstance(entry, _Dead):
                    self.on_leave(entry, self.state, offset)
                offset += entry.num_rows
        self.entries = [
            _Dead(e.num_rows, e.steps) if id(e) in drop and not isinstance(e, _Dead) else e
            for e in self.entries
        ]
        self._drop_dead_if_many()

    def _drop_dead_if_many(self) -> None:
        dead = self.dead_rows
        if dead and (not self.searches or dead >= self.dead_fraction * (dead + self.num_rows)):
            self._compact()

    def _compact(self) -> None:
        """Drop the dead rows from the state (one copy of the live rows)."""
        rows: list[IntArray] = []
        offset = 0
        for entry in self.entries:
            if not isinstance(entry, _Dead):
                rows.append(np.arange(offset, offset + entry.num_rows, dtype=np.int64))
            offset += entry.num_rows
        self.entries = [e for e in self.entries if not isinstance(e, _Dead)]
        if self.state is not None:
            self.state = self._select(self.state, rows, offset)

    def _select(
        self, state: State, rows: list[IntArray], total: int, *, owned: bool = False
    ) -> State | None:
        """The rows `rows` of `state`; `owned`: nobody else holds `state` (the step's result),
        so a backend that can reorder its rows in place (`reorder`) may."""
        if not rows:
            return None
        index = np.concatenate(rows)
        if index.size == total and np.array_equal(index, np.arange(total)):
            return state  # nothing left or moved: skip the copy
        reorder = getattr(self.backend, "reorder", None)
        if owned and reorder is not None:
            return reorder(state, index)
        return self.backend.select(state, index)


def encoder_chunks(lengths: Sequence[int], call_tokens: int) -> list[tuple[int, int]]:
    """Split sources sorted by length (ascending or descending) into [start, end) runs, one
    encoder call each, that minimize the padded tokens encoded plus `call_tokens` per call (a
    run is padded to its longest source, at one of its ends). Exact, by dynamic programming
    over the split points."""
    n = len(lengths)
    if n <= 1:
        return [(0, n)] if n else []
    longest = np.asarray(lengths, dtype=np.float64)
    best = np.zeros(n + 1)  # best[j]: cost of the first j sources
    split = np.zeros(n + 1, dtype=np.int64)
    starts = np.arange(n, dtype=np.float64)
    for j in range(1, n + 1):
        padded_to = np.maximum(longest[:j], longest[j - 1])
        costs = best[:j] + call_tokens + (j - starts[:j]) * padded_to
        i = int(np.argmin(costs))
        best[j], split[j] = costs[i], i
    runs = []
    end = n
    while end > 0:
        runs.append((int(split[end]), end))
        end = int(split[end])
    return runs[::-1]
