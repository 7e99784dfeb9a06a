"""The PyTorch model as a Backend (the reference runtime; ONNX Runtime is the fast one)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from attnserve.engine.backend import FloatArray, IntArray, ModelSpec

if TYPE_CHECKING:
    import torch

    from attnserve.model.cache import EncoderState, KVCache
    from attnserve.model.transformer import EncoderDecoder


@dataclass
class TorchState:
    encoder: EncoderState
    cache: KVCache
    # Which encoded source every row decodes (ids unique per encode call): lets `select` skip
    # copying the cross-attention K/V when rows only move among beams of the same source.
    sources: IntArray


class TorchBackend:
    """Runs an EncoderDecoder under torch.inference_mode on numpy inputs."""

    def __init__(self, model: EncoderDecoder, *, threads: int | None = None) -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.model = model.eval()
        self._next_source = 0
        self.device = next(model.parameters()).device
        self._spec = ModelSpec.from_config(model.config)

    @classmethod
    def from_dir(cls, model_dir: str | Path, *, threads: int | None = None) -> TorchBackend:
        from attnserve.model.checkpoint import load_model_dir

        model, _ = load_model_dir(model_dir)
        return cls(model, threads=threads)

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    def _tensor(self, array: IntArray) -> torch.Tensor:
        import torch

        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(self.device)

    def encode(self, src_ids: IntArray, src_lengths: IntArray) -> TorchState:
        import torch

        ids = self._tensor(src_ids)
        lengths = self._tensor(src_lengths)
        mask = torch.arange(ids.shape[1], device=self.device)[None, :] < lengths[:, None]
        with torch.inference_mode():
            encoder = self.model.encode(ids, mask)
        rows = ids.shape[0]
        sources = np.arange(self._next_source, self._next_source + rows, dtype=np.int64)
        self._next_source += rows
        return TorchState(encoder, self.model.empty_cache(rows), sources)

    def step(self, tokens: IntArray, state: TorchState) -> tuple[FloatArray, TorchState]:
        import torch

        with torch.inference_mode():
            logits, cache = self.model.decode_step(self._tensor(tokens), state.encoder, state.cache)
            log_probs = torch.log_softmax(logits.float(), dim=-1)
        return log_probs.cpu().numpy(), TorchState(state.encoder, cache, state.sources)

    def select(self, state: TorchState, rows: IntArray) -> TorchState:
        index = self._tensor(rows)
        sources = state.sources[rows]
        same_sources = np.array_equal(sources, state.sources)
        encoder = state.encoder if same_sources else state.encoder.select(index)
        return TorchState(encoder, state.cache.select(index), sources)

    def concat(self, states: Sequence[TorchState]) -> TorchState:
        from attnserve.model.cache import EncoderState, KVCache

        return TorchState(
            EncoderState.concat([s.encoder for s in states]),
            KVCache.concat([s.cache for s in states]),
            np.concatenate([s.sources for s in states]),
        )
