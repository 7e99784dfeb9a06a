"""Backends for tests: a hand-written probability table, and the torch model without a cache."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from attnserve.engine.backend import Candidates, FloatArray, IntArray, ModelSpec
from attnserve.engine.torch_backend import TorchBackend

Table = Callable[[tuple[int, ...], tuple[int, ...]], Sequence[float]]


def best_tokens(log_probs: FloatArray, k: int) -> Candidates:
    """What the decoder graph's TopK returns: each row's k best, ties to the lower id."""
    ids = np.argsort(-log_probs, axis=1, kind="stable")[:, :k]
    return Candidates(np.take_along_axis(log_probs, ids, axis=1), ids)


class TableBackend:
    """Next-token probabilities from a function of (source, generated prefix).

    The state is plain Python: each row's source and generated tokens. Records every step's
    batch size so tests can see rows join and leave.
    """

    def __init__(self, table: Table, vocab_size: int, *, pad_id: int = 1, eos_id: int = 0) -> None:
        self.table = table
        self._spec = ModelSpec(vocab_size, pad_id, eos_id, pad_id, max_positions=64)
        self.step_rows: list[int] = []

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    def encode(
        self, src_ids: IntArray, src_lengths: IntArray
    ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [
            (tuple(int(t) for t in ids[:n]), ())
            for ids, n in zip(src_ids, src_lengths, strict=True)
        ]

    def step(self, tokens: IntArray, state: list) -> tuple[FloatArray, list]:
        self.step_rows.append(len(state))
        grown = []
        for token, (src, prefix) in zip(tokens, state, strict=True):
            grown.append(
                (
                    src,
                    prefix
                    if token == self._spec.start_id and not prefix
                    else (*prefix, int(token)),
                )
            )
        probs = np.array([self.table(src, prefix) for src, prefix in grown], dtype=np.float64)
        with np.errstate(divide="ignore"):
            return np.log(probs).astype(np.float32), grown

    def select(self, state: list, rows: IntArray) -> list:
        return [state[int(r)] for r in rows]

    def concat(self, states: Sequence[list]) -> list:
        return [row for s in states for row in s]


@dataclass
class UncachedState:
    src_ids: torch.Tensor
    src_mask: torch.Tensor
    prefixes: list[list[int]]


class UncachedTorchBackend(TorchBackend):
    """Recomputes the whole target prefix every step (the reference for the KV cache)."""

    def encode(self, src_ids: IntArray, src_lengths: IntArray) -> UncachedState:  # type: ignore[override]
        ids = torch.from_numpy(src_ids)
        mask = torch.arange(ids.shape[1])[None, :] < torch.from_numpy(src_lengths)[:, None]
        return UncachedState(ids, mask, [[] for _ in range(ids.shape[0])])

    def step(self, tokens: IntArray, state: UncachedState) -> tuple[FloatArray, UncachedState]:  # type: ignore[override]
        prefixes = [p + [int(t)] for p, t in zip(state.prefixes, tokens, strict=True)]
        longest = max(len(p) for p in prefixes)
        tgt = torch.full((len(prefixes), longest), self.spec.pad_id, dtype=torch.long)
        tgt_mask = torch.zeros(len(prefixes), longest, dtype=torch.bool)
        for i, p in enumerate(prefixes):
            tgt[i, : len(p)] = torch.tensor(p)
            tgt_mask[i, : len(p)] = True
        with torch.inference_mode():
            logits = self.model(state.src_ids, state.src_mask, tgt, tgt_mask)
        last = torch.tensor([len(p) - 1 for p in prefixes])
        rows = logits[torch.arange(len(prefixes)), last]
        log_probs = torch.log_softmax(rows.float(), dim=-1).numpy()
        return log_probs, UncachedState(state.src_ids, state.src_mask, prefixes)

    def select(self, state: UncachedState, rows: IntArray) -> UncachedState:  # type: ignore[override]
        index = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        return UncachedState(
            state.src_ids.index_select(0, index),
            state.src_mask.index_select(0, index),
            [list(state.prefixes[int(r)]) for r in rows],
        )

    def concat(self, states: Sequence[UncachedState]) -> UncachedState:  # type: ignore[override]
        width = max(s.src_ids.shape[1] for s in states)
        ids = torch.cat(
            [
                torch.nn.functional.pad(
                    s.src_ids, (0, width - s.src_ids.shape[1]), value=self.spec.pad_id
                )
                for s in states
            ]
        )
        mask = torch.cat(
            [torch.nn.functional.pad(s.src_mask, (0, width - s.src_mask.shape[1])) for s in states]
        )
        return UncachedState(ids, mask, [p for s in states for p in s.prefixes])
