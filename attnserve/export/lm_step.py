"""The language model's step as exported: `DecoderOnly`'s layers over T new tokens per row.

`LMStepGraph` runs the model's embedding, norms, projections, rotary embeddings and MLPs like
`DecoderOnly.prefill` (fp32 parity is checked at export), for a chunk of T tokens per row after
a past of W cache columns; T = 1 is a decoding step. Attention is written for serving:

* The cache is an input and only the T new keys/values are outputs: scores over the past
  `(B, Hkv, G, T, W)` and over the new tokens `(B, Hkv, G, T, T)` share one softmax, and the
  output is `p_past @ V_past + p_new @ V_new`. The graph never concatenates the cache (a copy
  of all of it every step); the runtime appends the new columns to buffers with spare columns.
* Grouped-query attention without repeating K/V: the H query heads are viewed as `(Hkv, G)`
  (kv head j serves query heads jG..jG+G-1, as Hugging Face's `repeat_kv`), and the K/V of
  each kv head broadcast over its G queries in the MatMul.
* Positions come from the masks (real past columns plus real tokens before, in the chunk), so
  left padding, rows that joined later and reordered beams need nothing else.
* Only the last position's logits leave the graph: a prompt chunk's next-token scores are
  those of its last token (the chunk is left-padded), and a step has one position.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnserve.model.decoder_only import DecoderOnly, DecoderOnlyLayer, apply_rotary, rotary_cos_sin


def _bias(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """bool mask -> additive bias: 0 where visible, the lowest finite value elsewhere."""
    zero = torch.zeros((), dtype=dtype)
    lowest = torch.full((), torch.finfo(dtype).min, dtype=dtype)
    return torch.where(visible, zero, lowest)


class LMStepGraph(nn.Module):
    """T new tokens per row over a left-padded past given as a mask; logits of the last one."""

    def __init__(self, model: DecoderOnly) -> None:
        super().__init__()
        self.model = model

    def _attend(
        self,
        layer: DecoderOnlyLayer,
        h: Tensor,
        cos: Tensor,
        sin: Tensor,
        past_k: Tensor,
        past_v: Tensor,
        past_bias: Tensor,
        new_bias: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """h (B, T, C); past_k/v (B, Hkv, W, D); biases (B, 1, 1, T, W) and (B, 1, 1, T, T).

        Returns the attention output (B, T, C) and the new keys/values (B, Hkv, T, D)."""
        attn = layer.self_attn
        b, t, _ = h.shape
        kv, d = attn.num_kv_heads, attn.head_dim
        groups = attn.num_heads // kv
        q = attn.q_proj(h).view(b, t, kv, groups, d).permute(0, 2, 3, 1, 4)  # (B, Hkv, G, T, D)
        k = attn.k_proj(h).view(b, t, kv, d).transpose(1, 2)  # (B, Hkv, T, D)
        v = attn.v_proj(h).view(b, t, kv, d).transpose(1, 2)
        q = apply_rotary(q, cos[:, :, None], sin[:, :, None]) * (1.0 / math.sqrt(d))
        k = apply_rotary(k, cos, sin)
        past_scores = q @ past_k[:, :, None].transpose(-1, -2) + past_bias  # (B, Hkv, G, T, W)
        new_scores = q @ k[:, :, None].transpose(-1, -2) + new_bias  # (B, Hkv, G, T, T)
        width = past_scores.shape[-1]
        p = torch.softmax(torch.cat([past_scores, new_scores], dim=-1), dim=-1)
        out = p[..., :width] @ past_v[:, :, None] + p[..., width:] @ v[:, :, None]
        out = out.permute(0, 3, 1, 2, 4).reshape(b, t, kv * groups * d)  # (B, T, H * D)
        return attn.o_proj(out), k, v

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        past_mask: Tensor,
        past: list[Tensor],
    ) -> tuple[Tensor, ...]:
        """input_ids, attention_mask (B, T); past_mask (B, W); past 2L x (B, Hkv, W, D).

        Returns logits (B, V) float32 of the last position and 2L new keys/values (B, Hkv, T, D).
        """
        model, cfg = self.model, self.model.config
        new = attention_mask.bool()
        before = attention_mask.cumsum(dim=1) - attention_mask  # real tokens earlier in the chunk
        positions = past_mask.sum(dim=1, keepdim=True) + before  # (B, T)
        t = input_ids.shape[1]
        query = torch.arange(t, device=input_ids.device)
        causal = query[None, :] <= query[:, None]  # (T, T): key column <= query row
        # A padding token sees itself, so no query row is fully masked (its output is unused).
        visible_new = (causal[None] & new[:, None, :]) | (query[None, :] == query[:, None])[None]
        visible_past = past_mask.bool()[:, None, :].expand(-1, t, -1)  # (B, T, W)
        x = model.embed_tokens(input_ids)  # (B, T, C)
        past_bias = _bias(visible_past, x.dtype)[:, None, None]  # (B, 1, 1, T, W)
        new_bias = _bias(visible_new, x.dtype)[:, None, None]  # (B, 1, 1, T, T)
        cos, sin = rotary_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        grown: list[Tensor] = []
        for i, module in enumerate(model.layers):
            layer: DecoderOnlyLayer = module  # type: ignore[assignment]
            h, k, v = self._attend(
                layer,
                layer.input_layernorm(x),
                cos,
                sin,
                past[2 * i],
                past[2 * i + 1],
                past_bias,
                new_bias,
            )
            grown.extend((k, v))
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        # (B, 1, C) @ W^T: a MatMul with a constant (C, V) weight, which the int8 and int4
        # quantizers see (a 2-D input exports as Gemm, which they leave in float)
        logits = model.lm_head(model.norm(x[:, -1:]))[:, 0].float()  # (B, V)
        return (logits, *grown)
