"""Transformer building blocks: sinusoidal positions, multi-head attention, feed-forward, layers."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnserve.model.config import ModelConfig

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "swish": F.silu,
}


def sinusoidal_table(n_positions: int, dim: int) -> Tensor:
    """Marian's table: sin in the first half of the channels, cos in the second. (P, dim)"""
    half = dim // 2
    position = torch.arange(n_positions, dtype=torch.float64)[:, None]
    inv_freq = torch.exp(torch.arange(half, dtype=torch.float64) * (-2.0 * math.log(10000.0) / dim))
    angles = position * inv_freq  # (P, half)
    table = torch.zeros(n_positions, dim, dtype=torch.float64)
    table[:, :half] = torch.sin(angles)
    table[:, half : 2 * half] = torch.cos(angles)
    return table.float()


def fairseq_sinusoidal_table(n_positions: int, dim: int, padding_idx: int | None) -> Tensor:
    """fairseq's table (M2M100, NLLB): frequencies exp(-i log(10000) / (dim/2 - 1)), sin then
    cos, an odd last channel zero, the padding row zero. (P, dim)"""
    half = dim // 2
    inv_freq = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000) / (half - 1)))
    angles = torch.arange(n_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    table = torch.zeros(n_positions, dim)
    table[:, :half] = torch.sin(angles)
    table[:, half : 2 * half] = torch.cos(angles)
    if padding_idx is not None and padding_idx < n_positions:
        table[padding_idx] = 0.0
    return table


class SinusoidalPositions(nn.Module):
    """Fixed position embeddings looked up by explicit position ids (+ the table's offset)."""

    def __init__(self, n_positions: int, dim: int, *, table: Tensor | None = None, offset: int = 0):
        super().__init__()
        table = sinusoidal_table(n_positions, dim) if table is None else table
        self.register_buffer("table", table, persistent=False)
        self.table: Tensor
        self.offset = offset

    def forward(self, positions: Tensor) -> Tensor:
        """positions (B, T) int64 -> (B, T, dim)"""
        return F.embedding(positions + self.offset if self.offset else positions, self.table)


class LearnedPositions(nn.Embedding):
    """A learned table (BART's): position p is row p + offset."""

    def __init__(self, n_positions: int, dim: int, offset: int = 0) -> None:
        super().__init__(n_positions + offset, dim)
        self.offset = offset

    def forward(self, positions: Tensor) -> Tensor:
        """positions (B, T) int64 -> (B, T, dim)"""
        return super().forward(positions + self.offset if self.offset else positions)


def position_embeddings(cfg: ModelConfig) -> tuple[nn.Module, nn.Module]:
    """The source and target position modules of a config (one shared module if fixed)."""
    if cfg.positions == "learned":
        return (
            LearnedPositions(cfg.max_positions, cfg.d_model, cfg.position_offset),
            LearnedPositions(cfg.max_positions, cfg.d_model, cfg.position_offset),
        )
    rows = cfg.max_positions + cfg.position_offset
    table = None
    if cfg.positions == "sinusoidal_fairseq":
        table = fairseq_sinusoidal_table(rows, cfg.d_model, cfg.pad_id)
    shared = SinusoidalPositions(rows, cfg.d_model, table=table, offset=cfg.position_offset)
    return shared, shared


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention over H heads with separate Q/K/V projections.

    Self-attention passes the new keys/values through `project_kv` and concatenates them to the
    cache; cross-attention projects the encoder output once (`project_kv`) and reuses it.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def _heads(self, x: Tensor) -> Tensor:
        """(B, T, H*D) -> (B, H, T, D)"""
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)

    def project_kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (B, S, C) -> keys, values (B, H, S, D)"""
        return self._heads(self.k_proj(x)), self._heads(self.v_proj(x))

    def forward(self, x: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """x (B, T, C) attends to keys/values (B, H, S, D); mask (B, 1|T, S), True = visible."""
        q = self._heads(self.q_proj(x))  # (B, H, T, D)
        out = F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=mask[:, None],
            dropout_p=self.dropout if self.training else 0.0,
        )  # (B, H, T, D)
        b, _, t, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, ffn_dim: int, activation: str, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d_model)
        self.act = ACTIVATIONS[activation]
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.dropout(self.act(self.fc1(x))))


class _Sublayers(nn.Module):
    """Residual + LayerNorm around sublayers, post-LN (Marian) or pre-LN."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.pre = cfg.norm_placement == "pre"
        self.drop = nn.Dropout(cfg.dropout)

    def residual(self, x: Tensor, norm: nn.LayerNorm, fn: Callable[[Tensor], Tensor]) -> Tensor:
        if self.pre:
            return x + self.drop(fn(norm(x)))
        return norm(x + self.drop(fn(x)))


class EncoderLayer(_Sublayers):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.ffn = FeedForward(cfg.d_model, cfg.ffn_dim, cfg.activation, cfg.activation_dropout)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """x (B, S, C); mask (B, 1, S) bool."""

        def attend(h: Tensor) -> Tensor:
            k, v = self.self_attn.project_kv(h)
            return self.self_attn(h, k, v, mask)

        x = self.residual(x, self.self_attn_layer_norm, attend)
        return self.residual(x, self.final_layer_norm, self.ffn)


class DecoderLayer(_Sublayers):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.encoder_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout)
        self.encoder_attn_layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.ffn = FeedForward(cfg.d_model, cfg.ffn_dim, cfg.activation, cfg.activation_dropout)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)

    def forward(
        self,
        x: Tensor,
        past_k: Tensor,
        past_v: Tensor,
        self_mask: Tensor,
        cross_k: Tensor,
        cross_v: Tensor,
        cross_mask: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One decoder layer over T new positions.

        x (B, T, C); past_k/past_v (B, H, P, D); self_mask (B, T, P+T) bool;
        cross_k/cross_v (B, H, S, D); cross_mask (B, 1, S) bool.
        Returns the output (B, T, C) and the grown cache (B, H, P+T, D) twice.
        """
        present: list[Tensor] = []

        def self_attend(h: Tensor) -> Tensor:
            k_new, v_new = self.self_attn.project_kv(h)
            k = torch.cat([past_k, k_new], dim=2)
            v = torch.cat([past_v, v_new], dim=2)
            present.extend((k, v))
            return self.self_attn(h, k, v, self_mask)

        x = self.residual(x, self.self_attn_layer_norm, self_attend)
        x = self.residual(
            x,
            self.encoder_attn_layer_norm,
            lambda h: self.encoder_attn(h, cross_k, cross_v, cross_mask),
        )
        x = self.residual(x, self.final_layer_norm, self.ffn)
        return x, present[0], present[1]
