"""RunningBatch: the rows of many requests decoded together, step by step.

Requests join after their encoder pass and leave as soon as their search is done, so the batch
never waits for its longest member. This is the loop that both the offline translator and the
continuous-batching scheduler drive.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Generic

import numpy as np

from attnserve.engine.backend import Backend, IntArray, State, pad_batch
from attnserve.engine.search import Search

log = logging.getLogger(__name__)


class RunningBatch(Generic[State]):
    """Searches and the backend state holding their rows, in the same order."""

    def __init__(self, backend: Backend[State]) -> None:
        self.backend = backend
        self.searches: list[Search] = []
        self.state: State | None = None

    @property
    def num_rows(self) -> int:
        return sum(s.num_rows for s in self.searches)

    def __len__(self) -> int:
        return len(self.searches)

    def encode(self, sources: Sequence[Sequence[int]]) -> State:
        """Encoder pass for new requests (one row each)."""
        ids, lengths = pad_batch(sources, self.backend.spec.pad_id)
        return self.backend.encode(ids, lengths)

    def join(self, searches: Sequence[Search], state: State) -> None:
        """Add requests whose encoded rows are `state` (one row per search, same order)."""
        if not searches:
            return
        self.searches.extend(searches)
        self.state = state if self.state is None else self.backend.concat([self.state, state])

    def step(self) -> list[Search]:
        """One decoding step for every row; returns the searches that finished in it."""
        if not self.searches or self.state is None:
            return []
        tokens = np.concatenate([s.last_tokens for s in self.searches])
        log_probs, state = self.backend.step(tokens, self.state)
        rows: list[IntArray] = []
        finished: list[Search] = []
        kept: list[Search] = []
        offset = 0
        for search in self.searches:
            n = search.num_rows
            try:
                parents = search.step(log_probs[offset : offset + n])
            except Exception as exc:  # one request's failure must not stop the others
                log.exception("search of one request failed; dropping its rows")
                search.fail(exc)
            if search.done:
                finished.append(search)
            else:
                rows.append(parents + offset)
                kept.append(search)
            offset += n
        self.searches = kept
        self.state = self._select(state, rows, offset)
        return finished

    def remove(self, doomed: Sequence[Search]) -> None:
        """Drop requests (cancelled, deadline passed) and free their rows before the next step."""
        drop = {id(s) for s in doomed}
        if not drop or self.state is None:
            return
        rows: list[IntArray] = []
        kept: list[Search] = []
        offset = 0
        for search in self.searches:
            if id(search) not in drop:
                rows.append(np.arange(offset, offset + search.num_rows, dtype=np.int64))
                kept.append(search)
            offset += search.num_rows
        self.searches = kept
        self.state = self._select(self.state, rows, offset)

    def _select(self, state: State, rows: list[IntArray], total: int) -> State | None:
        if not rows:
            return None
        index = np.concatenate(rows)
        if index.size == total and np.array_equal(index, np.arange(total)):
            return state  # nothing left or moved: skip the copy
        return self.backend.select(state, index)
