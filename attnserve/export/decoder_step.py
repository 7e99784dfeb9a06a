"""The decoder step as exported: the model's own layers, with two attentions shaped for serving.

`DecoderStepGraph` runs `EncoderDecoder`'s embedding, layers (their projections, norms, residual
rule and feed-forward) and output head for one new token per row, like `decode_step()`, with the
same numbers (fp32 parity is checked at export). Only the two attentions are written
differently, because the graph's inputs and outputs are what a serving loop copies every step:

* Self-attention reads the cache and returns only the new column: scores over the past
  `(B, H, 1, T)` and of the new key `(B, H, 1, 1)` share one softmax, and the output is
  `p_past @ V_past + p_new * v_new`. The graph never concatenates the cache (that copied all of
  it every step); the runtime appends the new column to a buffer with spare columns
  (engine/onnx/backend.py), so greedy rows copy nothing and beam reordering copies once.
* Cross-attention takes the K/V of every encoded source once, not once per row: the rows of a
  source (its beams) are gathered into `G` query slots, `(N, H, G, D) @ (N, H, D, S)`, and
  scattered back. Beam search reads a source's K/V once per step instead of `beam_size` times,
  and expanding a request to its beams copies nothing. `row_slots` (B,) and `slot_rows`
  (N * G,) come from the runtime (`engine.onnx.rowops.slot_index`).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from attnserve.model.layers import DecoderLayer, MultiHeadAttention
from attnserve.model.transformer import EncoderDecoder


def _bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """(R, L) int64/bool mask -> (R, 1, 1, L) additive bias: 0 where visible, the lowest value
    elsewhere (finite, so a row that sees nothing stays finite)."""
    zero = torch.zeros((), dtype=dtype)
    lowest = torch.full((), torch.finfo(dtype).min, dtype=dtype)
    return torch.where(mask.bool(), zero, lowest)[:, None, None, :]


def self_attention_step(
    attn: MultiHeadAttention,
    h: Tensor,
    past_k: Tensor,
    past_v: Tensor,
    past_bias: Tensor,
    new_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """h (B, 1, C); past_k/v (B, H, T, D); past_bias (B, 1|H, 1, T); new_bias (B, H, 1, 1):
    T5's position bias of the new column (its past columns' is in past_bias).

    Returns the attention output (B, 1, C) and the new key and value (B, H, 1, D).
    """
    q = attn._heads(attn.q_proj(h)) * attn.scale  # (B, H, 1, D)
    k, v = attn.project_kv(h)  # (B, H, 1, D) each
    own = (q * k).sum(dim=-1, keepdim=True)  # (B, H, 1, 1)
    if new_bias is not None:
        own = own + new_bias
    scores = torch.cat([q @ past_k.transpose(-1, -2) + past_bias, own], dim=-1)  # (B, H, 1, T+1)
    p = torch.softmax(scores, dim=-1)
    out = p[..., :-1] @ past_v + p[..., -1:] * v  # (B, H, 1, D)
    b = h.shape[0]
    return attn.out_proj(out.transpose(1, 2).reshape(b, 1, -1)), k, v


def grouped_cross_attention(
    attn: MultiHeadAttention,
    h: Tensor,
    keys: Tensor,
    values: Tensor,
    src_bias: Tensor,
    row_slots: Tensor,
    slot_rows: Tensor,
) -> Tensor:
    """h (B, 1, C) attends to its source's keys/values (N, H, S, D); src_bias (N, 1, 1, S).

    slot_rows (N * G,): the row whose query fills each slot (slots s*G .. s*G+G-1 belong to
    source s; unused slots repeat any row); row_slots (B,): the slot of every row.
    """
    b, n = h.shape[0], keys.shape[0]
    heads, dim = attn.n_heads, attn.head_dim
    q = attn.q_proj(h).reshape(b, heads * dim) * attn.scale  # (B, H * D)
    grid = q[slot_rows].reshape(n, -1, heads, dim).transpose(1, 2)  # (N, H, G, D)
    p = torch.softmax(grid @ keys.transpose(-1, -2) + src_bias, dim=-1)  # (N, H, G, S)
    out = (p @ values).transpose(1, 2).reshape(-1, heads * dim)  # (N * G, C)
    return attn.out_proj(out[row_slots][:, None, :])  # (B, 1, C)


class DecoderStepGraph(nn.Module):
    """One decoding step over a left-padded cache given as a mask, log_softmax inside."""

    def __init__(self, model: EncoderDecoder) -> None:
        super().__init__()
        self.model = model
        # An all-zero final logits bias (Marian's, unless trained) is left out of the graph:
        # adding it is a pass over the (rows, vocabulary) logits every step and changes nothing.
        bias = model.logits_bias
        self.with_bias = bias is not None and bool(bias.detach().any())

    def forward(
        self,
        input_ids: Tensor,
        encoder_attention_mask: Tensor,
        past_mask: Tensor,
        row_slots: Tensor,
        slot_rows: Tensor,
        past: list[Tensor],
        cross: list[Tensor],
    ) -> tuple[Tensor, ...]:
        """input_ids (B,); encoder_attention_mask (N, S); past_mask (B, T); row_slots (B,);
        slot_rows (N * G,); past 2L x (B, H, T, D); cross 2L x (N, H, S, D).

        Returns log_probs (B, V) float32 and 2L new keys/values (B, H, 1, D).
        """
        model = self.model
        new = torch.ones_like(input_ids)[:, None]  # (B, 1)
        positions = torch.cat([past_mask, new], dim=1).sum(dim=1, keepdim=True) - 1  # (B, 1)
        x = model._embed(input_ids[:, None], positions, target=True)  # (B, 1, C)
        past_bias = _bias(past_mask, x.dtype)  # (B, 1, 1, T)
        src_bias = _bias(encoder_attention_mask, x.dtype)  # (N, 1, 1, S)
        new_bias = None
        if model.tgt_relative is not None:  # T5: the position bias of the past and new columns
            past_positions = past_mask.cumsum(dim=1) - 1  # (B, T)
            keys_at = torch.cat([past_positions, positions], dim=1)  # (B, T + 1)
            relative = model.tgt_relative(positions, keys_at)  # (B, H, 1, T + 1)
            past_bias = past_bias + relative[..., :-1]
            new_bias = relative[..., -1:]
        grown: list[Tensor] = []
        for i, module in enumerate(model.decoder_layers):
            layer = cast(DecoderLayer, module)
            past_k, past_v = past[2 * i], past[2 * i + 1]

            def self_attend(
                h: Tensor, layer: Any = layer, pk: Tensor = past_k, pv: Tensor = past_v
            ) -> Tensor:
                out, k, v = self_attention_step(layer.self_attn, h, pk, pv, past_bias, new_bias)
                grown.extend((k, v))
                return out

            def cross_attend(h: Tensor, layer: Any = layer, i: int = i) -> Tensor:
                keys, values = cross[2 * i], cross[2 * i + 1]
                return grouped_cross_attention(
                    layer.encoder_attn, h, keys, values, src_bias, row_slots, slot_rows
                )

            x = layer.residual(x, layer.self_attn_layer_norm, self_attend)
            x = layer.residual(x, layer.encoder_attn_layer_norm, cross_attend)
            x = layer.residual(x, layer.final_layer_norm, layer.ffn)
        log_probs = torch.log_softmax(
            model._logits(x, self.with_bias).squeeze(1).float(), dim=-1
        )  # (B, V)
        return (log_probs, *grown)
