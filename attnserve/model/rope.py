"""Rotary embeddings' frequencies: plain, or scaled as `DecoderConfig.rope_scaling` says.

Each function computes what transformers' `ROPE_INIT_FUNCTIONS` computes for the same
parameters, with the same float32 torch operations, so the angles (and everything after them)
equal Hugging Face's. Both the torch model and the exported graphs (export/lm_graph.py) read
their frequencies here. Frequencies cover the rotated channels of a head (`rope_dim`: all of
them, or Phi-4-mini's partial rotation).

Two scalings choose their frequencies by a sequence's length (`length_dependent`): `dynamic`
(NTK: the base grows with the length past `original_max_position_embeddings`) and `longrope`
(Phi-3: `long_factor` once the length exceeds `original_max_position_embeddings`, else
`short_factor`). transformers takes that length from a forward pass, the largest position of
the whole batch plus one, so there a row's output depends on its batch. Here each row of a pass
has its own length (`rope_lengths`, model/decoder_only.py): the length the row has after the
pass, or its whole prompt's while its prompt is prefilled (the engine prefills a prompt but its
last token, which the first decoding step feeds; transformers' generate() prefills it in one
pass). So a row gets the frequencies transformers gives it when it runs alone through
generate(), whatever the batch and however its prompt is chunked: prompt tokens those of the
prompt's length, each later token those of its own position + 1. Keys are cached after
rotation and keep it when the length moves on, as transformers' cache keeps them (its dynamic
NTK keys, and Llama's longrope ones). One difference remains: when a Phi-3 sequence first grows
past `original_max_position_embeddings` during generation, transformers' Phi3ForCausalLM drops
its cache and recomputes the whole sequence with the long factors (prepare_inputs_for_generation);
attnserve keeps the cached keys (the short factors' rotation), so from that token on its scores
differ from transformers' (a prompt already longer than that uses the long factors throughout,
and one that never grows past it the short ones, exactly as transformers).

A model whose sliding-window layers have a rotary base of their own (`local_rope_theta`, Gemma
3) has two sets: `rope_frequencies(config, local=True)` are theirs, plain frequencies of that base
over the same rotated channels; `rope_scaling` (and so any length dependence) applies only to the
other layers.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from attnserve.model.decoder_config import DecoderConfig

# The scalings whose frequencies depend on a row's length.
LENGTH_DEPENDENT = ("dynamic", "longrope")


def plain_frequencies(head_dim: int, theta: float) -> Tensor:
    """(D/2,) float32: theta ** (-2i / D)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


def _linear(inv_freq: Tensor, params: dict[str, Any]) -> Tensor:
    """Positions divided by `factor` (position interpolation)."""
    return inv_freq / float(params["factor"])


def _llama3(inv_freq: Tensor, params: dict[str, Any]) -> Tensor:
    """Llama 3.1's: long wavelengths divided by `factor`, short ones kept, the band between
    interpolated."""
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_attention_factor(params: dict[str, Any]) -> float:
    factor = float(params["factor"])
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def _yarn(head_dim: int, theta: float, params: dict[str, Any]) -> Tensor:
    """YaRN's: interpolated below a band of dimensions, extrapolated above it, a ramp between."""
    factor = float(params["factor"])
    original = params["original_max_position_embeddings"]
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp(
        (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1
    )
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share of the original frequency
    return interpolation * (1 - keep) + extrapolation * keep


def longrope_attention_factor(config: DecoderConfig) -> float:
    """LongRoPE's cos/sin factor: `attention_factor`, else sqrt(1 + ln(factor) / ln(original))
    with factor max_positions / original_max_position_embeddings unless given (Phi-3)."""
    params = config.rope_scaling or {}
    original = int(params["original_max_position_embeddings"])
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = params.get("factor")
    factor = config.max_positions / original if factor is None else float(factor)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def longrope_frequencies(config: DecoderConfig) -> tuple[Tensor, Tensor]:
    """LongRoPE's (D/2,) float32 frequencies for a sequence up to `original_max_position_embeddings`
    long (`short_factor`) and for a longer one (`long_factor`): the plain ones divided by them."""
    params = config.rope_scaling or {}
    d = config.rope_dim
    exponents = torch.arange(0, d, 2, dtype=torch.int64).float() / d
    short, long = (
        1.0 / (torch.tensor(params[key], dtype=torch.float32) * config.rope_theta**exponents)
        for key in ("short_factor", "long_factor")
    )
    return short, long


def _dynamic_base(theta: float, factor: float, length: Any, reference: int, d: int) -> Any:
    """Dynamic NTK's base for a sequence of `length` (a float, or a float32 tensor of lengths)."""
    return theta * ((factor * length / reference) - (factor - 1)) ** (d / (d - 2))


def dynamic_frequencies(config: DecoderConfig, lengths: Tensor) -> Tensor:
    """Dynamic NTK's (B, D/2) float32 frequencies for rows of `lengths` (B,): the base grows with
    a length past `original_max_position_embeddings`; up to it, the plain frequencies of
    transformers' initial table (its base computed in Python floats, as transformers does)."""
    params = config.rope_scaling or {}
    d, theta = config.rope_dim, config.rope_theta
    factor, reference = float(params["factor"]), int(params["original_max_position_embeddings"])
    exponents = torch.arange(0, d, 2, dtype=torch.int64).float() / d
    initial = 1.0 / (_dynamic_base(theta, factor, reference, reference, d) ** exponents)
    lengths = torch.maximum(lengths.to(torch.int64), torch.tensor(reference))
    base = _dynamic_base(theta, factor, lengths, reference, d)  # (B,) float32
    grown = 1.0 / (base[:, None] ** exponents)
    return torch.where((lengths > reference)[:, None], grown, initial.to(grown.device))


def length_dependent(config: DecoderConfig) -> bool:
    """Whether the frequencies depend on a row's length (dynamic, longrope)."""
    scaling = config.rope_scaling
    return scaling is not None and scaling["rope_type"] in LENGTH_DEPENDENT


def row_frequencies(config: DecoderConfig, lengths: Tensor) -> Tensor:
    """(B, D/2) float32 frequencies of rows of `lengths` (B,) int64 for a length-dependent
    scaling (`length_dependent`)."""
    params = config.rope_scaling or {}
    if params.get("rope_type") == "longrope":
        short, long = longrope_frequencies(config)
        original = int(params["original_max_position_embeddings"])
        longer = (lengths > original)[:, None].to(short.device)
        return torch.where(longer, long, short)
    if params.get("rope_type") == "dynamic":
        return dynamic_frequencies(config, lengths)
    raise ValueError(f"rope_type {params.get('rope_type')!r} does not depend on the length")


def rope_frequencies(config: DecoderConfig, local: bool = False) -> tuple[Tensor, float]:
    """(D/2,) float32 inverse frequencies and the factor cos and sin are multiplied by (YaRN's
    and LongRoPE's attention factor; 1 otherwise). For a length-dependent scaling, the
    frequencies of a sequence no longer than `original_max_position_embeddings`
    (`row_frequencies` gives each row's). With `local`, those of the layers `config.local_rope`
    names: plain, of `local_rope_theta`, over the same rotated channels (`rope_dim`)."""
    d, theta, params = config.rope_dim, config.rope_theta, config.rope_scaling
    if local:
        if config.local_rope_theta is None:
            raise ValueError("the config has no local_rope_theta")
        return plain_frequencies(d, config.local_rope_theta), 1.0
    if params is None:
        return plain_frequencies(d, theta), 1.0
    rope_type = params["rope_type"]
    if rope_type == "linear":
        return _linear(plain_frequencies(d, theta), params), 1.0
    if rope_type == "llama3":
        return _llama3(plain_frequencies(d, theta), params), 1.0
    if rope_type == "yarn":
        return _yarn(d, theta, params), _yarn_attention_factor(params)
    if rope_type == "longrope":
        return longrope_frequencies(config)[0], longrope_attention_factor(config)
    if rope_type == "dynamic":
        reference = params["original_max_position_embeddings"]
        return dynamic_frequencies(config, torch.tensor([reference]))[0], 1.0
    raise ValueError(f"rope_type {rope_type!r} is not supported")
