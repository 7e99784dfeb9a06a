"""DecoderOnly: a Llama-architecture language model with an explicit, left-padded KV cache.

`prefill()` appends a chunk of tokens per row to a `KVCache` (a prompt may arrive in several
chunks) and `decode_step()` appends one; `forward()` is full recomputation, the uncached
reference. Every row's positions come from its own mask (the number of real tokens before a
token), never from the column index, so left-padded batches, rows joining a running batch
(`KVCache.concat`) and beam reordering (`KVCache.select`) need no recomputation.

Parameter names follow Hugging Face's `LlamaForCausalLM` (and Qwen2's, Qwen3's, Mistral's)
without its `model.` prefix, so the import is a renaming (convert/hf_decoder.py). Rotary
embeddings use the rotate-half convention of Hugging Face's Llama, whose q/k projection rows are
stored in that order. The families' differences are `DecoderConfig` switches: projection biases,
per-head q/k norms, scaled rotary frequencies (model/rope.py; dynamic and longrope ones chosen
per row by its length), rotation of only the first `rotary_dim` channels of a head, and a
sliding window, which masks keys by their position (never by column, so left padding changes
nothing). Checkpoints that fuse q/k/v or gate/up into one projection (Phi-3) are split at import.
Gemma 2 and 3 add theirs: norms of (1 + w) and on the attention's and the MLP's outputs, a
GELU-tanh gated MLP, embeddings scaled by sqrt(hidden), their own attention scale, tanh soft caps
of the attention scores and the logits, and (Gemma 3) a rotary base of its own for the
sliding-window layers (plain frequencies, never per row).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnserve.model.cache import KVCache
from attnserve.model.decoder_config import DecoderConfig
from attnserve.model.rope import length_dependent, rope_frequencies, row_frequencies


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 (as Hugging Face's Llama does); with
    `unit_offset` (Gemma) x / rms(x) * (1 + weight), all in float32, then x's dtype."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps

    def scale(self) -> Tensor:
        """What the normalized x is multiplied by (float32 with `unit_offset`)."""
        return 1.0 + self.weight.float() if self.unit_offset else self.weight

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * self.scale()).to(x.dtype)
        return self.weight * h.to(x.dtype)


def soft_cap(x: Tensor, cap: float | None) -> Tensor:
    """cap * tanh(x / cap) (Gemma's soft capping); x itself when cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


def rotary_cos_sin(
    positions: Tensor, inv_freq: Tensor, factor: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """positions (B, T) int64, inv_freq (R/2,) or per row (B, R/2) float32 -> cos, sin
    (B, 1, T, R), each frequency repeated in both halves, times `factor` (YaRN's and LongRoPE's
    attention factor; 1 otherwise). R: the rotated channels of a head."""
    inv_freq = inv_freq.to(positions.device)
    if inv_freq.dim() == 2:
        inv_freq = inv_freq[:, None, :]  # (B, 1, R/2)
    angles = positions[..., None].float() * inv_freq  # (B, T, R/2)
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # (B, 1, T, R)
    cos, sin = angles.cos(), angles.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (i, i + R/2) of the first R channels of x (B, H, T, D) by the angles
    of cos/sin (B, 1, T, R); the other D - R channels pass through (partial rotation)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    half = r // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class GroupedQueryAttention(nn.Module):
    """Causal self-attention where each key/value head serves `kv_groups` query heads."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_out_bias
        )
        # Qwen3, Gemma 3: each head's q and k RMS-normed (weights of head_dim) before the rotation
        offset = cfg.norm_unit_offset
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset) if cfg.qk_norm else None
        # None: scaled_dot_product_attention's default, 1/sqrt(head_dim)
        self.scale = None if cfg.query_pre_attn_scalar is None else cfg.attention_scale
        self.softcap = cfg.attn_logit_softcapping

    def _heads(self, x: Tensor, n_heads: int, norm: RMSNorm | None = None) -> Tensor:
        """(B, T, n*D) -> (B, n, T, D), each head normed by `norm` when given."""
        b, t, _ = x.shape
        heads = x.view(b, t, n_heads, self.head_dim)
        return (heads if norm is None else norm(heads)).transpose(1, 2)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, past_k: Tensor, past_v: Tensor, mask: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, C); cos/sin (B, 1, T, D); past_k/past_v (B, Hkv, P, D); mask (B, T, P+T) bool.

        Returns the output (B, T, C) and the keys and values grown to (B, Hkv, P+T, D); keys are
        cached after rotation.
        """
        q = self._heads(self.q_proj(x), self.num_heads, self.q_norm)  # (B, H, T, D)
        q = apply_rotary(q, cos, sin)
        k_new = apply_rotary(self._heads(self.k_proj(x), self.num_kv_heads, self.k_norm), cos, sin)
        v_new = self._heads(self.v_proj(x), self.num_kv_heads)  # (B, Hkv, T, D)
        k = torch.cat([past_k, k_new], dim=2)  # (B, Hkv, P+T, D)
        v = torch.cat([past_v, v_new], dim=2)
        groups = self.num_heads // self.num_kv_heads
        k_all = k.repeat_interleave(groups, dim=1)  # (B, H, P+T, D): kv head j serves jG..jG+G-1
        v_all = v.repeat_interleave(groups, dim=1)
        if self.softcap is None:
            # the scale only where a config sets one: the other families' call is unchanged
            given: dict[str, Any] = {} if self.scale is None else {"scale": self.scale}
            out = F.scaled_dot_product_attention(
                q, k_all, v_all, attn_mask=mask[:, None], **given
            )  # (B, H, T, D)
        else:  # the cap applies to the scaled scores, before the mask (Gemma 2)
            scale = self.scale if self.scale is not None else self.head_dim**-0.5
            scores = soft_cap(q @ k_all.transpose(2, 3) * scale, self.softcap)  # (B, H, T, P+T)
            scores = scores.masked_fill(~mask[:, None], float("-inf"))
            out = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v_all
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), k, v


class SwiGLU(nn.Module):
    """down(act(gate(x)) * up(x)): silu (SwiGLU) or the tanh-approximated GELU (GeGLU, Gemma's
    gelu_pytorch_tanh)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate_proj(x)
        act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(act * self.up_proj(x))


class DecoderOnlyLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); with `sandwich_norms`
    (Gemma) each branch's output is normed too: x + norm(attn(norm(x))), then
    x + norm(mlp(norm(x))).

    Hugging Face's names, so the import is a renaming: Llama's MLP input norm is
    `post_attention_layernorm`; Gemma's is `pre_feedforward_layernorm`, its
    `post_attention_layernorm` norms the attention's output and `post_feedforward_layernorm` the
    MLP's. `mlp_norm` is the MLP's input norm either way.
    """

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        c, eps, offset = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset
        self.input_layernorm = RMSNorm(c, eps, offset)
        self.self_attn = GroupedQueryAttention(cfg)
        self.post_attention_layernorm = RMSNorm(c, eps, offset)
        self.mlp = SwiGLU(c, cfg.intermediate_size, cfg.activation)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(c, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(c, eps, offset)

    @property
    def mlp_norm(self) -> RMSNorm:
        """The norm of the MLP's input."""
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, past_k: Tensor, past_v: Tensor, mask: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Shapes as in `GroupedQueryAttention.forward`."""
        h, k, v = self.self_attn(self.input_layernorm(x), cos, sin, past_k, past_v, mask)
        if self.sandwich:
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(self.mlp(self.mlp_norm(x))), k, v
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), k, v


class DecoderOnly(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        cfg = self.config = config
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderOnlyLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02) matrices and embeddings (Llama's initializer range), norms that scale by
        one (weights of 1, or of 0 with `norm_unit_offset`), zero biases."""
        for name, p in self.named_parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)
            elif name.endswith(".bias") or self.config.norm_unit_offset:
                nn.init.zeros_(p)
            else:
                nn.init.ones_(p)

    def alias_names(self) -> set[str]:
        """State-dict names that repeat another tensor (not stored)."""
        return {"lm_head.weight"} if self.config.tie_embeddings else set()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def empty_cache(self, batch: int) -> KVCache:
        cfg = self.config
        weight = self.embed_tokens.weight
        return KVCache.empty(
            batch,
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype=weight.dtype,
            device=weight.device,
        )

    def prefill(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        cache: KVCache,
        *,
        logits: bool = True,
        rope_lengths: Tensor | None = None,
    ) -> tuple[Tensor | None, KVCache]:
        """Append a chunk of T tokens per row to `cache`.

        input_ids (B, T) int64; attention_mask (B, T), True (or 1) = a real token, False = padding
        (left padding of a batch's prompts; any pattern works). A token's position is the number
        of real tokens before it in its row, cached ones included. Returns logits (B, T, V) (those
        of padding positions are meaningless; None with `logits=False`, for a prompt prefix whose
        next-token scores nobody reads) and a new cache grown by T columns, padding masked.

        With a length-dependent rotary scaling (dynamic, longrope: model/rope.py), each row's
        frequencies are those of its length after this chunk, or of `rope_lengths` (B,) where
        that is longer (a prompt's whole length while it is prefilled).
        """
        mask = attention_mask.to(torch.bool)
        t = input_ids.shape[1]
        p = cache.length
        before = mask.long().cumsum(dim=1) - mask.long()  # real tokens earlier in the chunk
        positions = cache.positions()[:, None] + before  # (B, T)
        key_mask = torch.cat([cache.mask, mask], dim=1)  # (B, P+T)
        query = torch.arange(t, device=input_ids.device)[:, None] + p  # column of each new token
        column = torch.arange(p + t, device=input_ids.device)[None, :]
        causal = column <= query  # (T, P+T)
        # A padding token sees itself, so no query row is fully masked. Its output is unused, but
        # a plain softmax over a fully masked row (as exported graphs compute it) gives NaN, which
        # would reach its cached K/V and, through 0 * NaN, every row that attends past it.
        itself = (column == query)[None]
        visible = causal[None] & key_mask[:, None, :]  # (B, T, P+T)
        masks: dict[int | None, Tensor] = {None: visible | itself}
        cfg = self.config
        if cfg.sliding_window is not None:
            # a key is in the window when fewer than `sliding_window` positions separate it
            # from the query; positions count real tokens, so padding columns do not count
            key_positions = key_mask.long().cumsum(dim=1) - 1  # (B, P+T)
            distance = positions[:, :, None] - key_positions[:, None, :]  # (B, T, P+T)
            masks[cfg.sliding_window] = (visible & (distance < cfg.sliding_window)) | itself

        x = self.embed(input_ids)  # (B, T, C)
        inv_freq, factor = rope_frequencies(cfg)
        if length_dependent(cfg):  # each row's own frequencies (B, R/2)
            lengths = cache.positions() + mask.sum(dim=1)  # (B,): after this chunk
            if rope_lengths is not None:
                lengths = torch.maximum(lengths, rope_lengths.to(lengths.device))
            inv_freq = row_frequencies(cfg, lengths)
        rotations = {False: rotary_cos_sin(positions, inv_freq, factor, x.dtype)}
        if cfg.local_rope_theta is not None:  # the sliding-window layers' own base (Gemma 3)
            inv_freq, factor = rope_frequencies(cfg, local=True)
            rotations[True] = rotary_cos_sin(positions, inv_freq, factor, x.dtype)
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            attn_mask = masks[cfg.window(i)]
            cos, sin = rotations[cfg.local_rope(i)]
            x, k, v = layer(x, cos, sin, cache.keys[i], cache.values[i], attn_mask)
            keys.append(k)
            values.append(v)
        cache = KVCache(keys, values, key_mask)
        if not logits:
            return None, cache
        scores = soft_cap(self.lm_head(self.norm(x)), cfg.final_logit_softcapping)
        return scores, cache  # (B, T, V)

    def embed(self, input_ids: Tensor) -> Tensor:
        """input_ids (B, T) -> (B, T, C); times sqrt(hidden_size) in the embedding's dtype with
        `scale_embeddings` (Gemma)."""
        x = self.embed_tokens(input_ids)
        if not self.config.scale_embeddings:
            return x
        return x * torch.tensor(self.config.hidden_size**0.5).to(x.dtype)  # HF's rounding

    def decode_step(self, last_ids: Tensor, cache: KVCache) -> tuple[Tensor, KVCache]:
        """One token per row: last_ids (B,) -> logits (B, V) and the cache with one more column.

        Logits, not log-probs, as `EncoderDecoder.decode_step`: the caller normalizes.
        """
        ones = torch.ones(last_ids.shape[0], 1, dtype=torch.bool, device=last_ids.device)
        logits, cache = self.prefill(last_ids[:, None], ones, cache)
        assert logits is not None
        return logits[:, 0], cache

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Full recomputation: input_ids, attention_mask (B, T) -> logits (B, T, V)."""
        logits, _ = self.prefill(input_ids, attention_mask, self.empty_cache(input_ids.shape[0]))
        assert logits is not None
        return logits
