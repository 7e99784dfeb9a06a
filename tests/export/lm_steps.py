"""Test helpers: a tiny random language model and one step of its ONNX graph in ONNX Runtime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from attnserve.engine.onnx.layout import LM_PLAIN
from attnserve.model.decoder_config import DecoderConfig
from attnserve.model.decoder_only import DecoderOnly

PROMPT = [5, 17, 33, 8, 91]


def tiny_lm(vocab_size: int = 96, seed: int = 0) -> DecoderOnly:
    """Heads of 16 channels (GroupQueryAttention's multiple), weights large enough that the
    logits differ."""
    config = DecoderConfig.preset(
        "tiny", vocab_size=vocab_size, hidden_size=64, head_dim=16, intermediate_size=128
    )
    torch.manual_seed(seed)
    model = DecoderOnly(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.2 if p.dim() > 1 else 0.5 + torch.rand(p.shape))
    return model


def run_step(graph: bytes | str | Path, cfg: DecoderConfig, attention: str) -> list[np.ndarray]:
    """The graph's outputs for a first prompt (PROMPT) in one row, no cache: logits of every
    position, then each layer's new keys and values."""
    ids = np.array([PROMPT], dtype=np.int64)
    t, kv, d = ids.shape[1], cfg.num_kv_heads, cfg.head_dim
    feed: dict[str, np.ndarray] = {"input_ids": ids, "logit_positions": np.arange(t)}
    if attention == LM_PLAIN:
        feed["attention_mask"] = np.ones((1, t), dtype=np.int64)
        feed["past_mask"] = np.zeros((1, 0), dtype=np.int64)
    else:
        feed["seqlens_k"] = np.array([t - 1], dtype=np.int32)
        feed["total_sequence_length"] = np.array(t, dtype=np.int32)
    past = np.zeros((1, kv, 0, d), dtype=np.float32)
    for i in range(cfg.num_layers):
        feed[f"past.{i}.key"] = feed[f"past.{i}.value"] = past
    source = str(graph) if isinstance(graph, Path) else graph
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    return list(session.run(None, feed))
