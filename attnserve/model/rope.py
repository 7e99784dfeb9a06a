"""Rotary embeddings' frequencies: plain, or scaled as `DecoderConfig.rope_scaling` says.

A model whose sliding-window layers have a rotary base of their own (`local_rope_theta`, Gemma
3) has two sets: `rope_frequencies(config, local=True)` are theirs, plain frequencies of that base.

Each function computes what transformers' `ROPE_INIT_FUNCTIONS` computes for the same
parameters, with the same float32 torch operations, so the angles (and everything after them)
equal Hugging Face's. Both the torch model and the exported graphs (export/lm_graph.py) read
their frequencies here.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from attnserve.model.decoder_config import DecoderConfig


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


def rope_frequencies(config: DecoderConfig, local: bool = False) -> tuple[Tensor, float]:
    """(D/2,) float32 inverse frequencies and the factor cos and sin are multiplied by (YaRN's
    attention factor; 1 otherwise); with `local`, those of the layers `config.local_rope` names
    (plain, of `local_rope_theta`)."""
    d, theta, params = config.head_dim, config.rope_theta, config.rope_scaling
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
    raise ValueError(f"rope_type {rope_type!r} is not supported")
