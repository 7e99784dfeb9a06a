"""The Backend protocol: everything search and scheduling need from a model runtime.

A backend runs the two halves of the model on numpy arrays. Its decoding state (encoder output,
cross-attention K/V, self-attention KV cache) is opaque to callers, who only move rows around
with `select` and `concat`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from attnserve.model.config import ModelConfig

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float32]

State = TypeVar("State")


@dataclass(frozen=True)
class Candidates:
    """The K most likely tokens of every row of a step, best first, ties to the lower id:
    what greedy and beam search read instead of whole (R, V) rows of log-probs when no
    processor reweights tokens (a backend's `step_candidates`)."""

    log_probs: FloatArray  # (R, K) float32, descending along each row
    ids: IntArray  # (R, K) int64

    def __getitem__(self, rows: slice) -> Candidates:
        return Candidates(self.log_probs[rows], self.ids[rows])


@dataclass(frozen=True)
class ModelSpec:
    """The facts about a model that decoding needs."""

    vocab_size: int  # target vocabulary size V
    pad_id: int
    eos_id: int
    start_id: int  # first decoder input (Marian: the pad id)
    max_positions: int  # longest source and longest target, in tokens
    # Decoder-only language models: `encode` prefills a prompt (all but its last token, which
    # the search feeds to the first step) and `max_positions` is the context length.
    decoder_only: bool = False
    # Tokens other than eos_id that end a sequence (a chat template's end-of-turn token).
    stop_ids: tuple[int, ...] = ()
    # Tokens never generated; None: the pad and start ids (Marian's rule), unless they stop.
    banned_ids: tuple[int, ...] | None = None
    # `step` returns raw logits rather than log-probs (language models: Hugging Face applies
    # greedy and sampling processors to logits, which the multiplicative repetition penalty
    # tells apart); the searches normalize.
    returns_logits: bool = False

    @property
    def stops(self) -> frozenset[int]:
        return frozenset((self.eos_id, *self.stop_ids))

    @property
    def never_generated(self) -> tuple[int, ...]:
        if self.banned_ids is not None:
            return self.banned_ids
        return tuple(sorted({self.pad_id, self.start_id} - self.stops))

    @classmethod
    def from_config(cls, config: ModelConfig) -> ModelSpec:
        return cls(
            vocab_size=config.target_vocab_size,
            pad_id=config.pad_id,
            eos_id=config.eos_id,
            start_id=config.start_id,
            max_positions=config.max_positions,
        )


class Backend(Protocol[State]):
    """A model runtime (torch, ONNX Runtime) seen as encode + step + row operations."""

    @property
    def spec(self) -> ModelSpec: ...

    def encode(self, src_ids: IntArray, src_lengths: IntArray) -> State:
        """src_ids (B, S) right-padded with pad_id, src_lengths (B,) -> state, empty cache
        (decoder-only: the cache of the prefilled prompt tokens)."""
        ...

    def step(self, tokens: IntArray, state: State) -> tuple[FloatArray, State]:
        """Feed the last token of every row (B,) -> log-probs (B, V) float32 (logits when
        `spec.returns_logits`) and the grown state."""
        ...

    def select(self, state: State, rows: IntArray) -> State:
        """Keep rows `rows` of the state in that order; rows may repeat (beam expansion)."""
        ...

    def concat(self, states: Sequence[State]) -> State:
        """One state holding the rows of `states` in order (rows of different lengths may mix)."""
        ...

    # Optional: `step_candidates(tokens, state, k) -> (Candidates, State)`, `step` that returns
    # each row's k best tokens (k <= V) instead of whole rows, where the attribute `candidates`
    # is true; RunningBatch uses it on steps where every search says how many it needs
    # (`Search.wanted`).
    # Optional, language models: `empty(rows) -> State` and `extend(state, ids, mask) ->
    # (logits, State)`, which prefills a left-padded chunk of prompt tokens (B, T) after the
    # rows' cached ones: the scheduler prefills long prompts a chunk per step with them. With
    # `all_positions=True` it returns every position's logits (B, T, V), for prompt logprobs,
    # where the attribute `scores_prompts` is true.
    # Optional: `reorder(state, rows) -> State`, `select` for a caller that gives `state` up
    # (RunningBatch after a step) and keeps the number of rows: the backend may move rows in
    # place, so `state` and every state sharing its tensors must not be used again.
    # Optional: `replace(state, rows, new) -> State`: `state` with its rows `rows` (rows of
    # requests that left) holding `new`'s rows instead, for a caller that gives `state` up
    # (RunningBatch, when requests join while it has dead rows): written in place, so the
    # joining rows cost a copy of their own cache, not of the running batch's.


def pad_batch(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[IntArray, IntArray]:
    """Right-pad token id lists into (B, S) int64 ids and (B,) lengths."""
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    ids = np.full((len(sequences), int(lengths.max(initial=1))), pad_id, dtype=np.int64)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = seq
    return ids, lengths


def left_padded(ids: IntArray, lengths: IntArray, pad_id: int) -> tuple[IntArray, IntArray]:
    """Right-padded (B, S) ids -> left-padded ids and their (B, S) 0/1 mask."""
    batch, width = ids.shape
    out = np.full((batch, width), pad_id, dtype=np.int64)
    mask = np.zeros((batch, width), dtype=np.int64)
    for row, n in enumerate(lengths.tolist()):
        if n:
            out[row, width - n :] = ids[row, :n]
            mask[row, width - n :] = 1
    return out, mask
