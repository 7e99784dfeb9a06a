"""A language model's step graph with ONNX Runtime's GroupQueryAttention, behind the Backend
protocol (export/lm_graph.py, `attention="gqa"`).

The cache of every layer is a (B, Hkv, W, D) buffer whose row b holds that row's tokens at
columns 0 .. lengths[b] - 1 (the spare columns after them, no mask; the plain backend's rows
are left-padded instead): rows of any age share a batch, and
each row's attention reads its own length only, where the plain graph reads the batch's widest
past for every row. The buffers are bound as both `past` and `present` through IO binding, so
the kernel writes the new tokens' K/V into them itself, in place (as ONNX Runtime GenAI does).

The kernel's cases shape the calls: a first prompt for rows with nothing cached (right-padded,
`seqlens_k` = each row's tokens - 1, `total_sequence_length` = the chunk's width), one token per
row (any lengths), and a later prompt chunk of one row at a time (all its tokens real). So a
prompt chunk is one call while no row has a past, else a call per row that has tokens in it.

States that share buffers (a state stepped again after a newer one was made from it) are told
apart by an `_Owner` version: only the newest state of a buffer set writes in place, an older
one copies first.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnserve.defaults import DEFAULT_PROVIDER
from attnserve.engine.backend import FloatArray, IntArray
from attnserve.engine.onnx.layout import (
    LM_GQA,
    LM_GQA_INPUTS,
    LOGIT_POSITIONS,
    LOGITS,
    ROPE_LENGTHS,
    last_positions,
    lm_present_names,
)
from attnserve.engine.onnx.lm_backend import OnnxLMBackend, rope_lengths
from attnserve.engine.onnx.rowops import HostRowOps, Tensor
from attnserve.model.decoder_config import DecoderConfig

log = logging.getLogger(__name__)


# A cache that outgrows its buffers is copied into ones with room for a quarter more columns
# (at least the spare ones), so a batch of long rows copies its cache every ~W/4 steps, not
# every 32 (columns never written cost no memory: the pool's fresh buffers are untouched pages).
GROWTH = 4


@dataclass
class _Owner:
    """The buffers of a cache and the version of the newest state written into them."""

    version: int = 0


@dataclass
class GqaState:
    past: list[Tensor]  # 2L x (B, Hkv, W, D): row b's first lengths[b] columns are its tokens
    lengths: IntArray  # (B,) int64
    owner: _Owner
    version: int

    @property
    def width(self) -> int:
        return int(self.past[0].shape[2])

    @property
    def longest(self) -> int:
        return int(self.lengths.max(initial=0))


class OnnxGqaLMBackend(OnnxLMBackend):
    """step.onnx with GroupQueryAttention (CPU provider, numpy buffers from the pool)."""

    attention = LM_GQA

    def __init__(
        self, config: DecoderConfig, directory: str | Path, *, provider: str = DEFAULT_PROVIDER,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        # The buffers are host memory bound as both past and present: on a GPU provider ORT
        # would copy the whole cache to the device and back at every step.
        if provider == "cuda":
            log.warning("the GroupQueryAttention language model runs on the CPU provider")
        kwargs.pop("io_binding", None)  # its own binding of host buffers
        super().__init__(config, directory, provider="cpu", io_binding=False, **kwargs)
        assert isinstance(self.rows, HostRowOps)
        self.host: HostRowOps = self.rows
        # The last call's binding and the (address, shape) of each cache buffer it binds: a
        # decoding step whose buffers did not move rebinds only its ids, lengths and logits
        # (binding 2L buffers through the Python API costs ~1.2 ms, 8 % of a step at one row).
        self._binding: Any = None
        self._bound: tuple[tuple[int, tuple[int, ...]], ...] = ()
        self._bound_past: Sequence[Tensor] | None = None  # the list last checked against it

    def _io_names(self) -> tuple[list[str], list[str]]:
        self._present = lm_present_names(len(self._past) // 2)
        return [*LM_GQA_INPUTS, *self._past], [LOGITS, *self._present]

    # -- buffers -----------------------------------------------------------------------------

    def _buffers(self, rows: int, width: int) -> list[Tensor]:
        heads, dim = self._kv_shape
        return self.host.pool.get_many((rows, heads, width, dim), self.kv_dtype, len(self._past))

    def _room(self, columns: int) -> int:
        """The width of new buffers for `columns` columns: a quarter more, at least spare,
        capped at the context (a row never holds more) but never below `columns` (the
        scheduler's rows stay within the context, so no caller asks for more)."""
        grown = columns + max(self.host.spare, columns // GROWTH)
        return min(grown, max(columns, self.spec.max_positions))

    def _writable(self, state: GqaState, width: int) -> GqaState:
        """`state` with buffers at least `width` wide that it may write into: its own when it
        is their newest state and they are wide enough, else copies with spare columns."""
        if state.version == state.owner.version and state.width >= width:
            return state
        past = self._buffers(state.lengths.shape[0], self._room(max(width, state.longest)))
        used = state.longest
        for old, new in zip(state.past, past, strict=True):
            new[:, :, :used] = old[:, :, :used]
        return GqaState(past, state.lengths, _Owner(), 0)

    def _call(
        self,
        ids: IntArray,
        seqlens: np.ndarray,
        total: int,
        past: Sequence[Tensor],
        positions: IntArray,
        lengths: IntArray,
    ) -> FloatArray:
        """The logits (R, V) of `positions` (flat indices into `ids`; a graph exported without
        them: each row's last real token's, (B, V)); `lengths` (B,): the rows' rope lengths
        (read by a graph with length-dependent rotary frequencies)."""
        binding = self._binding
        # A state's buffer list is replaced, never changed, when its buffers move: the same
        # list (kept referenced here) needs no check of its 2 x layers addresses.
        if binding is None or past is not self._bound_past:
            bound = tuple((buffer.ctypes.data, buffer.shape) for buffer in past)
            if binding is None or bound != self._bound:
                binding = self.session.io_binding()
                for name_in, name_out, buffer in zip(self._past, self._present, past, strict=True):
                    shape = list(buffer.shape)
                    pointer = buffer.ctypes.data
                    binding.bind_input(name_in, "cpu", 0, buffer.dtype, shape, pointer)
                    binding.bind_output(name_out, "cpu", 0, buffer.dtype, shape, pointer)
                self._binding, self._bound = binding, bound
            self._bound_past = past
        binding.bind_cpu_input(LM_GQA_INPUTS[0], np.ascontiguousarray(ids, dtype=np.int64))
        binding.bind_cpu_input(LM_GQA_INPUTS[1], np.ascontiguousarray(seqlens, dtype=np.int32))
        binding.bind_cpu_input(LM_GQA_INPUTS[2], np.array(total, dtype=np.int32))
        if self.rope_lengths:
            binding.bind_cpu_input(ROPE_LENGTHS, np.ascontiguousarray(lengths, dtype=np.int64))
        rows = ids.shape[0]
        if self.scores_prompts:
            binding.bind_cpu_input(LOGIT_POSITIONS, positions)
            rows = positions.shape[0]
        logits = np.empty((rows, self.spec.vocab_size), dtype=np.float32)
        binding.bind_output(LOGITS, "cpu", 0, logits.dtype, list(logits.shape), logits.ctypes.data)
        self.session.run_with_iobinding(binding)
        return logits

    def _written(self, state: GqaState, lengths: IntArray) -> GqaState:
        state.owner.version += 1
        return GqaState(state.past, lengths, state.owner, state.owner.version)

    # -- Backend -----------------------------------------------------------------------------

    def empty(self, rows: int) -> GqaState:  # type: ignore[override]
        past = self._buffers(rows, self.host.spare)
        return GqaState(past, np.zeros(rows, dtype=np.int64), _Owner(), 0)

    def step(self, tokens: IntArray, state: GqaState) -> tuple[FloatArray, GqaState]:  # type: ignore[override]
        return self._step(tokens, state)

    def _step(
        self, tokens: IntArray, state: GqaState, prompt_lengths: IntArray | None = None
    ) -> tuple[FloatArray, GqaState]:
        # A live row ends at the context; a finished row a batch still steps (static batching
        # answers when all are done) rewrites its last column: the kernel's rotary table has
        # the context's positions only. (A state older than that row's last step would see the
        # column rewritten: nothing steps a finished row's older states.)
        context = self.spec.max_positions
        lengths = np.minimum(state.lengths, context - 1)
        total = int(lengths.max(initial=0)) + 1
        state = self._writable(state, total)
        ids = np.ascontiguousarray(tokens, dtype=np.int64)[:, None]
        rope = rope_lengths(lengths + 1, prompt_lengths)
        logits = self._call(ids, lengths, total, state.past, last_positions(ids.shape[0], 1), rope)
        return logits, self._written(state, lengths + 1)

    def extend(  # type: ignore[override]
        self,
        state: GqaState,
        ids: IntArray,
        mask: IntArray,
        *,
        all_positions: bool = False,
        prompt_lengths: IntArray | None = None,
    ) -> tuple[FloatArray, GqaState]:
        """Prefill a left-padded chunk `ids`/`mask` (B, T) after the rows' cached tokens;
        returns the logits of each row's last token (zeros for a row with none here), or with
        `all_positions` of every position (B, T, V; zeros at padding). `prompt_lengths` (B,):
        each row's whole prompt, when the chunk is part of it (model/rope.py)."""
        counts = mask.sum(axis=1).astype(np.int64)
        width = ids.shape[1]
        if all_positions:
            self.require_scoring()
        if mask.all() and width == 1 and not all_positions:
            return self._step(ids[:, 0], state, prompt_lengths)
        lengths = state.lengths + counts
        rope = rope_lengths(lengths, prompt_lengths)
        if lengths.max(initial=0) > self.spec.max_positions:
            raise ValueError(
                f"a prompt of {int(lengths.max())} tokens is longer than the model's context "
                f"({self.spec.max_positions})"
            )
        state = self._writable(state, int(lengths.max(initial=0)))
        rows, vocab = ids.shape[0], self.spec.vocab_size
        shape = (rows, width, vocab) if all_positions else (rows, vocab)
        logits = np.zeros(shape, dtype=np.float32)
        if not state.lengths.any():
            # a first prompt: the rows' tokens moved to column 0, right-padded; a row with none
            # runs pad tokens whose K/V its own tokens overwrite later (its length stays 0)
            chunk = int(counts.max(initial=0))
            if chunk == 0:
                return logits, state
            right = np.full((rows, chunk), self.spec.pad_id, dtype=np.int64)
            for row, n in enumerate(counts.tolist()):
                right[row, :n] = ids[row, width - n :]
            last = np.arange(rows, dtype=np.int64) * chunk + np.maximum(counts, 1) - 1
            positions = np.arange(rows * chunk, dtype=np.int64) if all_positions else last
            out = self._call(right, np.maximum(counts, 1) - 1, chunk, state.past, positions, rope)
            if all_positions:  # back to the left-padded layout
                out = out.reshape(rows, chunk, vocab)
                for row, n in enumerate(counts.tolist()):
                    logits[row, width - n :] = out[row, :n]
            else:
                logits = out
                logits[counts == 0] = 0.0
        else:
            for row in np.flatnonzero(counts).tolist():
                n, cached = int(counts[row]), int(state.lengths[row])
                past = [t[row : row + 1] for t in state.past]  # contiguous: a row's slab
                positions = np.arange(n, dtype=np.int64) if all_positions else last_positions(1, n)
                out = self._call(
                    ids[row : row + 1, width - n :],
                    np.array([cached + n - 1]),
                    cached + n,
                    past,
                    positions,
                    rope[row : row + 1],
                )
                if all_positions:
                    logits[row, width - n :] = out
                else:
                    logits[row] = out[0]
        return logits, self._written(state, lengths)

    def prefix_columns(  # type: ignore[override]
        self, state: GqaState, row: int, n: int, start: int = 0
    ) -> np.ndarray:
        """Row `row`'s cached tokens `start` .. n - 1, every layer's K/V: (2L, Hkv, n - start,
        D), a copy (a row's tokens are its first `lengths[row]` columns)."""
        if n > int(state.lengths[row]):
            raise ValueError(f"row {row} holds {int(state.lengths[row])} tokens, not {n}")
        return np.stack([t[row, :, start:n] for t in state.past])

    def from_prefixes(self, prefixes: Sequence[Sequence[np.ndarray]]) -> GqaState:  # type: ignore[override]
        """A state of one row per prefix whose cache holds it: the prefix's blocks of K/V,
        (2L, Hkv, n, D) each, in order (none: nothing cached)."""
        lengths = np.array([sum(b.shape[2] for b in p) for p in prefixes], dtype=np.int64)
        past = self._buffers(len(prefixes), self._room(int(lengths.max(initial=0))))
        for row, blocks in enumerate(prefixes):
            start = 0
            for block in blocks:
                end = start + block.shape[2]
                for i, tensor in enumerate(past):
                    tensor[row, :, start:end] = block[i]
                start = end
        return GqaState(past, lengths, _Owner(), 0)

    def reorder(self, state: GqaState, rows: IntArray) -> GqaState:  # type: ignore[override]
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if rows.shape[0] != state.lengths.shape[0] or state.version != state.owner.version:
            return self.select(state, rows)
        past = self.host.reorder(state.past, rows, state.longest)
        return self._written(
            GqaState(past, state.lengths, state.owner, state.version), state.lengths[rows]
        )

    def select(self, state: GqaState, rows: IntArray) -> GqaState:  # type: ignore[override]
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        lengths = state.lengths[rows]
        longest = int(lengths.max(initial=0))
        if longest < state.width <= self._room(longest):  # whole rows, one copy each
            return GqaState(self.host.take_rows(state.past, rows), lengths, _Owner(), 0)
        past = self._buffers(rows.shape[0], self._room(longest))  # trimmed to its rows
        for old, new in zip(state.past, past, strict=True):
            for i, row in enumerate(rows.tolist()):  # no gathered temporary of the cache
                new[i, :, :longest] = old[row, :, :longest]
        return GqaState(past, lengths, _Owner(), 0)

    def replace(self, state: GqaState, rows: IntArray, new: GqaState) -> GqaState:
        """`state` with rows `rows` holding `new`'s rows (their used columns): in place when
        `state` is the newest of its buffers and wide enough, else in a copy. `state` and
        the states sharing its buffers must not be used again (as after `reorder`)."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if rows.shape[0] != new.lengths.shape[0]:
            raise ValueError(f"{rows.shape[0]} rows for a state of {new.lengths.shape[0]}")
        used = new.longest
        state = self._writable(state, used + 1)  # the next step writes column `used`
        for old, joining in zip(state.past, new.past, strict=True):
            old[rows, :, :used] = joining[:, :, :used]
        lengths = state.lengths.copy()
        lengths[rows] = new.lengths
        return self._written(state, lengths)

    def _join_in_place(self, state: GqaState, new: GqaState) -> GqaState | None:
        """`new`'s rows written into the spare rows of `state`'s buffers (their used columns
        only), so a request joining a running batch does not copy the batch's cache; None when
        the buffers have no room or `state` may not write into them."""
        rows = new.lengths.shape[0]
        if (
            state.version != state.owner.version
            or new.longest >= state.width
            or not self.host.room(state.past, rows)
        ):
            return None
        used = new.longest
        past = self.host.extend(state.past, rows, [t[:, :, :used] for t in new.past])
        joined = GqaState(past, state.lengths, state.owner, state.version)
        return self._written(joined, np.concatenate([state.lengths, new.lengths]))

    def concat(self, states: Sequence[GqaState]) -> GqaState:  # type: ignore[override]
        if len(states) == 1:
            return states[0]
        if len(states) == 2:
            joined = self._join_in_place(states[0], states[1])
            if joined is not None:
                return joined
        longest = max(s.longest for s in states)
        rows = sum(s.lengths.shape[0] for s in states)
        past = self._buffers(rows, self._room(longest))
        start = 0
        for s in states:
            n, used = s.lengths.shape[0], s.longest
            for old, new in zip(s.past, past, strict=True):
                new[start : start + n, :, :used] = old[:, :, :used]
            start += n
        return GqaState(past, np.concatenate([s.lengths for s in states]), _Owner(), 0)
