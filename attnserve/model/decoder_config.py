"""DecoderConfig: the architecture of a decoder-only language model, as data (no torch import)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from attnserve.model.config_file import ConfigFile

DecoderFamily = Literal["llama"]
FAMILIES: tuple[str, ...] = ("llama",)


@dataclass(frozen=True)
class DecoderConfig(ConfigFile):
    """Architecture and special token ids of a Llama-architecture model.

    Pre-norm RMSNorm blocks, rotary positions (rotate-half convention), grouped-query attention,
    a SwiGLU MLP and no biases. Defaults are the shape of SmolLM2-135M-Instruct.
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

    def __post_init__(self) -> None:
        eos = self.eos_ids
        if isinstance(eos, int | str) or not isinstance(eos, Sequence):
            raise ValueError(f"eos_ids must be a sequence of token ids, not {eos!r}")
        object.__setattr__(self, "eos_ids", tuple(int(i) for i in eos))
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
        ids = [("pad_id", self.pad_id), *(("eos_ids", i) for i in self.eos_ids)]
        if self.bos_id is not None:
            ids.append(("bos_id", self.bos_id))
        for name, value in ids:
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} {value} is outside the vocabulary ({self.vocab_size})")

    @property
    def kv_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["eos_ids"] = list(self.eos_ids)
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
