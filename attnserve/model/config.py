"""ModelConfig: the architecture of an encoder-decoder Transformer, as data (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from attnserve.model.config_file import ConfigFile

Activation = Literal["relu", "gelu", "gelu_tanh", "swish"]
ACTIVATION_NAMES = ("relu", "gelu", "gelu_tanh", "swish")
NormPlacement = Literal["post", "pre"]
NormKind = Literal["layernorm", "rmsnorm"]
# Marian's sinusoids (sin in the first half of the channels); fairseq's (M2M100, NLLB: another
# frequency scale); learned tables, one per stack (BART, mBART); T5's relative position buckets
# (a learned bias per head added to the self-attention scores, computed once per stack).
PositionKind = Literal["sinusoidal", "sinusoidal_fairseq", "learned", "relative"]
POSITION_KINDS = ("sinusoidal", "sinusoidal_fairseq", "learned", "relative")


@dataclass(frozen=True)
class ModelConfig(ConfigFile):
    """Architecture and special token ids.

    Defaults follow Marian / OPUS-MT (post-LN, scaled embeddings, sinusoidal positions,
    shared and tied embeddings, a final logits bias, eos=0, decoder start = pad). Pre-LN models
    have a final LayerNorm after each stack (M2M100, NLLB, mBART); post-LN ones do not.
    """

    vocab_size: int = 8000
    # Target vocabulary when it differs from the source one (Marian's separate vocabs).
    tgt_vocab_size: int | None = None
    d_model: int = 512
    n_heads: int = 8
    encoder_layers: int = 6
    decoder_layers: int = 6
    ffn_dim: int = 2048
    activation: Activation = "relu"
    norm_placement: NormPlacement = "post"
    scale_embedding: bool = True
    # Encoder and decoder input embeddings are one matrix (needs tgt vocab == src vocab).
    shared_embeddings: bool = True
    # Output projection = decoder input embedding (transposed).
    tied_output: bool = True
    final_logits_bias: bool = True
    positions: PositionKind = "sinusoidal"
    # The table row of position 0: fairseq's sinusoids start after the pad row (pad_id + 1),
    # BART's learned tables at 2. A table has max_positions + position_offset rows.
    position_offset: int = 0
    # A LayerNorm on the embeddings + positions, before the first layer (BART, mBART).
    layernorm_embedding: bool = False
    # T5: relative position buckets (bidirectional in the encoder, causal in the decoder).
    relative_buckets: int = 32
    relative_max_distance: int = 128
    # T5's switches: RMSNorm without bias, no biases in the projections, no 1/sqrt(d) in the
    # attention scores, a gated feed-forward (act(x W0) * x W1), a per-head width other than
    # d_model / n_heads (d_kv), and the tied output's d_model ** -0.5 rescale.
    norm: NormKind = "layernorm"
    linear_bias: bool = True
    scale_attention: bool = True
    ffn_gated: bool = False
    kv_dim: int | None = None
    scale_decoder_output: bool = False
    max_positions: int = 512
    layer_norm_eps: float = 1e-5
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    pad_id: int = 1
    eos_id: int = 0
    unk_id: int = 2
    decoder_start_id: int | None = None  # None: the pad id, as in Marian

    def __post_init__(self) -> None:
        if self.kv_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.activation not in ACTIVATION_NAMES:
            raise ValueError(f"unknown activation {self.activation!r}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"unknown norm {self.norm!r}")
        if self.norm_placement not in ("post", "pre"):
            raise ValueError(f"unknown norm_placement {self.norm_placement!r}")
        if self.positions not in POSITION_KINDS:
            raise ValueError(f"unknown positions {self.positions!r}; one of {POSITION_KINDS}")
        if self.position_offset < 0:
            raise ValueError(f"position_offset must be >= 0, got {self.position_offset}")
        if self.shared_embeddings and self.target_vocab_size != self.vocab_size:
            raise ValueError("shared_embeddings needs tgt_vocab_size == vocab_size")
        for name in ("pad_id", "eos_id", "unk_id"):
            if not 0 <= getattr(self, name) < self.target_vocab_size:
                raise ValueError(f"{name}={getattr(self, name)} is outside the vocabulary")

    @property
    def target_vocab_size(self) -> int:
        return self.tgt_vocab_size if self.tgt_vocab_size is not None else self.vocab_size

    @property
    def head_dim(self) -> int:
        return self.kv_dim if self.kv_dim is not None else self.d_model // self.n_heads

    @property
    def start_id(self) -> int:
        return self.pad_id if self.decoder_start_id is None else self.decoder_start_id


PRESETS: dict[str, ModelConfig] = {
    # Builds in milliseconds; for tests.
    "tiny": ModelConfig(
        vocab_size=64,
        d_model=32,
        n_heads=4,
        encoder_layers=2,
        decoder_layers=2,
        ffn_dim=64,
        max_positions=128,
        dropout=0.0,
    ),
    # The default model's size class: trains on CPU cores in hours (the default: ~19 hours).
    "small": ModelConfig(
        vocab_size=16000,
        d_model=256,
        n_heads=4,
        encoder_layers=6,
        decoder_layers=3,
        ffn_dim=1024,
        max_positions=256,
    ),
    # transformer-base (Vaswani et al. 2017), the shape of most OPUS-MT models.
    "base": ModelConfig(
        vocab_size=32000,
        d_model=512,
        n_heads=8,
        encoder_layers=6,
        decoder_layers=6,
        ffn_dim=2048,
        max_positions=512,
    ),
    # NLLB-200-distilled-600M's shape (M2M100 architecture: pre-LN, fairseq's sinusoids, relu,
    # a 256k vocabulary tied to the output projection), for benchmarks on random weights.
    "nllb-600m": ModelConfig(
        vocab_size=256206,
        d_model=1024,
        n_heads=16,
        encoder_layers=12,
        decoder_layers=12,
        ffn_dim=4096,
        norm_placement="pre",
        final_logits_bias=False,
        positions="sinusoidal_fairseq",
        position_offset=2,
        max_positions=1024,
        pad_id=1,
        eos_id=2,
        unk_id=3,
        decoder_start_id=2,
    ),
}
ModelConfig.PRESETS = PRESETS
