"""Explicit decoding state: encoder outputs (cross-attention K/V) and the self-attention KV cache.

Both support the row operations that beam search and continuous batching need: `select` (keep,
drop or repeat rows in a new order) and `concat` (rows of different requests joining one batch).

The self-attention cache is left-padded: every row appends its new key/value at the same column,
and `mask` marks which past columns are real. A row that joins a running batch with a shorter
history gets masked columns on the left, so rows of different lengths share one tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class EncoderState:
    """What the decoder needs from the encoder, computed once per request."""

    cross_keys: list[Tensor]  # per decoder layer (B, H, S, D)
    cross_values: list[Tensor]  # per decoder layer (B, H, S, D)
    src_mask: Tensor  # (B, S) bool, True = real source token

    @property
    def batch_size(self) -> int:
        return int(self.src_mask.shape[0])

    def select(self, rows: Tensor) -> EncoderState:
        """Rows `rows` (any order, repeats allowed) of this state."""
        return EncoderState(
            [k.index_select(0, rows) for k in self.cross_keys],
            [v.index_select(0, rows) for v in self.cross_values],
            self.src_mask.index_select(0, rows),
        )

    @staticmethod
    def concat(states: Sequence[EncoderState]) -> EncoderState:
        """Stack the rows of several states, right-padding the source axis."""
        if len(states) == 1:
            return states[0]
        s_max = max(int(s.src_mask.shape[1]) for s in states)

        def pad(x: Tensor, dim: int) -> Tensor:
            missing = s_max - x.shape[dim]
            if missing == 0:
                return x
            shape = list(x.shape)
            shape[dim] = missing
            return torch.cat([x, x.new_zeros(shape)], dim=dim)

        n_layers = len(states[0].cross_keys)
        return EncoderState(
            [torch.cat([pad(s.cross_keys[i], 2) for s in states]) for i in range(n_layers)],
            [torch.cat([pad(s.cross_values[i], 2) for s in states]) for i in range(n_layers)],
            torch.cat([pad(s.src_mask, 1) for s in states]),
        )


@dataclass
class KVCache:
    """Self-attention keys and values of every decoder layer for all past target positions."""

    keys: list[Tensor]  # per layer (B, H, T, D); H = key/value heads (fewer than query heads: GQA)
    values: list[Tensor]  # per layer (B, H, T, D)
    mask: Tensor  # (B, T) bool, True = a real past position (left padding is False)

    @classmethod
    def empty(
        cls,
        batch: int,
        n_layers: int,
        n_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        shape = (batch, n_heads, 0, head_dim)
        return cls(
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)],
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)],
            torch.zeros((batch, 0), dtype=torch.bool, device=device),
        )

    @property
    def batch_size(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        """Number of cached columns T (including left padding)."""
        return int(self.mask.shape[1])

    def positions(self) -> Tensor:
        """Position of the next token of every row: its number of real past tokens. (B,)"""
        return self.mask.sum(dim=1)

    def select(self, rows: Tensor) -> KVCache:
        """Rows `rows` (any order, repeats allowed), trimming columns no remaining row uses."""
        mask = self.mask.index_select(0, rows)
        start = _first_used_column(mask)
        return KVCache(
            [k.index_select(0, rows)[:, :, start:] for k in self.keys],
            [v.index_select(0, rows)[:, :, start:] for v in self.values],
            mask[:, start:],
        )

    @staticmethod
    def concat(caches: Sequence[KVCache]) -> KVCache:
        """Stack the rows of several caches, left-padding the time axis."""
        if len(caches) == 1:
            return caches[0]
        t_max = max(c.length for c in caches)

        def pad(x: Tensor, dim: int) -> Tensor:
            missing = t_max - x.shape[dim]
            if missing == 0:
                return x
            shape = list(x.shape)
            shape[dim] = missing
            return torch.cat([x.new_zeros(shape), x], dim=dim)

        n_layers = len(caches[0].keys)
        return KVCache(
            [torch.cat([pad(c.keys[i], 2) for c in caches]) for i in range(n_layers)],
            [torch.cat([pad(c.values[i], 2) for c in caches]) for i in range(n_layers)],
            torch.cat([pad(c.mask, 1) for c in caches]),
        )


def _first_used_column(mask: Tensor) -> int:
    """Index of the first column that some row uses (left padding shared by all rows ends)."""
    if mask.shape[1] == 0 or mask.shape[0] == 0:
        return 0
    used = mask.any(dim=0)
    if not bool(used.any()):
        return int(mask.shape[1])
    return int(used.to(torch.int8).argmax())
