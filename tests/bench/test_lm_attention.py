"""The language model's step graph with ONNX Runtime's GroupQueryAttention (`bench-lm
--attention`): it computes the torch model's function (a right-padded first prompt, then steps
of rows of different lengths appending in place), the comparison times both graphs, and each
graph opens with its own backend."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from attnserve.bench.lm_attention import GqaStep, _session, attention_markdown, compare_attention
from attnserve.cli import main
from attnserve.engine.onnx.lm_backend import OnnxLMBackend
from attnserve.engine.onnx.lm_gqa import OnnxGqaLMBackend
from attnserve.engine.onnx.lm_open import open_lm_backend
from attnserve.export import variants as build
from attnserve.export.lm_export import export_lm_model
from attnserve.export.lm_graph import build_lm_graph
from attnserve.model.decoder_checkpoint import load_decoder_dir, read_decoder_config
from tests.conftest import write_tiny_lm

# GroupQueryAttention rotates heads of a multiple of 16 channels
GQA_SHAPE = {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = write_tiny_lm(tmp_path_factory.mktemp("gqa") / "tiny-lm", **GQA_SHAPE)
    export_lm_model(out, ("fp32",), verify=False)
    return out


def _torch_last(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    return logits[0, -1].numpy()


def test_gqa_graph_matches_torch(lm_dir: Path, tmp_path: Path) -> None:
    model = load_decoder_dir(lm_dir)
    cfg = model.config
    build.save_graph(build_lm_graph(model, attention="gqa"), tmp_path / "step.onnx")
    step = GqaStep(_session(tmp_path / "step.onnx", 1), cfg)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, cfg.vocab_size, n)) for n in (3, 7)]
    ids = np.full((2, 7), cfg.pad_id, dtype=np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = prompt
    buffers = [np.zeros((2, cfg.num_kv_heads, 16, cfg.head_dim), np.float32) for _ in step.past]
    lengths = np.array([3, 7])
    logits = step(ids, lengths - 1, 7, buffers)  # a first prompt, right-padded
    for _ in range(4):  # then steps: the rows' lengths differ, no mask
        for row in range(2):
            np.testing.assert_allclose(logits[row], _torch_last(model, prompts[row]), atol=1e-4)
        tokens = logits.argmax(-1)
        for row in range(2):
            prompts[row].append(int(tokens[row]))
        logits = step(tokens[:, None], lengths, int(lengths.max()) + 1, buffers)
        lengths = lengths + 1


def test_compare_attention_times_both_graphs(lm_dir: Path, tmp_path: Path) -> None:
    results = compare_attention(
        lm_dir, "fp32", tmp_path / "gqa", rows=(1, 3), cached=8, prefill_tokens=12, calls=2,
        repeats=1,
    )  # fmt: skip
    assert [(r.graph, r.rows) for r in results] == [
        ("plain", 1), ("gqa", 1), ("plain", 3), ("gqa", 3), ("plain", 0), ("gqa", 0),
    ]  # fmt: skip
    assert all(r.ms > 0 and r.tokens_per_second > 0 for r in results)
    table = attention_markdown(results)
    assert "| step, 3 rows x 8 |" in table and "| prefill of 12 tokens |" in table
    # the export's attention is GroupQueryAttention; the plain graph went into the work dir
    plain_dir, gqa_dir = tmp_path / "gqa" / "plain" / "fp32", lm_dir / "onnx" / "fp32"
    for directory, attention in ((plain_dir, "plain"), (gqa_dir, "gqa")):
        manifest = json.loads((directory / "manifest.json").read_text())
        assert manifest["options"]["attention"] == attention
    config = read_decoder_config(lm_dir)
    with pytest.raises(ValueError, match="gqa attention"):
        OnnxLMBackend(config, gqa_dir)
    assert isinstance(open_lm_backend(config, gqa_dir), OnnxGqaLMBackend)
    assert type(open_lm_backend(config, plain_dir)) is OnnxLMBackend


def test_bench_lm_attention_cli(lm_dir: Path, tmp_path: Path) -> None:
    code = main([
        "bench-lm", "--model", str(lm_dir), "--attention", "--variant", "fp32", "--rows", "2",
        "--prefill-tokens", "10", "--repeats", "1", "--work-dir", str(tmp_path / "gqa"),
        "--output-dir", str(tmp_path), "--name", "attention",
    ])  # fmt: skip
    assert code == 0
    rows = json.loads((tmp_path / "attention.json").read_text())
    assert {(r["graph"], r["rows"]) for r in rows} == {
        ("plain", 2), ("gqa", 2), ("plain", 0), ("gqa", 0),
    }  # fmt: skip
