"""ONNX Runtime running a decoder-only language model: step.onnx for prompt chunks and decoding
steps alike, behind the Backend protocol.

The state is the self-attention cache of every row (left-padded, `past_mask` marks real columns)
in buffers with spare columns: the graph returns only the K/V of its new tokens, which
`HostRowOps.append` writes after the columns in use, in place when there is room. Prompts longer
than `prefill_chunk` tokens are prefilled in chunks, so one call's activations stay bounded.
Rows move (beams, requests joining and leaving) as in the encoder-decoder backend. A graph whose
rotary frequencies depend on a row's length (dynamic, longrope: model/rope.py) is fed each row's
`rope_lengths`: its length after the call, or its whole prompt's while `encode` (or a caller's
chunked prefill, `prompt_lengths`) prefills it.

With IO binding (the default on CUDA) the cache is OrtValues on the device, exactly `length`
columns wide, appended to, selected and concatenated there by `DeviceRowOps` as the
encoder-decoder's is; only ids, masks and the logits cross to the host.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnserve.defaults import DEFAULT_PROVIDER
from attnserve.engine.backend import FloatArray, IntArray, ModelSpec, left_padded
from attnserve.engine.onnx.backend import (
    CPU,
    CUDA,
    SLOW_CPU_FUSIONS,
    choose_providers,
    open_session,
    session_options,
)
from attnserve.engine.onnx.buffers import BufferPool
from attnserve.engine.onnx.layout import (
    KERNEL_THREADS,
    LM_INPUTS,
    LM_PLAIN,
    LM_STEP_NAME,
    LOGIT_POSITIONS,
    LOGITS,
    ROPE_LENGTHS,
    last_positions,
    lm_new_names,
    lm_past_names,
    read_manifest,
    require_graph,
)
from attnserve.engine.onnx.rowops import (
    Columns,
    DeviceRowOps,
    HostRowOps,
    Tensor,
    first_used_column,
    run_bound,
    width_of,
)
from attnserve.engine.torch_lm import lm_spec
from attnserve.kernels import block_products, integer_products, physical_cores
from attnserve.kernels import register as register_kernels
from attnserve.kernels import use_threads as use_kernel_threads
from attnserve.model.decoder_config import DecoderConfig

log = logging.getLogger(__name__)

# The host cache's growth (docs/BENCHMARKS.md): a language model's cache is ~10x the translation
# model's per token (SmolLM2: 46 KB a token per row, float32), so it grows by 32 spare columns
# at a time into buffers without the translation pool's room (BufferPool.ROOM 2, rows rounded
# to 16), and keeps free buffers up to a quarter of the recent high-water mark. On SmolLM2 int8,
# 48 rows decoding 120 steps with rows leaving and joining: peak RSS 2.0 GB against 4.9 GB with
# the translation model's settings, and 134 against 184 ms a step.
LM_SPARE = 32
LM_ROOM = 1.0
LM_ROWS = 4
LM_KEEP = 0.25

# Prompt tokens per prefill call: longer prompts go in chunks (bounded activations: a chunk's
# attention scores are T x (W + T) per head).
PREFILL_CHUNK = 512


class PromptScoringUnsupported(ValueError):
    """The graph cannot return every position's logits (exported before it could)."""


@dataclass
class LMState:
    """The cache rows of a running batch: W >= length columns wide (spare columns free)."""

    past: list[Tensor]  # 2L x (B, Hkv, W, D): past.{i}.key, .value
    past_mask: IntArray  # (B, W) int64, 1 = a real column (0: left padding, spare columns)
    length: int  # columns in use; the next token's key/value go to column `length`
    columns: Columns  # shared by the states that share `past` (copy on write)


def rope_lengths(after: IntArray, prompt_lengths: IntArray | None) -> IntArray:
    """The graph's `rope_lengths` (B,): each row's length after the call, or its whole prompt's
    where that is longer (a chunk of the prompt)."""
    lengths = np.asarray(after, dtype=np.int64)
    if prompt_lengths is not None:
        lengths = np.maximum(lengths, np.asarray(prompt_lengths, dtype=np.int64))
    return np.ascontiguousarray(lengths)


class OnnxLMBackend:
    """step.onnx of one exported variant of a language model: prompt chunks and decoding steps
    run the same graph (the cache in host buffers, or on the device with IO binding)."""

    def __init__(
        self,
        config: DecoderConfig,
        directory: str | Path,
        *,
        provider: str = DEFAULT_PROVIDER,
        threads: int | None = None,
        spinning: bool = False,
        optimization: str = "all",
        stop_ids: Sequence[int] = (),
        prefill_chunk: int = PREFILL_CHUNK,
        kernels: bool = True,
        io_binding: bool | None = None,
    ) -> None:
        directory = Path(directory)
        self._spec = lm_spec(config, stop_ids)
        self.manifest = read_manifest(directory)
        self.variant = str(self.manifest.get("variant", directory.name))
        self.prefill_chunk = prefill_chunk
        n = config.num_layers
        self._kv_shape = (config.num_kv_heads, config.head_dim)
        self._past, self._new = lm_past_names(n), lm_new_names(n)
        options = session_options(threads, spinning=spinning, optimization=optimization)
        # Without ORT's CPU arena: its chunks, sized for caches a column wider at every step,
        # were held after use (~250 MB more at 48 rows, no faster).
        options.enable_cpu_mem_arena = False
        providers = choose_providers(provider)
        disabled = SLOW_CPU_FUSIONS if providers[0] == CPU else ()
        # attnserve's kernels (an int8 step's activation quantization), on the CPU provider
        self.kernels = providers[0] == CPU and kernels and register_kernels(options)
        exported = self.manifest.get("options", {})
        # Whether the products the graph holds are registered: an int4 graph's are block
        # products (AVX2 or AVX-512 VNNI), an int8 graph's per-row ones (VNNI) and block ones.
        blocks = bool(self.kernels) and block_products()
        products = blocks if self.variant == "int4" else blocks and integer_products()
        on_kernels = exported.get("matmuls", {}).get("on_kernel") or exported.get(KERNEL_THREADS)
        if on_kernels and not blocks:
            log.warning(
                "%s runs its products on attnserve's block kernels, which are not registered "
                "here (they need AVX2 or AVX-512 VNNI and the built library): ONNX Runtime runs "
                "their stock bodies (slower: float copies of the weights); export the variant "
                "again on this machine",
                directory,
            )
        elif on_kernels and not products:
            log.info(
                "%s: the per-row int8 products run on ONNX Runtime's GEMM here (their kernel "
                "needs AVX-512 VNNI; the same sums), the kernels' own threads unused",
                directory,
            )
        # Every product on the kernels: they run on threads of their own, ONNX Runtime's nodes
        # (norms, element-wise, attention) on one (a step's ~120 small products each paid the
        # hand-over to ONNX Runtime's threads; its threading of 576-wide rows cost more than it
        # saved). docs/BENCHMARKS.md measures both.
        # The threads are the process's: the last language model opened sets them (one serves).
        wanted = threads or physical_cores()
        self.kernel_threads = wanted if products and exported.get(KERNEL_THREADS) else 0
        if self.kernel_threads:
            options.intra_op_num_threads = 1
            use_kernel_threads(wanted, spinning=spinning)
        inputs, outputs = self._io_names()
        attention = exported.get("attention", LM_PLAIN)
        if attention != self.attention:
            raise ValueError(
                f"{directory} holds a graph with {attention} attention: open it with "
                "open_lm_backend (lm_open.py)"
            )
        self.session = open_session(
            require_graph(directory, LM_STEP_NAME), options, providers, inputs, outputs, disabled
        )
        # Whether the graph returns the logits of any positions asked for (prompt scoring); a
        # graph exported before that was an input returns each row's last position's only.
        names = {i.name for i in self.session.get_inputs()}
        self.scores_prompts = LOGIT_POSITIONS in names
        # rotary frequencies chosen per row by its length (dynamic, longrope scaling)
        self.rope_lengths = ROPE_LENGTHS in names
        self.provider = self.session.get_providers()[0]
        kind = next(i.type for i in self.session.get_inputs() if i.name == self._past[0])
        self.kv_dtype = np.dtype(np.float16) if kind == "tensor(float16)" else np.dtype(np.float32)
        on_cuda = self.provider == CUDA
        self.device = ("cuda", 0) if on_cuda else ("cpu", 0)
        self.io_binding = on_cuda if io_binding is None else io_binding
        self.rows: HostRowOps | DeviceRowOps = (
            DeviceRowOps(self.kv_dtype, providers, options, self.device)
            if self.io_binding
            else HostRowOps(LM_SPARE, BufferPool(room=LM_ROOM, rows=LM_ROWS, keep=LM_KEEP))
        )
        # The scheduler's prompt groups (RunningBatch.encode): one call a group on CUDA, where a
        # call's launches cost more than padding (and each group count builds a concat session).
        self.encode_call_tokens = 1024 if on_cuda else 16
        log.info(
            "onnx %s language model on %s (threads %s%s, io binding %s)",
            self.variant,
            self.provider,
            threads,
            f", the products on {self.kernel_threads} of the kernels' own"
            if self.kernel_threads > 1
            else "",
            self.io_binding,
        )

    attention = LM_PLAIN

    def _io_names(self) -> tuple[list[str], list[str]]:
        return [*LM_INPUTS, *self._past], [LOGITS, *self._new]

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    def require_scoring(self) -> None:
        """PromptScoringUnsupported unless the graph returns any positions' logits."""
        if not self.scores_prompts:
            raise PromptScoringUnsupported(
                "this model's graph returns the last position's logits only: export it again "
                "(attnserve export MODEL --variants VARIANT) to score prompts"
            )

    def _positions(self, rows: int, width: int, all_positions: bool) -> IntArray:
        """`logit_positions` of a (rows, width) call: each row's last position, or all."""
        if not all_positions:
            return last_positions(rows, width)
        self.require_scoring()
        return np.arange(rows * width, dtype=np.int64)

    def _run(
        self,
        session: Any,
        ids: IntArray,
        mask: IntArray,
        state: LMState,
        positions: IntArray,
        prompt_lengths: IntArray | None = None,
    ) -> tuple[FloatArray, list[Tensor]]:
        feeds: dict[str, Any] = {
            "input_ids": np.ascontiguousarray(ids, dtype=np.int64),
            "attention_mask": np.ascontiguousarray(mask, dtype=np.int64),
            "past_mask": state.past_mask,
        }
        if self.scores_prompts:
            feeds[LOGIT_POSITIONS] = positions
        if self.rope_lengths:  # each row's length after the call, or its whole prompt's
            after = state.past_mask.sum(axis=1) + np.asarray(mask, dtype=np.int64).sum(axis=1)
            feeds[ROPE_LENGTHS] = rope_lengths(after, prompt_lengths)
        cache = dict(zip(self._past, state.past, strict=True))
        outputs = [LOGITS, *self._new]
        if self.io_binding:
            out = run_bound(session, feeds, cache, outputs, self.device, (LOGITS,))
        else:
            out = session.run(outputs, {**feeds, **cache})
        return np.asarray(out[0], dtype=np.float32), list(out[1:])

    def _grow(self, state: LMState, new: list[Tensor], mask: IntArray) -> LMState:
        """`state` with the new tokens' K/V (B, Hkv, T, D) appended, `mask` (B, T) their mask."""
        t, width = state.length, mask.shape[1]
        past, columns = self.rows.append(state.past, new, t, state.columns)
        past_mask = np.zeros((mask.shape[0], width_of(past[0])), dtype=np.int64)
        past_mask[:, :t] = state.past_mask[:, :t]
        past_mask[:, t : t + width] = mask
        return LMState(past, past_mask, t + width, columns)

    def empty(self, rows: int) -> LMState:
        """A state of `rows` rows with nothing cached (all columns spare)."""
        heads, dim = self._kv_shape
        past = [self.rows.empty((rows, heads, 0, dim), self.kv_dtype) for _ in self._past]
        past_mask = np.zeros((rows, width_of(past[0])), dtype=np.int64)
        return LMState(past, past_mask, 0, Columns(0))

    def extend(
        self,
        state: LMState,
        ids: IntArray,
        mask: IntArray,
        *,
        all_positions: bool = False,
        prompt_lengths: IntArray | None = None,
    ) -> tuple[FloatArray, LMState]:
        """Prefill a left-padded chunk `ids`/`mask` (B, T) after the rows' cached tokens;
        returns the logits of each row's last position (B, V), or with `all_positions` of
        every position (B, T, V; padding positions hold garbage), and the grown state.
        `prompt_lengths` (B,): each row's whole prompt, when the chunk is part of it (its
        rotary frequencies are then the prompt's: model/rope.py)."""
        rows, width = ids.shape
        positions = self._positions(rows, width, all_positions)
        logits, new = self._run(self.session, ids, mask, state, positions, prompt_lengths)
        if all_positions:
            logits = logits.reshape(rows, width, -1)
        return logits, self._grow(state, new, mask)

    # -- prompt reuse (engine/prefix_cache.py) ----------------------------------------------

    @property
    def reuses_prefixes(self) -> bool:
        """Whether the cache can be read out and written back (host buffers), and a prefix's
        K/V are the same whatever follows it (not so where the rotary frequencies depend on
        the prompt's length: dynamic, longrope)."""
        return not self.io_binding and not self.rope_lengths

    def prefix_columns(self, state: LMState, row: int, n: int, start: int = 0) -> np.ndarray:
        """Row `row`'s cached tokens `start` .. n - 1, every layer's K/V: (2L, Hkv, n - start,
        D), a copy. The row's tokens are its real columns (`past_mask`), wherever padding put
        them: left padding, a join's, a resumed prompt's gap between its prefix and its rest."""
        columns = np.flatnonzero(state.past_mask[row, : state.length])
        if columns.shape[0] < n:
            raise ValueError(f"row {row} holds {columns.shape[0]} tokens, not {n}")
        columns = columns[start:n]
        count = columns.shape[0]
        first = int(columns[0]) if count else 0
        if count and int(columns[-1]) - first + 1 == count:  # contiguous: slices, one copy
            return np.stack([np.asarray(t)[row, :, first : first + count] for t in state.past])
        return np.stack([np.asarray(t)[row][:, columns] for t in state.past])

    def from_prefixes(self, prefixes: Sequence[Sequence[np.ndarray]]) -> LMState:
        """A state of one row per prefix whose cache holds it: the prefix's blocks of K/V,
        (2L, Hkv, n, D) each, in order (none: nothing cached), left-padded to the longest."""
        heads, dim = self._kv_shape
        lengths = [sum(b.shape[2] for b in p) for p in prefixes]
        width, rows = max(lengths, default=0), len(prefixes)
        new = [np.zeros((rows, heads, width, dim), dtype=self.kv_dtype) for _ in self._past]
        mask = np.zeros((rows, width), dtype=np.int64)
        for row, (blocks, n) in enumerate(zip(prefixes, lengths, strict=True)):
            start = width - n
            mask[row, start:] = 1
            for block in blocks:
                end = start + block.shape[2]
                for i, tensor in enumerate(new):
                    tensor[row, :, start:end] = block[i]
                start = end
        return self._grow(self.empty(rows), list(new), mask)

    def encode(self, src_ids: IntArray, src_lengths: IntArray) -> LMState:
        ids, mask = left_padded(src_ids, src_lengths, self._spec.pad_id)
        start = first_used_column(mask)  # columns no row uses (all-empty prompts: all)
        state = self.empty(ids.shape[0])
        prompts = np.asarray(src_lengths, dtype=np.int64) + 1  # the last token comes in a step
        for begin in range(start, ids.shape[1], self.prefill_chunk):
            end = min(begin + self.prefill_chunk, ids.shape[1])
            chunk = (ids[:, begin:end], mask[:, begin:end])
            _, state = self.extend(state, *chunk, prompt_lengths=prompts)
        return state

    def step(self, tokens: IntArray, state: LMState) -> tuple[FloatArray, LMState]:
        ids = np.ascontiguousarray(tokens, dtype=np.int64)[:, None]  # (B, 1)
        return self.extend(state, ids, np.ones_like(ids))

    def reorder(self, state: LMState, rows: IntArray) -> LMState:
        """`select` for a caller that gives `state` up, as many rows as before: only rows whose
        source row differs are rewritten, in place."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        t, width = state.length, width_of(state.past[0])
        if rows.shape[0] != state.past_mask.shape[0]:
            return self.select(state, rows)
        mask = state.past_mask[rows]
        if (
            isinstance(self.rows, DeviceRowOps)  # no spare columns: a device copy is cheap
            or t >= width
            or first_used_column(mask[:, :t]) >= max(self.rows.spare, t // 4)
        ):
            return self.select(state, rows)  # grow, or trim the padding nobody uses
        return LMState(self.rows.reorder(state.past, rows, t), mask, t, state.columns)

    def select(self, state: LMState, rows: IntArray) -> LMState:
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        mask = state.past_mask[rows]  # (B', W)
        t = state.length
        start = first_used_column(mask[:, :t])
        if start == 0 and t < mask.shape[1]:
            return LMState(self.rows.take_rows(state.past, rows), mask, t, Columns(t))
        width = t - start + 1 + self.rows.spare
        past = self.rows.resize(state.past, rows, start, t, width)  # the device's: t - start
        past_mask = np.zeros((rows.shape[0], width_of(past[0])), dtype=np.int64)
        past_mask[:, : t - start] = mask[:, start:t]
        return LMState(past, past_mask, t - start, Columns(t - start))

    def concat(self, states: Sequence[LMState]) -> LMState:
        if len(states) == 1:
            return states[0]
        t_max = max(s.length for s in states)
        spare = self.rows.spare
        pads = [(t_max - s.length, spare) for s in states]  # left-pad the shorter pasts
        masks = [
            np.pad(s.past_mask[:, : s.length], ((0, 0), pad))
            for s, pad in zip(states, pads, strict=True)
        ]
        past = self.rows.concat([s.past for s in states], pads, [s.length for s in states])
        return LMState(past, np.concatenate(masks), t_max, Columns(t_max))
