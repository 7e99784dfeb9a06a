"""DecoderConfig: the architecture of a decoder-only language model, as data (no torch import)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from attnserve.model.config_file import ConfigFile

# The Hugging Face model_type a model was imported from: a label (metrics, logs). The network is
# the same for all of them; the switches below say what differs.
DecoderFamily = Literal["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"]
FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
# The MLP's gate activation: SwiGLU's silu, or GeGLU's tanh-approximated GELU (Gemma's
# gelu_pytorch_tanh).
Activation = Literal["silu", "gelu_tanh"]
ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_tanh")
# rope_scaling's rope_type -> the keys it needs (model/rope.py computes the frequencies as
# transformers does). "dynamic" and "longrope" choose their frequencies by a sequence's length:
# each row by its own (model/rope.py says how), so a row's output never depends on its batch.
ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class DecoderConfig(ConfigFile):
    """Architecture and special token ids of a Llama-architecture model.

    Pre-norm RMSNorm blocks, rotary positions (rotate-half convention), grouped-query attention
    and a SwiGLU MLP; the switches after `pad_id` (biases, per-head q/k norms, rotary scaling,
    partial rotation, a sliding window; Gemma's norms, activation, scales and soft caps) describe
    the families built on it. Defaults are the shape of SmolLM2-135M-Instruct (plain Llama: every
    switch off).
    """

    family: DecoderFamily = "llama"
    vocab_size: int = 49152
    hidden_size: int = 576
    num_layers: int = 30
    num_heads: int = 9
    # Key/value heads; each serves num_heads // num_kv_heads query heads.
    num_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    # The context length the model was trained for; the engine stops a row there.
    max_positions: int = 8192
    # Output projection = input embedding (transposed).
    tie_embeddings: bool = True
    bos_id: int | None = 1
    # Any of these ends a sequence (a chat model's end-of-turn token among them).
    eos_ids: tuple[int, ...] = field(default=(2,))
    # Fills the input ids of masked (padding) positions; never attended to.
    pad_id: int = 2
    # q/k/v projections have biases (Qwen2); the output projection too (Llama's and Qwen3's
    # attention_bias sets both).
    attention_bias: bool = False
    attention_out_bias: bool = False
    # A per-head RMSNorm (weights of head_dim) on q and on k before the rotation (Qwen3).
    qk_norm: bool = False
    # Rotary scaling as transformers' rope_parameters name it, rope_theta apart: {"rope_type":
    # "linear" | "llama3" | "yarn" | "dynamic" | "longrope", "factor": ..., ...}
    # (ROPE_SCALING_KEYS); None: plain.
    rope_scaling: dict[str, Any] | None = None
    # Only the first `rotary_dim` channels of each head rotate (rotate-half among them), the rest
    # pass through (Phi-4-mini: partial_rotary_factor 0.75); None: the whole head.
    rotary_dim: int | None = None
    # A query attends to the last `sliding_window` positions, itself included (Mistral, Phi-3),
    # in every layer but `full_attention_layers`; None: the whole context.
    sliding_window: int | None = None
    full_attention_layers: tuple[int, ...] = ()
    # Gemma 2 / Gemma 3 (all off for the others):
    # RMSNorm weights are stored as offsets from 1: a norm multiplies by 1 + w, in float32.
    norm_unit_offset: bool = False
    # A norm on the attention's output and one on the MLP's before their residual adds; the
    # MLP's input norm is then `pre_feedforward_layernorm` (Gemma's names).
    sandwich_norms: bool = False
    activation: Activation = "silu"
    # Embeddings multiplied by sqrt(hidden_size), rounded to the embedding's dtype.
    scale_embeddings: bool = False
    # The attention scale is query_pre_attn_scalar ** -0.5; None: head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # Tanh soft caps, cap * tanh(x / cap): of the attention scores (before the mask) and of the
    # output logits; None: none.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # The rotary base of the sliding-window layers, whose frequencies are then plain (Gemma 3's
    # rope_local_base_freq); None: they rotate as the other layers.
    local_rope_theta: float | None = None

    def __post_init__(self) -> None:
        eos = self.eos_ids
        if isinstance(eos, int | str) or not isinstance(eos, Sequence):
            raise ValueError(f"eos_ids must be a sequence of token ids, not {eos!r}")
        object.__setattr__(self, "eos_ids", tuple(int(i) for i in eos))
        object.__setattr__(
            self, "full_attention_layers", tuple(int(i) for i in self.full_attention_layers)
        )
        if self.family not in FAMILIES:
            raise ValueError(f"unknown decoder family {self.family!r}; choose from {FAMILIES}")
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_positions",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} is odd (rotary embeddings rotate pairs)")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps} must be positive")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta} must be positive")
        if not self.eos_ids:
            raise ValueError("eos_ids is empty: a sequence could never end")
        if self.rotary_dim is not None and not (
            0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0
        ):
            raise ValueError(
                f"rotary_dim={self.rotary_dim} must be even and within head_dim={self.head_dim}"
            )
        self._check_rope_scaling()
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be positive or None")
        for layer in self.full_attention_layers:
            if not 0 <= layer < self.num_layers:
                raise ValueError(f"full_attention_layers: no layer {layer}")
        self._check_gemma_switches()
        ids = [("pad_id", self.pad_id), *(("eos_ids", i) for i in self.eos_ids)]
        if self.bos_id is not None:
            ids.append(("bos_id", self.bos_id))
        for name, value in ids:
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} {value} is outside the vocabulary ({self.vocab_size})")

    def _check_rope_scaling(self) -> None:
        scaling = self.rope_scaling
        if scaling is None:
            return
        if not isinstance(scaling, dict):
            raise ValueError(f"rope_scaling must be an object or None, not {scaling!r}")
        rope_type = scaling.get("rope_type")
        if rope_type not in ROPE_SCALING_KEYS:
            raise ValueError(
                f"rope_scaling: rope_type {rope_type!r} is not supported; choose from "
                f"{', '.join(ROPE_SCALING_KEYS)}"
            )
        missing = [k for k in ROPE_SCALING_KEYS[rope_type] if scaling.get(k) is None]
        if missing:
            raise ValueError(f"rope_scaling ({rope_type}) lacks {', '.join(missing)}")
        # longrope's factor is optional: max_positions / original_max_position_embeddings
        if scaling.get("factor") is not None and not float(scaling["factor"]) > 0:
            raise ValueError(f"rope_scaling: factor {scaling['factor']} must be positive")
        if rope_type == "longrope":
            for key in ("short_factor", "long_factor"):
                factors = scaling[key]
                if not isinstance(factors, list) or len(factors) != self.rope_dim // 2:
                    raise ValueError(
                        f"rope_scaling: {key} must list {self.rope_dim // 2} factors (one per "
                        "rotated pair)"
                    )
                if not all(float(f) > 0 for f in factors):
                    raise ValueError(f"rope_scaling: {key} must be positive")
        if (
            rope_type in ("dynamic", "longrope")
            and int(scaling["original_max_position_embeddings"]) < 1
        ):
            raise ValueError("rope_scaling: original_max_position_embeddings must be positive")

    @property
    def rope_dim(self) -> int:
        """The channels of a head that rotate (`rotary_dim`, or the whole head)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def _check_gemma_switches(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r}: choose from {ACTIVATIONS}")
        for name in (
            "query_pre_attn_scalar",
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "local_rope_theta",
        ):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value} must be positive or None")

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: it attends to the whole context)."""
        return None if layer in self.full_attention_layers else self.sliding_window

    def local_rope(self, layer: int) -> bool:
        """Whether `layer` rotates with `local_rope_theta` (a sliding-window layer of a model
        that sets it) rather than rope_theta and rope_scaling."""
        return self.local_rope_theta is not None and self.window(layer) is not None

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax (and the soft cap): as transformers
        computes it, 1 / sqrt(head_dim) or query_pre_attn_scalar ** -0.5."""
        if self.query_pre_attn_scalar is None:
            return 1.0 / math.sqrt(self.head_dim)
        return float(self.query_pre_attn_scalar) ** -0.5

    @property
    def kv_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["eos_ids"] = list(self.eos_ids)
        data["full_attention_layers"] = list(self.full_attention_layers)
        return data


PRESETS: dict[str, DecoderConfig] = {
    # Builds in milliseconds; for tests. Two query heads per key/value head.
    "tiny": DecoderConfig(
        vocab_size=96,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        max_positions=128,
        bos_id=1,
        eos_ids=(2,),
        pad_id=0,
    ),
}
DecoderConfig.PRESETS = PRESETS
