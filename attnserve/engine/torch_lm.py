"""A decoder-only PyTorch language model as a Backend (the reference runtime for generation).

`encode` prefills prompts into a left-padded KV cache (all but each prompt's last token, which
the search feeds to the first step, with the rotary frequencies of the whole prompt's length),
`step` appends one token per row and returns its logits, and `select` / `concat` move cache
rows as for the encoder-decoder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from attnserve.engine.backend import FloatArray, IntArray, ModelSpec, left_padded

if TYPE_CHECKING:
    import torch

    from attnserve.model.cache import KVCache
    from attnserve.model.decoder_config import DecoderConfig
    from attnserve.model.decoder_only import DecoderOnly


def lm_spec(config: DecoderConfig, stop_ids: Sequence[int] = ()) -> ModelSpec:
    """What decoding needs to know about a language model: its eos ids (and `stop_ids`, e.g. a
    chat template's end-of-turn token) stop a row, nothing is banned, the context bounds it."""
    eos, *more = config.eos_ids
    stops = tuple(dict.fromkeys(i for i in (*more, *stop_ids) if i != eos))
    return ModelSpec(
        vocab_size=config.vocab_size,
        pad_id=config.pad_id,
        eos_id=eos,
        start_id=config.bos_id if config.bos_id is not None else config.pad_id,
        max_positions=config.max_positions,
        decoder_only=True,
        stop_ids=stops,
        banned_ids=(),
        returns_logits=True,
    )


@dataclass
class LMState:
    cache: KVCache


class TorchLMBackend:
    """Runs a DecoderOnly under torch.inference_mode on numpy inputs."""

    def __init__(
        self, model: DecoderOnly, *, threads: int | None = None, stop_ids: Sequence[int] = ()
    ) -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self._spec = lm_spec(model.config, stop_ids)
        self.scores_prompts = True  # `extend` returns every position's logits when asked

    @classmethod
    def from_dir(
        cls, model_dir: str | Path, *, threads: int | None = None, stop_ids: Sequence[int] = ()
    ) -> TorchLMBackend:
        from attnserve.model.decoder_checkpoint import load_decoder_dir

        return cls(load_decoder_dir(model_dir), threads=threads, stop_ids=stop_ids)

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    def _tensor(self, array: IntArray) -> torch.Tensor:
        import torch

        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(self.device)

    def empty(self, rows: int) -> LMState:
        """A state of `rows` rows with nothing cached."""
        return LMState(self.model.empty_cache(rows))

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
        import torch

        lengths = None if prompt_lengths is None else self._tensor(prompt_lengths)
        with torch.inference_mode():
            logits, cache = self.model.prefill(
                self._tensor(ids), self._tensor(mask), state.cache, rope_lengths=lengths
            )
        assert logits is not None
        kept = logits if all_positions else logits[:, -1]
        return kept.float().cpu().numpy(), LMState(cache)

    @property
    def reuses_prefixes(self) -> bool:
        """Whether a prefix's K/V are the same whatever follows it (not so where the rotary
        frequencies depend on the prompt's length: dynamic, longrope)."""
        from attnserve.model.rope import length_dependent

        return not length_dependent(self.model.config)

    def prefix_columns(self, state: LMState, row: int, n: int, start: int = 0) -> np.ndarray:
        """Row `row`'s cached tokens `start` .. n - 1, every layer's K/V: (2L, Hkv, n - start,
        D), a copy. The row's tokens are its real columns (the cache's mask), wherever padding
        put them."""
        import torch

        cache = state.cache
        columns = torch.nonzero(cache.mask[row]).flatten()
        if columns.shape[0] < n:
            raise ValueError(f"row {row} holds {columns.shape[0]} tokens, not {n}")
        columns = columns[start:n]
        tensors = [t for pair in zip(cache.keys, cache.values, strict=True) for t in pair]
        return torch.stack([t[row][:, columns] for t in tensors]).float().cpu().numpy()

    def from_prefixes(self, prefixes: Sequence[Sequence[np.ndarray]]) -> LMState:
        """A state of one row per prefix whose cache holds it: the prefix's blocks of K/V,
        (2L, Hkv, n, D) each, in order (none: nothing cached), left-padded to the longest."""
        import torch

        from attnserve.model.cache import KVCache

        rows = len(prefixes)
        lengths = [sum(b.shape[2] for b in p) for p in prefixes]
        width = max(lengths, default=0)
        empty = self.model.empty_cache(rows)
        dtype = empty.keys[0].dtype
        layers = len(empty.keys)
        heads, dim = empty.keys[0].shape[1], empty.keys[0].shape[3]
        kv = torch.zeros((2 * layers, rows, heads, width, dim), dtype=dtype, device=self.device)
        mask = torch.zeros((rows, width), dtype=torch.bool, device=self.device)
        for row, (blocks, n) in enumerate(zip(prefixes, lengths, strict=True)):
            start = width - n
            mask[row, start:] = True
            for block in blocks:
                end = start + block.shape[2]
                kv[:, row, :, start:end] = torch.from_numpy(block).to(dtype)
                start = end
        keys = [kv[2 * i] for i in range(layers)]
        values = [kv[2 * i + 1] for i in range(layers)]
        return LMState(KVCache(keys, values, mask))

    def encode(self, src_ids: IntArray, src_lengths: IntArray) -> LMState:
        import torch

        ids, mask = left_padded(src_ids, src_lengths, self._spec.pad_id)
        cache = self.model.empty_cache(ids.shape[0])
        if int(src_lengths.max(initial=0)) == 0:
            return LMState(cache)
        # a prompt's last token comes in the first step: its length is one more than prefilled
        lengths = self._tensor(np.asarray(src_lengths) + 1)
        with torch.inference_mode():
            _, cache = self.model.prefill(
                self._tensor(ids), self._tensor(mask), cache, logits=False, rope_lengths=lengths
            )
        return LMState(cache)

    def step(self, tokens: IntArray, state: LMState) -> tuple[FloatArray, LMState]:
        import torch

        with torch.inference_mode():
            logits, cache = self.model.decode_step(self._tensor(tokens), state.cache)
        return logits.float().cpu().numpy(), LMState(cache)

    def select(self, state: LMState, rows: IntArray) -> LMState:
        return LMState(state.cache.select(self._tensor(rows)))

    def concat(self, states: Sequence[LMState]) -> LMState:
        from attnserve.model.cache import KVCache

        return LMState(KVCache.concat([s.cache for s in states]))
