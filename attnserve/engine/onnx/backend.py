"""ONNX Runtime as a Backend: encoder.onnx once per request, decoder.onnx once per step.

The state keeps the cross-attention K/V of every encoded source (not of every row: a request's
beams share them) and the self-attention cache of every row, as tensors the runtime reads
directly: numpy arrays, or with IO binding OrtValues that stay on the device (CUDA) between
steps, so that only the log-probs (or each row's best tokens, `step_candidates`) are copied back
to the host. The decoder graph returns only the new cache column of each step;
`engine.onnx.rowops` appends it (in place on the host) and moves rows when beams reorder and
requests join or leave. Masks, the row -> source index and the cross-attention slots are tiny
and always live on the host.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from attnserve.defaults import DEFAULT_PROVIDER, DEFAULT_VARIANT, PROVIDERS
from attnserve.engine.backend import Candidates, FloatArray, IntArray, ModelSpec
from attnserve.engine.memory import weights_on_huge_pages
from attnserve.engine.onnx.layout import (
    CANDIDATES,
    DECODER_INPUTS,
    DECODER_NAME,
    ENCODER_INPUTS,
    ENCODER_NAME,
    FULL_LOG_PROBS,
    KERNELS_VERSION,
    LOG_PROBS,
    TOP_IDS,
    TOP_LOG_PROBS,
    cross_names,
    new_names,
    past_names,
    read_manifest,
    require_graph,
    variant_dir,
)
from attnserve.engine.onnx.rowops import (
    Columns,
    DeviceRowOps,
    HostRowOps,
    Tensor,
    first_used_column,
    run_bound,
    slot_index,
    width_of,
)
from attnserve.kernels import REWRITES
from attnserve.kernels import register as register_kernels
from attnserve.model.checkpoint import ModelFileInvalidError, read_model_config
from attnserve.model.config import ModelConfig

log = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"

OPTIMIZATION_LEVELS = {
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
# ORT fusions whose CPU kernels are slower on these graphs than the ops they replace:
# SkipLayerNormalization at one query position per row (B, 1, C), and the attention scale
# folded into FusedMatMul's alpha instead of a Mul on the small query (docs/BENCHMARKS.md,
# "Tried and not kept"). They are disabled on the CPU provider only; CUDA keeps all.
SLOW_CPU_FUSIONS = ("SkipLayerNormFusion", "MatMulScaleFusion")
# Decoder outputs the host reads (with IO binding, the cache outputs stay on the device).
HOST_OUTPUTS = frozenset((LOG_PROBS, TOP_LOG_PROBS, TOP_IDS))
ONE_CANDIDATE = np.ones(1, dtype=np.int64)  # what `step` feeds a graph with a TopK it ignores
FULL, NOT_FULL = np.ones(1, dtype=np.int64), np.zeros(1, dtype=np.int64)  # `full_log_probs`


class OnnxModelError(ModelFileInvalidError):
    """An exported graph that ONNX Runtime cannot load or that does not match the model."""


@dataclass
class OnnxState:
    """The rows of a running batch. B rows decode N encoded sources (a beam request's rows
    share one); the cache tensors are W >= length columns wide (host: spare columns)."""

    src_mask: IntArray  # (N, S) int64, 1 = real source token
    cross: list[Tensor]  # 2L x (N, H, S, D): cross.{i}.key, cross.{i}.value
    row_source: IntArray  # (B,) int64: the source (index into src_mask / cross) of every row
    past: list[Tensor]  # 2L x (B, H, W, D): past.{i}.self.key, .value (left-padded)
    past_mask: IntArray  # (B, W) int64, 1 = real past column (0: left padding, spare columns)
    length: int  # columns in use; the next step's key/value go to column `length`
    columns: Columns  # shared by the states that share `past` (copy on write)
    row_slots: IntArray  # (B,) cross-attention query slot of every row (slot_index)
    slot_rows: IntArray  # (N * G,) row of every slot

    @classmethod
    def build(
        cls,
        src_mask: IntArray,
        cross: list[Tensor],
        row_source: IntArray,
        past: list[Tensor],
        past_mask: IntArray,
        length: int,
        columns: Columns,
    ) -> OnnxState:
        """A state with its cross-attention slots computed from `row_source`."""
        row_slots, slot_rows = slot_index(row_source, src_mask.shape[0])
        return cls(
            src_mask, cross, row_source, past, past_mask, length, columns, row_slots, slot_rows
        )


def choose_providers(provider: str, device_id: int = 0) -> list[Any]:
    """ORT providers for a setting: "cpu", "cuda" (falls back to CPU, warning) or "auto"."""
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}; choose from {', '.join(PROVIDERS)}")
    if provider == "cpu":
        return [CPU]
    if CUDA in ort.get_available_providers():
        return [(CUDA, {"device_id": device_id}), CPU]
    if provider == "cuda":
        log.warning("CUDAExecutionProvider is not available (onnxruntime-gpu?); using the CPU")
    else:
        log.info("no CUDAExecutionProvider; running on the CPU")
    return [CPU]


def session_options(
    threads: int | None = None, *, spinning: bool = False, optimization: str = "all"
) -> ort.SessionOptions:
    """Explicit session options: intra-op threads, one inter-op thread, spinning off by default."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or 0  # 0 = one per physical core
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = OPTIMIZATION_LEVELS[optimization]
    # Spinning threads burn CPU between steps, stealing it from whatever shares the process.
    flag = "1" if spinning else "0"
    options.add_session_config_entry("session.intra_op.allow_spinning", flag)
    options.add_session_config_entry("session.inter_op.allow_spinning", flag)
    options.log_severity_level = 3  # errors only
    return options


def open_session(
    path: Path,
    options: ort.SessionOptions,
    providers: Sequence[Any],
    inputs: Sequence[str],
    outputs: Sequence[str],
    disabled_optimizers: Sequence[str] = (),
) -> ort.InferenceSession:
    """An InferenceSession, or OnnxModelError naming the file when it is corrupt or mismatched."""
    try:
        # Weights the CPU reads from memory; on a GPU provider they live on the device.
        with weights_on_huge_pages(enabled=list(providers)[:1] == [CPU]):
            session = ort.InferenceSession(
                str(path),
                options,
                providers=list(providers),
                disabled_optimizers=list(disabled_optimizers) or None,
            )
    except Exception as exc:  # onnxruntime raises its own pybind types (InvalidProtobuf, Fail...)
        raise OnnxModelError(f"{path} is not a loadable ONNX model: {exc}") from exc
    have_in = {i.name for i in session.get_inputs()}
    have_out = {o.name for o in session.get_outputs()}
    missing = [n for n in inputs if n not in have_in] + [n for n in outputs if n not in have_out]
    if missing:
        raise OnnxModelError(f"{path} does not match the model: no {', '.join(missing)}")
    return session


def _dtype(session: ort.InferenceSession, name: str) -> np.dtype[Any]:
    kind = next(i.type for i in session.get_inputs() if i.name == name)
    return np.dtype(np.float16) if kind == "tensor(float16)" else np.dtype(np.float32)


class OnnxBackend:
    """encoder.onnx + decoder.onnx of one exported variant, behind the Backend protocol."""

    def __init__(
        self,
        config: ModelConfig,
        directory: str | Path,
        *,
        provider: str = DEFAULT_PROVIDER,
        threads: int | None = None,
        io_binding: bool | None = None,
        spinning: bool = False,
        optimization: str = "all",
        disabled_optimizers: Sequence[str] | None = None,
        device_id: int = 0,
        kernels: bool = True,
    ) -> None:
        directory = Path(directory)
        self._spec = ModelSpec.from_config(config)
        self.manifest = read_manifest(directory)
        self.variant = str(self.manifest.get("variant", directory.name))
        if (
            self.variant == "int8"
            and self.manifest.get("options", {}).get("activation_scales") != "row"
        ):
            log.warning(
                "%s quantizes activations per tensor: a request's output can depend on the "
                "requests that share its batch; re-export it (`attnserve export %s --variants "
                "int8`) for per-row scales",
                directory,
                directory.parent.parent,
            )
        n = config.decoder_layers
        self._head_shape = (config.n_heads, config.head_dim)
        self._cross, self._past, self._new = cross_names(n), past_names(n), new_names(n)
        options = session_options(threads, spinning=spinning, optimization=optimization)
        providers = choose_providers(provider, device_id)
        if disabled_optimizers is None:
            disabled_optimizers = SLOW_CPU_FUSIONS if providers[0] == CPU else ()
        # attnserve's kernels, where the graph has them and this is the CPU provider (elsewhere
        # the graph's functions run their stock bodies)
        self.kernels = providers[0] == CPU and kernels and register_kernels(options)
        if (
            self.kernels
            and self.variant in ("fp32", "int8")
            and int(self.manifest.get("options", {}).get(KERNELS_VERSION, 0)) < REWRITES
        ):
            log.info(
                "%s was exported for an older version of attnserve's kernels: re-export it "
                "(`attnserve export %s --variants %s`) to run every node they cover on them",
                directory,
                directory.parent.parent,
                self.variant,
            )
        self.disabled_optimizers = tuple(disabled_optimizers)
        self.encoder = open_session(
            require_graph(directory, ENCODER_NAME),
            options,
            providers,
            ENCODER_INPUTS,
            self._cross,
            self.disabled_optimizers,
        )
        self.decoder = open_session(
            require_graph(directory, DECODER_NAME),
            options,
            providers,
            [*DECODER_INPUTS, *self._past, *self._cross],
            [LOG_PROBS, *self._new],
            self.disabled_optimizers,
        )
        self.provider = self.decoder.get_providers()[0]
        if providers[0] != CPU and self.provider != CUDA:
            log.warning("the CUDA provider failed to load; running on the CPU")
        # Graphs exported before the decoder returned its best tokens have whole rows only.
        self._has_candidates = TOP_IDS in {o.name for o in self.decoder.get_outputs()}
        # Graphs whose log-softmax runs on attnserve's kernel: a flag says when to write the
        # (B, V) log-probs (a step that reads only each row's best tokens skips them).
        self._has_full_switch = FULL_LOG_PROBS in {i.name for i in self.decoder.get_inputs()}
        self.candidates = self._has_candidates  # RunningBatch may ask for them (a switch)
        self.kv_dtype = _dtype(self.decoder, self._past[0])
        on_cuda = self.provider == CUDA
        self.device = ("cuda", device_id) if on_cuda else ("cpu", 0)
        self.io_binding = on_cuda if io_binding is None else io_binding
        self.rows: HostRowOps | DeviceRowOps = (
            DeviceRowOps(self.kv_dtype, providers, options, self.device)
            if self.io_binding
            else HostRowOps()
        )
        # RunningBatch.encode: what one more encoder call costs in padded source tokens. On
        # CUDA a call's launch overhead dwarfs a token's cost (and each count of buckets would
        # build a concat session): encode a group in one call there.
        self.encode_call_tokens = 1024 if on_cuda else 16
        log.info(
            "onnx %s on %s (io binding %s, threads %s)",
            self.variant,
            self.provider,
            self.io_binding,
            threads or "default",
        )

    @classmethod
    def from_dir(
        cls, model_dir: str | Path, variant: str = DEFAULT_VARIANT, **kwargs: Any
    ) -> OnnxBackend:
        """The exported `variant` of a model directory (MODEL_DIR/onnx/<variant>/)."""
        return cls(read_model_config(model_dir), variant_dir(model_dir, variant), **kwargs)

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    def _run(
        self,
        session: ort.InferenceSession,
        host: dict[str, IntArray],
        tensors: dict[str, Tensor],
        outputs: Sequence[str],
    ) -> list[Tensor]:
        """Run a session; with IO binding, outputs stay on the device except log_probs."""
        if not self.io_binding:
            return list(session.run(list(outputs), {**host, **tensors}))
        return run_bound(session, host, tensors, outputs, self.device, HOST_OUTPUTS)

    def _join_in_place(
        self, state: OnnxState, new: OnnxState, rows: HostRowOps
    ) -> OnnxState | None:
        """Freshly encoded rows (`new`, no past yet) written into the spare rows of `state`'s
        tensors: only their cross K/V are copied, not the whole batch. None when there is no
        room (the caller concatenates)."""
        n, m = new.past_mask.shape[0], new.src_mask.shape[0]
        width = state.src_mask.shape[1]
        if new.length != 0 or new.src_mask.shape[1] > width:
            return None
        if not (rows.room(state.past, n) and rows.room(state.cross, m)):
            return None
        src_pad = ((0, 0), (0, width - new.src_mask.shape[1]))
        return OnnxState.build(
            np.concatenate([state.src_mask, np.pad(new.src_mask, src_pad)]),
            rows.extend(state.cross, m, new.cross),
            np.concatenate([state.row_source, new.row_source + state.src_mask.shape[0]]),
            rows.extend(state.past, n),
            np.concatenate([state.past_mask, np.zeros((n, state.past_mask.shape[1]), np.int64)]),
            state.length,
            state.columns,
        )

    def encode(self, src_ids: IntArray, src_lengths: IntArray) -> OnnxState:
        ids = np.ascontiguousarray(src_ids, dtype=np.int64)  # (N, S)
        lengths = np.asarray(src_lengths, dtype=np.int64)
        mask = (np.arange(ids.shape[1])[None, :] < lengths[:, None]).astype(np.int64)  # (N, S)
        cross = self._run(self.encoder, {"input_ids": ids, "attention_mask": mask}, {}, self._cross)
        rows = ids.shape[0]
        empty = (rows, self._head_shape[0], 0, self._head_shape[1])  # (B, H, 0, D)
        past = [self.rows.empty(empty, self.kv_dtype) for _ in self._past]
        past_mask = np.zeros((rows, width_of(past[0])), dtype=np.int64)
        row_source = np.arange(rows, dtype=np.int64)
        return OnnxState.build(mask, cross, row_source, past, past_mask, 0, Columns(0))

    def step(self, tokens: IntArray, state: OnnxState) -> tuple[FloatArray, OnnxState]:
        feed = {CANDIDATES: ONE_CANDIDATE} if self._has_candidates else {}
        if self._has_full_switch:
            feed[FULL_LOG_PROBS] = FULL
        out, grown = self._step(tokens, state, [LOG_PROBS], feed)
        return np.asarray(out[0], dtype=np.float32), grown  # (B, V)

    def step_candidates(
        self, tokens: IntArray, state: OnnxState, k: int
    ) -> tuple[Candidates, OnnxState]:
        """`step` returning each row's k best tokens (the graph's TopK), so that the host never
        reads the (B, V) log-probs; only when `self.candidates` (the graph has them)."""
        feed = {CANDIDATES: np.array([k], dtype=np.int64)}
        if self._has_full_switch:
            feed[FULL_LOG_PROBS] = NOT_FULL
        out, grown = self._step(tokens, state, [TOP_LOG_PROBS, TOP_IDS], feed)
        return Candidates(np.asarray(out[0], dtype=np.float32), np.asarray(out[1])), grown

    def _step(
        self,
        tokens: IntArray,
        state: OnnxState,
        outputs: list[str],
        extra: dict[str, IntArray],
    ) -> tuple[list[Tensor], OnnxState]:
        """One decoder call: `outputs` (host arrays) and the state grown by the new column."""
        host = {
            "input_ids": np.ascontiguousarray(tokens, dtype=np.int64),  # (B,)
            "encoder_attention_mask": state.src_mask,  # (N, S)
            "past_mask": state.past_mask,  # (B, W)
            "row_slots": state.row_slots,  # (B,)
            "slot_rows": state.slot_rows,  # (N * G,)
            **extra,
        }
        tensors = dict(zip(self._past, state.past, strict=True))
        tensors.update(zip(self._cross, state.cross, strict=True))
        out = self._run(self.decoder, host, tensors, [*outputs, *self._new])
        n = len(outputs)
        t = state.length
        past, columns = self.rows.append(state.past, out[n:], t, state.columns)
        width = width_of(past[0])
        past_mask = np.zeros((len(tokens), width), dtype=np.int64)  # (B, W')
        past_mask[:, :t] = state.past_mask[:, :t]
        past_mask[:, t] = 1
        grown = OnnxState(
            state.src_mask,
            state.cross,
            state.row_source,
            past,
            past_mask,
            t + 1,
            columns,
            state.row_slots,
            state.slot_rows,
        )
        return out[:n], grown

    def _sources(self, state: OnnxState, rows: IntArray) -> tuple[IntArray, list[Tensor], IntArray]:
        """src_mask, cross K/V and row -> source index of the rows `rows` of `state`."""
        row_source = state.row_source[rows]
        src_mask, cross = state.src_mask, state.cross
        counts = np.bincount(row_source, minlength=src_mask.shape[0])
        if 2 * np.count_nonzero(counts) <= counts.size:
            # Half the sources lost all their rows: drop their K/V. Fewer dead sources stay (no
            # row reads them) so that a request leaving does not copy every other one's K/V.
            kept = np.flatnonzero(counts)
            src_mask, cross = src_mask[kept], self.rows.select(cross, kept, 0)
            row_source = (np.cumsum(counts > 0) - 1)[row_source]
        return src_mask, cross, row_source

    def reorder(self, state: OnnxState, rows: IntArray) -> OnnxState:
        """`select` for a caller that gives `state` up (the running batch after a step): as
        many rows as before, and on the host path only the rows whose source row differs are
        rewritten, in place (a beam step moves a few beams, not the whole cache)."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        t, width = state.length, width_of(state.past[0])
        if not isinstance(self.rows, HostRowOps) or rows.shape[0] != state.row_source.shape[0]:
            return self.select(state, rows)
        mask = state.past_mask[rows]
        if t >= width or first_used_column(mask[:, :t]) >= max(self.rows.spare, t // 4):
            return self.select(state, rows)  # grow, or trim the padding nobody uses
        src_mask, cross, row_source = self._sources(state, rows)
        past = self.rows.reorder(state.past, rows, t)
        return OnnxState.build(src_mask, cross, row_source, past, mask, t, state.columns)

    def select(self, state: OnnxState, rows: IntArray) -> OnnxState:
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        src_mask, cross, row_source = self._sources(state, rows)
        mask = state.past_mask[rows]  # (B', W)
        t = state.length
        start = first_used_column(mask[:, :t])
        if start == 0 and t < mask.shape[1]:
            # No padding to trim and room for the next column: copy whole rows, once.
            past = self.rows.take_rows(state.past, rows)
            return OnnxState.build(src_mask, cross, row_source, past, mask, t, Columns(t))
        width = t - start + 1 + self.rows.spare
        past = self.rows.resize(state.past, rows, start, t, width)
        past_mask = np.zeros((rows.shape[0], width_of(past[0])), dtype=np.int64)
        past_mask[:, : t - start] = mask[:, start:t]
        return OnnxState.build(
            src_mask, cross, row_source, past, past_mask, t - start, Columns(t - start)
        )

    def concat(self, states: Sequence[OnnxState]) -> OnnxState:
        if len(states) == 1:
            return states[0]
        if len(states) == 2 and isinstance(self.rows, HostRowOps):
            joined = self._join_in_place(states[0], states[1], self.rows)
            if joined is not None:
                return joined
        s_max = max(s.src_mask.shape[1] for s in states)
        if isinstance(self.rows, HostRowOps):
            # Room to spare (multiples of 16 positions): later joins of slightly longer sources
            # still fit in place.
            s_max = -(-s_max // 16) * 16
        t_max = max(s.length for s in states)
        spare = self.rows.spare
        src_pads = [(0, s_max - s.src_mask.shape[1]) for s in states]  # right-pad sources
        past_pads = [(t_max - s.length, spare) for s in states]  # left-pad the past
        offsets = np.cumsum([0] + [s.src_mask.shape[0] for s in states])
        masks = [
            np.pad(s.past_mask[:, : s.length], ((0, 0), pad))
            for s, pad in zip(states, past_pads, strict=True)
        ]
        return OnnxState.build(
            np.concatenate(
                [np.pad(s.src_mask, ((0, 0), p)) for s, p in zip(states, src_pads, strict=True)]
            ),
            self.rows.concat([s.cross for s in states], src_pads),
            np.concatenate([s.row_source + o for s, o in zip(states, offsets, strict=False)]),
            self.rows.concat([s.past for s in states], past_pads, [s.length for s in states]),
            np.concatenate(masks),
            t_max,
            Columns(t_max),
        )
