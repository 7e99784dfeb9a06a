"""EncoderDecoder: the Vaswani et al. Transformer, configurable to match Marian / OPUS-MT exactly.

`encode()` and `decode_step()` are the two halves that serving uses (and the two ONNX graphs);
`forward()` is teacher-forced decoding of whole target sequences for training.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import Tensor, nn

from attnserve.model.cache import EncoderState, KVCache
from attnserve.model.config import ModelConfig
from attnserve.model.layers import (
    DecoderLayer,
    EncoderLayer,
    RelativePositionBias,
    make_norm,
    position_embeddings,
)


class EncoderDecoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        cfg = self.config = config
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0
        self.src_embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.tgt_embed = (
            self.src_embed
            if cfg.shared_embeddings
            else nn.Embedding(cfg.target_vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        )
        self.src_positions, self.tgt_positions = position_embeddings(cfg)
        # T5: one bias table per stack, computed once and added in every layer's self-attention
        relative = cfg.positions == "relative"
        self.src_relative = RelativePositionBias(cfg, bidirectional=True) if relative else None
        self.tgt_relative = RelativePositionBias(cfg, bidirectional=False) if relative else None
        # BART's `layernorm_embedding`, one per stack.
        self.src_input_norm, self.tgt_input_norm = (
            (nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if cfg.layernorm_embedding else None)
            for _ in range(2)
        )
        self.dropout = nn.Dropout(cfg.dropout)
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        pre = cfg.norm_placement == "pre"
        self.encoder_norm = make_norm(cfg) if pre else None
        self.decoder_norm = make_norm(cfg) if pre else None
        # T5 with a tied output projection rescales the decoder output by d_model ** -0.5
        self.output_scale = cfg.d_model**-0.5 if cfg.scale_decoder_output else 1.0
        self.lm_head = nn.Linear(cfg.d_model, cfg.target_vocab_size, bias=False)
        if cfg.tied_output:
            self.lm_head.weight = self.tgt_embed.weight
        self.logits_bias = (
            nn.Parameter(torch.zeros(cfg.target_vocab_size)) if cfg.final_logits_bias else None
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform matrices, N(0, d^-1/2) embeddings, zero biases."""
        for name, p in self.named_parameters():
            if "embed" in name:
                nn.init.normal_(p, std=self.config.d_model**-0.5)
            elif p.dim() > 1:
                nn.init.xavier_uniform_(p)
            elif "norm" not in name:
                nn.init.zeros_(p)
        with torch.no_grad():
            self.src_embed.weight[self.config.pad_id].zero_()
            self.tgt_embed.weight[self.config.pad_id].zero_()

    # -- embeddings -------------------------------------------------------------------------

    def _embed(self, ids: Tensor, positions: Tensor, *, target: bool) -> Tensor:
        """ids, positions (B, T) of the source or the target stack -> (B, T, C)"""
        if target:
            embed, table, norm = self.tgt_embed, self.tgt_positions, self.tgt_input_norm
        else:
            embed, table, norm = self.src_embed, self.src_positions, self.src_input_norm
        x = embed(ids) * self.embed_scale
        if table is not None:
            x = x + table(positions)
        return self.dropout(norm(x) if norm is not None else x)

    def _logits(self, h: Tensor, with_bias: bool = True) -> Tensor:
        """Decoder output (B, T, C) -> logits (B, T, V); `with_bias=False` leaves out the final
        logits bias (for a caller that knows it is all zeros)."""
        if self.decoder_norm is not None:
            h = self.decoder_norm(h)
        if self.output_scale != 1.0:
            h = h * self.output_scale
        logits = self.lm_head(h)
        return logits + self.logits_bias if with_bias and self.logits_bias is not None else logits

    # -- encoder ----------------------------------------------------------------------------

    def encode_hidden(self, src_ids: Tensor, src_mask: Tensor) -> Tensor:
        """src_ids (B, S) int64, src_mask (B, S) bool -> encoder output (B, S, C)"""
        positions = torch.arange(src_ids.shape[1], device=src_ids.device).expand_as(src_ids)
        x = self._embed(src_ids, positions, target=False)
        attn_mask = src_mask[:, None, :]  # (B, 1, S)
        bias = None
        if self.src_relative is not None:
            bias = self.src_relative(positions[:1], positions[:1])  # (1, H, S, S)
        for layer in self.encoder_layers:
            x = layer(x, attn_mask, bias)
        return self.encoder_norm(x) if self.encoder_norm is not None else x

    def encode(self, src_ids: Tensor, src_mask: Tensor) -> EncoderState:
        """Run the encoder and project the cross-attention K/V of every decoder layer once."""
        memory = self.encode_hidden(src_ids, src_mask)
        keys, values = [], []
        for layer in self.decoder_layers:
            k, v = cast(DecoderLayer, layer).encoder_attn.project_kv(memory)  # (B, H, S, D)
            keys.append(k)
            values.append(v)
        return EncoderState(keys, values, src_mask)

    def empty_cache(self, batch: int) -> KVCache:
        cfg = self.config
        dtype = self.lm_head.weight.dtype
        device = self.lm_head.weight.device
        return KVCache.empty(
            batch, cfg.decoder_layers, cfg.n_heads, cfg.head_dim, dtype=dtype, device=device
        )

    # -- decoder ----------------------------------------------------------------------------

    def decode(
        self,
        tokens: Tensor,
        positions: Tensor,
        self_mask: Tensor,
        state: EncoderState,
        cache: KVCache,
    ) -> tuple[Tensor, KVCache]:
        """Decode T new tokens per row on top of `cache`.

        tokens, positions (B, T) int64; self_mask (B, T, P+T) bool over past + new columns.
        Returns logits (B, T, V) and the cache grown by T columns (its mask is left to the caller).
        """
        x = self._embed(tokens, positions, target=True)
        cross_mask = state.src_mask[:, None, :]  # (B, 1, S)
        bias = None
        if self.tgt_relative is not None:
            # a past column's position is the count of real columns before it in its row
            past = cache.mask.long().cumsum(dim=1) - 1  # (B, P)
            bias = self.tgt_relative(positions, torch.cat([past, positions], dim=1))
        keys, values = [], []
        for i, layer in enumerate(self.decoder_layers):
            x, k, v = layer(
                x,
                cache.keys[i],
                cache.values[i],
                self_mask,
                state.cross_keys[i],
                state.cross_values[i],
                cross_mask,
                bias,
            )
            keys.append(k)
            values.append(v)
        return self._logits(x), KVCache(keys, values, cache.mask)

    def decode_step(
        self, tokens: Tensor, state: EncoderState, cache: KVCache
    ) -> tuple[Tensor, KVCache]:
        """One step: last tokens (B,) -> logits (B, V) and the cache with one more column."""
        positions = cache.positions()[:, None]  # (B, 1)
        new = torch.ones(tokens.shape[0], 1, dtype=torch.bool, device=tokens.device)
        mask = torch.cat([cache.mask, new], dim=1)  # (B, P+1)
        logits, grown = self.decode(tokens[:, None], positions, mask[:, None, :], state, cache)
        return logits[:, 0], KVCache(grown.keys, grown.values, mask)

    def forward(
        self, src_ids: Tensor, src_mask: Tensor, tgt_ids: Tensor, tgt_mask: Tensor
    ) -> Tensor:
        """Teacher forcing: decoder inputs tgt_ids, tgt_mask (B, T) -> logits (B, T, V)."""
        state = self.encode(src_ids, src_mask)
        return self.decode_full(tgt_ids, tgt_mask, state)

    def decode_full(self, tgt_ids: Tensor, tgt_mask: Tensor, state: EncoderState) -> Tensor:
        """All target positions at once with a causal mask (no cache). Right padding only."""
        b, t = tgt_ids.shape
        positions = torch.arange(t, device=tgt_ids.device).expand(b, t)
        causal = torch.ones(t, t, dtype=torch.bool, device=tgt_ids.device).tril()
        self_mask = causal[None] & tgt_mask[:, None, :]  # (B, T, T)
        logits, _ = self.decode(tgt_ids, positions, self_mask, state, self.empty_cache(b))
        return logits

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
