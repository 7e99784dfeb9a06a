"""ONNX Runtime as a Backend: encoder.onnx once per request, decoder.onnx once per step.

The state keeps the cross-attention K/V and the self-attention cache of every row as tensors the
runtime can feed straight back: numpy arrays, or with IO binding OrtValues that stay on the
device (CUDA) between steps, so that only the log-probs are copied back to the host. Masks and
the `sources` index are tiny and always live on the host; row operations read them to compute
the gather indices and pads (see `onnx_rowops`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from attnserve.engine.backend import FloatArray, IntArray, ModelSpec
from attnserve.engine.onnx_layout import (
    DECODER_INPUTS,
    DECODER_NAME,
    ENCODER_INPUTS,
    ENCODER_NAME,
    LOG_PROBS,
    cross_names,
    past_names,
    present_names,
    read_manifest,
    require_graph,
    variant_dir,
)
from attnserve.engine.onnx_rowops import DeviceRowOps
from attnserve.model.checkpoint import ModelFileInvalidError, read_model_config
from attnserve.model.config import ModelConfig

log = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
PROVIDERS = ("cpu", "cuda", "auto")
OPTIMIZATION_LEVELS = {
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
# A cache tensor: a numpy array (host path) or an onnxruntime.OrtValue (IO binding path).
Tensor = Any


class OnnxModelError(ModelFileInvalidError):
    """An exported graph that ONNX Runtime cannot load or that does not match the model."""


@dataclass
class OnnxState:
    src_mask: IntArray  # (B, S) int64, 1 = real source token
    cross: list[Tensor]  # 2L x (B, H, S, D): cross.{i}.key, cross.{i}.value
    past: list[Tensor]  # 2L x (B, H, T, D): past.{i}.self.key, .value (left-padded)
    past_mask: IntArray  # (B, T) int64, 1 = real past column
    # Which encoded source every row decodes: `select` skips the cross K/V when it is unchanged.
    sources: IntArray


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
) -> ort.InferenceSession:
    """An InferenceSession, or OnnxModelError naming the file when it is corrupt or mismatched."""
    try:
        session = ort.InferenceSession(str(path), options, providers=list(providers))
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


def first_used_column(mask: IntArray) -> int:
    """First past column that some row uses (the left padding shared by all rows ends)."""
    if mask.shape[0] == 0 or mask.shape[1] == 0:
        return 0
    used = mask.any(axis=0)
    return int(used.argmax()) if used.any() else int(mask.shape[1])


class HostRowOps:
    """Row operations on numpy tensors (the CPU path without IO binding)."""

    def select(self, tensors: Sequence[Tensor], rows: IntArray, start: int) -> list[Tensor]:
        """tensors[j][rows][:, :, start:], one contiguous copy each."""
        return [t[rows, :, start:] for t in tensors]

    def concat(
        self, groups: Sequence[Sequence[Tensor]], pads: Sequence[tuple[int, int]]
    ) -> list[Tensor]:
        """Row-concatenation, group m padded by pads[m] = (left, right) columns on axis 2."""
        out = []
        for j in range(len(groups[0])):
            parts = [g[j] for g in groups]
            _, h, t, d = parts[0].shape
            width = pads[0][0] + t + pads[0][1]
            y = np.zeros((sum(p.shape[0] for p in parts), h, width, d), dtype=parts[0].dtype)
            row = 0
            for part, (left, _) in zip(parts, pads, strict=True):
                y[row : row + part.shape[0], :, left : left + part.shape[2]] = part
                row += part.shape[0]
            out.append(y)
        return out

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Tensor:
        return np.zeros(shape, dtype=dtype)


class OnnxBackend:
    """encoder.onnx + decoder.onnx of one exported variant, behind the Backend protocol."""

    def __init__(
        self,
        config: ModelConfig,
        directory: str | Path,
        *,
        provider: str = "auto",
        threads: int | None = None,
        io_binding: bool | None = None,
        spinning: bool = False,
        optimization: str = "all",
        device_id: int = 0,
    ) -> None:
        directory = Path(directory)
        self._spec = ModelSpec(
            vocab_size=config.target_vocab_size,
            pad_id=config.pad_id,
            eos_id=config.eos_id,
            start_id=config.start_id,
            max_positions=config.max_positions,
        )
        self.manifest = read_manifest(directory)
        self.variant = str(self.manifest.get("variant", directory.name))
        n = config.decoder_layers
        self._head_shape = (config.n_heads, config.head_dim)
        self._cross, self._past, self._present = cross_names(n), past_names(n), present_names(n)
        options = session_options(threads, spinning=spinning, optimization=optimization)
        providers = choose_providers(provider, device_id)
        self.encoder = open_session(
            require_graph(directory, ENCODER_NAME),
            options,
            providers,
            ENCODER_INPUTS,
            self._cross,
        )
        self.decoder = open_session(
            require_graph(directory, DECODER_NAME),
            options,
            providers,
            [*DECODER_INPUTS, *self._past, *self._cross],
            [LOG_PROBS, *self._present],
        )
        self.provider = self.decoder.get_providers()[0]
        if providers[0] != CPU and self.provider != CUDA:
            log.warning("the CUDA provider failed to load; running on the CPU")
        self.kv_dtype = _dtype(self.decoder, self._past[0])
        on_cuda = self.provider == CUDA
        self.device = ("cuda", device_id) if on_cuda else ("cpu", 0)
        self.io_binding = on_cuda if io_binding is None else io_binding
        self.rows: HostRowOps | DeviceRowOps = (
            DeviceRowOps(self.kv_dtype, providers, options, self.device)
            if self.io_binding
            else HostRowOps()
        )
        self._next_source = 0
        log.info(
            "onnx %s on %s (io binding %s, threads %s)",
            self.variant,
            self.provider,
            self.io_binding,
            threads or "default",
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path, variant: str = "int8", **kwargs: Any) -> OnnxBackend:
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
        binding = session.io_binding()
        for name, array in host.items():
            binding.bind_cpu_input(name, array)
        for name, value in tensors.items():
            binding.bind_ortvalue_input(name, value)
        for name in outputs:
            if name == LOG_PROBS:
                binding.bind_output(name, "cpu")
            else:
                binding.bind_output(name, *self.device)
        session.run_with_iobinding(binding)
        values = binding.get_outputs()
        return [v.numpy() if n == LOG_PROBS else v for n, v in zip(outputs, values, strict=True)]

    def encode(self, src_ids: IntArray, src_lengths: IntArray) -> OnnxState:
        ids = np.ascontiguousarray(src_ids, dtype=np.int64)  # (B, S)
        lengths = np.asarray(src_lengths, dtype=np.int64)
        mask = (np.arange(ids.shape[1])[None, :] < lengths[:, None]).astype(np.int64)  # (B, S)
        cross = self._run(self.encoder, {"input_ids": ids, "attention_mask": mask}, {}, self._cross)
        rows = ids.shape[0]
        empty = (rows, self._head_shape[0], 0, self._head_shape[1])  # (B, H, 0, D)
        past = [self.rows.empty(empty, self.kv_dtype) for _ in self._past]
        sources = np.arange(self._next_source, self._next_source + rows, dtype=np.int64)
        self._next_source += rows
        return OnnxState(mask, cross, past, np.zeros((rows, 0), dtype=np.int64), sources)

    def step(self, tokens: IntArray, state: OnnxState) -> tuple[FloatArray, OnnxState]:
        host = {
            "input_ids": np.ascontiguousarray(tokens, dtype=np.int64),  # (B,)
            "encoder_attention_mask": state.src_mask,
            "past_mask": state.past_mask,
        }
        tensors = dict(zip(self._past, state.past, strict=True))
        tensors.update(zip(self._cross, state.cross, strict=True))
        out = self._run(self.decoder, host, tensors, [LOG_PROBS, *self._present])
        log_probs = np.asarray(out[0], dtype=np.float32)  # (B, V)
        ones = np.ones((state.past_mask.shape[0], 1), dtype=np.int64)
        past_mask = np.concatenate([state.past_mask, ones], axis=1)  # (B, T+1)
        return log_probs, OnnxState(state.src_mask, state.cross, out[1:], past_mask, state.sources)

    def select(self, state: OnnxState, rows: IntArray) -> OnnxState:
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        past_mask = state.past_mask[rows]
        start = first_used_column(past_mask)
        past = self.rows.select(state.past, rows, start)
        sources = state.sources[rows]
        if np.array_equal(sources, state.sources):
            src_mask, cross = state.src_mask, state.cross
        else:
            src_mask, cross = state.src_mask[rows], self.rows.select(state.cross, rows, 0)
        return OnnxState(src_mask, cross, past, np.ascontiguousarray(past_mask[:, start:]), sources)

    def concat(self, states: Sequence[OnnxState]) -> OnnxState:
        if len(states) == 1:
            return states[0]
        s_max = max(s.src_mask.shape[1] for s in states)
        t_max = max(s.past_mask.shape[1] for s in states)
        src_pads = [(0, s_max - s.src_mask.shape[1]) for s in states]  # right-pad sources
        past_pads = [(t_max - s.past_mask.shape[1], 0) for s in states]  # left-pad the past
        return OnnxState(
            np.concatenate(
                [np.pad(s.src_mask, ((0, 0), p)) for s, p in zip(states, src_pads, strict=True)]
            ),
            self.rows.concat([s.cross for s in states], src_pads),
            self.rows.concat([s.past for s in states], past_pads),
            np.concatenate(
                [np.pad(s.past_mask, ((0, 0), p)) for s, p in zip(states, past_pads, strict=True)]
            ),
            np.concatenate([s.sources for s in states]),
        )
