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
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # T5 v1.1's gelu_new
    "swish": F.silu,
}


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The config's normalization: LayerNorm, or RMSNorm without bias (T5's)."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.layer_norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)


def relative_position_bucket(
    relative: Tensor, *, bidirectional: bool, buckets: int, max_distance: int
) -> Tensor:
    """T5's buckets of key position - query position: exact for small distances, logarithmic
    up to `max_distance`; a bidirectional stack gives positive distances their own half."""
    out = torch.zeros_like(relative)
    if bidirectional:
        buckets //= 2
        out = out + (relative > 0).long() * buckets
        distance = relative.abs()
    else:
        distance = -torch.clamp(relative, max=0)
    exact = buckets // 2
    # clamp(min=1): log(0) is never used (torch.where picks the exact bucket) but must be finite
    large = (
        exact
        + (
            torch.log(distance.clamp(min=1).float() / exact)
            / math.log(max_distance / exact)
            * (buckets - exact)
        ).long()
    )
    large = torch.clamp(large, max=buckets - 1)
    return out + torch.where(distance < exact, distance, large)


class RelativePositionBias(nn.Module):
    """T5's learned bias per head and bucket: positions -> (B, H, T, S) added to the scores."""

    def __init__(self, cfg: ModelConfig, *, bidirectional: bool) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.buckets = cfg.relative_buckets
        self.max_distance = cfg.relative_max_distance
        self.embedding = nn.Embedding(cfg.relative_buckets, cfg.n_heads)

    def forward(self, query_positions: Tensor, key_positions: Tensor) -> Tensor:
        """query_positions (B, T), key_positions (B, S) int64 -> (B, H, T, S)"""
        relative = key_positions[:, None, :] - query_positions[:, :, None]  # (B, T, S)
        bucket = relative_position_bucket(
            relative,
            bidirectional=self.bidirectional,
            buckets=self.buckets,
            max_distance=self.max_distance,
        )
        return self.embedding(bucket).permute(0, 3, 1, 2)


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


def position_embeddings(cfg: ModelConfig) -> tuple[nn.Module | None, nn.Module | None]:
    """The source and target position modules of a config (one shared module if fixed)."""
    if cfg.positions == "relative":  # T5: no embeddings; a bias inside self-attention
        return None, None
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

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float = 0.0,
        *,
        head_dim: int | None = None,
        bias: bool = True,
        scaled: bool = True,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = head_dim if head_dim is not None else d_model // n_heads
        self.dropout = dropout
        # T5 folds 1/sqrt(d) into its weights: its scores are not scaled
        self.scale = 1.0 / math.sqrt(self.head_dim) if scaled else 1.0
        inner = n_heads * self.head_dim
        self.q_proj = nn.Linear(d_model, inner, bias=bias)
        self.k_proj = nn.Linear(d_model, inner, bias=bias)
        self.v_proj = nn.Linear(d_model, inner, bias=bias)
        self.out_proj = nn.Linear(inner, d_model, bias=bias)

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> MultiHeadAttention:
        return cls(
            cfg.d_model,
            cfg.n_heads,
            cfg.attention_dropout,
            head_dim=cfg.head_dim,
            bias=cfg.linear_bias,
            scaled=cfg.scale_attention,
        )

    def _heads(self, x: Tensor) -> Tensor:
        """(B, T, H*D) -> (B, H, T, D)"""
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)

    def project_kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (B, S, C) -> keys, values (B, H, S, D)"""
        return self._heads(self.k_proj(x)), self._heads(self.v_proj(x))

    def forward(
        self, x: Tensor, keys: Tensor, values: Tensor, mask: Tensor, bias: Tensor | None = None
    ) -> Tensor:
        """x (B, T, C) attends to keys/values (B, H, S, D); mask (B, 1|T, S), True = visible;
        bias (B|1, H, T, S): added to the scores (T5's relative positions)."""
        q = self._heads(self.q_proj(x))  # (B, H, T, D)
        attn_mask: Tensor = mask[:, None]
        if bias is not None:  # a float mask: the bias where visible, the lowest value elsewhere
            lowest = torch.finfo(bias.dtype).min
            attn_mask = torch.where(attn_mask, bias, torch.full_like(bias, lowest))
        out = F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.scale,
        )  # (B, H, T, D)
        b, _, t, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """fc2(act(fc1 x)), or gated (T5 v1.1): fc2(act(fc1 x) * gate x)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        bias = cfg.linear_bias
        self.fc1 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=bias)
        self.gate = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=bias) if cfg.ffn_gated else None
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=bias)
        self.act = ACTIVATIONS[cfg.activation]
        self.dropout = nn.Dropout(cfg.activation_dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.fc1(x))
        if self.gate is not None:
            h = h * self.gate(x)
        return self.fc2(self.dropout(h))


class _Sublayers(nn.Module):
    """Residual + LayerNorm around sublayers, post-LN (Marian) or pre-LN."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.pre = cfg.norm_placement == "pre"
        self.drop = nn.Dropout(cfg.dropout)

    def residual(self, x: Tensor, norm: nn.Module, fn: Callable[[Tensor], Tensor]) -> Tensor:
        if self.pre:
            return x + self.drop(fn(norm(x)))
        return norm(x + self.drop(fn(x)))


class EncoderLayer(_Sublayers):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.self_attn = MultiHeadAttention.from_config(cfg)
        self.self_attn_layer_norm = make_norm(cfg)
        self.ffn = FeedForward(cfg)
        self.final_layer_norm = make_norm(cfg)

    def forward(self, x: Tensor, mask: Tensor, bias: Tensor | None = None) -> Tensor:
        """x (B, S, C); mask (B, 1, S) bool; bias (B|1, H, S, S) (T5's positions)."""

        def attend(h: Tensor) -> Tensor:
            k, v = self.self_attn.project_kv(h)
            return self.self_attn(h, k, v, mask, bias)

        x = self.residual(x, self.self_attn_layer_norm, attend)
        return self.residual(x, self.final_layer_norm, self.ffn)


class DecoderLayer(_Sublayers):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.self_attn = MultiHeadAttention.from_config(cfg)
        self.self_attn_layer_norm = make_norm(cfg)
        self.encoder_attn = MultiHeadAttention.from_config(cfg)
        self.encoder_attn_layer_norm = make_norm(cfg)
        self.ffn = FeedForward(cfg)
        self.final_layer_norm = make_norm(cfg)

    def forward(
        self,
        x: Tensor,
        past_k: Tensor,
        past_v: Tensor,
        self_mask: Tensor,
        cross_k: Tensor,
        cross_v: Tensor,
        cross_mask: Tensor,
        bias: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One decoder layer over T new positions.

        x (B, T, C); past_k/past_v (B, H, P, D); self_mask (B, T, P+T) bool;
        cross_k/cross_v (B, H, S, D); cross_mask (B, 1, S) bool; bias (B, H, T, P+T) (T5).
        Returns the output (B, T, C) and the grown cache (B, H, P+T, D) twice.
        """
        present: list[Tensor] = []

        def self_attend(h: Tensor) -> Tensor:
            k_new, v_new = self.self_attn.project_kv(h)
            k = torch.cat([past_k, k_new], dim=2)
            v = torch.cat([past_v, v_new], dim=2)
            present.extend((k, v))
            return self.self_attn(h, k, v, self_mask, bias)

        x = self.residual(x, self.self_attn_layer_norm, self_attend)
        x = self.residual(
            x,
            self.encoder_attn_layer_norm,
            lambda h: self.encoder_attn(h, cross_k, cross_v, cross_mask),
        )
        x = self.residual(x, self.final_layer_norm, self.ffn)
        return x, present[0], present[1]
