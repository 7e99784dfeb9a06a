"""Language models near protobuf's 2 GB limit, the limit lowered to a tiny model's size: which
graphs keep their weights beside them (attnserve/export/variants.py), that such an export
loads and computes what an in-memory one does, and that quantize_int8 frees the optimized
graph's files once it holds them, with the same int8 graph as before."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from attnserve.engine.onnx.layout import LM_GQA, LM_PLAIN, LM_STEP_NAME
from attnserve.engine.onnx.lm_open import open_lm_backend
from attnserve.export import variants
from attnserve.export.lm_export import export_lm_fp32, export_lm_variants
from attnserve.export.quantize import SHARED_LOOKUP_BYTES, quantize_rows
from tests.export.lm_steps import PROMPT, run_step, tiny_lm

DATA = variants.external_data_name(LM_STEP_NAME)


def test_the_model_decision_at_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_lm()
    weight_bytes = sum(p.numel() for p in model.parameters()) * 4
    monkeypatch.setattr(variants, "EXTERNAL_DATA_BYTES", weight_bytes)
    assert variants.needs_external_data(model)
    monkeypatch.setattr(variants, "EXTERNAL_DATA_BYTES", weight_bytes + 1)
    assert not variants.needs_external_data(model)


def test_the_graph_decision_at_the_threshold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """save_graph: weights beside a graph of the threshold's size, inline one byte below it;
    both load with the same weights."""
    from attnserve.export.lm_graph import build_lm_graph

    size = build_lm_graph(tiny_lm()).ByteSize()
    saved = {}
    for limit, folder in ((size, "beside"), (size + 1, "inline")):
        monkeypatch.setattr(variants, "EXTERNAL_DATA_BYTES", limit)
        (tmp_path / folder).mkdir()
        saved[folder] = variants.save_graph(build_lm_graph(tiny_lm()), tmp_path / folder / "g")
    assert (tmp_path / "beside" / "g.data").is_file()
    assert not (tmp_path / "inline" / "g.data").exists()
    a, b = (onnx.load(str(saved[k])).graph.initializer for k in ("beside", "inline"))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(x), onnx.numpy_helper.to_array(y))


@pytest.mark.parametrize("attention", [LM_PLAIN, LM_GQA])
def test_an_export_at_the_threshold_loads_and_matches(
    attention: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the threshold the fp32 graph is built with its weights in step.onnx.data, and decodes
    as the in-memory export does and as torch does."""
    model = tiny_lm()
    weight_bytes = sum(p.numel() for p in model.parameters()) * 4
    for limit, folder in ((variants.EXTERNAL_DATA_BYTES, "inline"), (weight_bytes, "beside")):
        monkeypatch.setattr(variants, "EXTERNAL_DATA_BYTES", limit)
        export_lm_variants(model, tmp_path / folder, ("fp32",), attention=attention, verify=False)

    files = {
        k: set(json.loads((tmp_path / k / "fp32" / "manifest.json").read_text())["files"])
        for k in ("inline", "beside")
    }
    assert files == {"inline": {LM_STEP_NAME}, "beside": {LM_STEP_NAME, DATA}}
    beside = tmp_path / "beside" / "fp32"
    assert (beside / LM_STEP_NAME).stat().st_size < (beside / DATA).stat().st_size / 10
    logits = []
    for k in ("inline", "beside"):
        backend = open_lm_backend(model.config, tmp_path / k / "fp32", provider="cpu")
        state = backend.encode(np.array([PROMPT]), np.array([len(PROMPT)]))
        first, state = backend.step(np.array([3]), state)
        second, _ = backend.step(np.array([int(first[0].argmax())]), state)
        logits.append(np.stack([first, second]))
    np.testing.assert_array_equal(logits[0], logits[1])
    with torch.no_grad():
        ids = torch.tensor([[*PROMPT, 3]])
        expected = model(ids, torch.ones_like(ids, dtype=torch.bool))[0, -1].numpy()
    np.testing.assert_allclose(logits[1][0, 0], expected, atol=1e-4)


def test_quantize_int8_frees_the_optimized_graph_and_quantizes_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vocabulary of 8192 x 64 (2 MB): ONNX Runtime writes the optimized graph's large
    tensors beside it. quantize_int8 deletes both files once loaded, and its int8 graph is the
    one quantized from a kept copy (the steps it runs, without the release)."""
    model = tiny_lm(vocab_size=8192)
    vocab = model.config.vocab_size
    export_lm_fp32(model, tmp_path / "fp32", LM_PLAIN)
    optimized_files: list[list[str]] = []
    optimize = variants.optimize_offline

    def watched(src: Path, dst: Path, level: str = "basic") -> Path:
        out = optimize(src, dst, level)
        optimized_files.append(sorted(p.name for p in dst.parent.iterdir()))
        return out

    monkeypatch.setattr(variants, "optimize_offline", watched)
    (tmp_path / "int8").mkdir()
    work = tmp_path / "work"
    variants.quantize_int8(
        tmp_path / "fp32",
        tmp_path / "int8",
        work,
        float_output=False,
        names=(LM_STEP_NAME,),
        vocab_size=vocab,
    )
    assert optimized_files == [[LM_STEP_NAME, DATA]]  # both written, then
    assert list(work.iterdir()) == []  # both released

    kept = tmp_path / "kept"
    kept.mkdir()
    reference = onnx.load(str(optimize(tmp_path / "fp32" / LM_STEP_NAME, kept / LM_STEP_NAME)))
    quantize_rows(reference, [], embedding_rows=vocab, column_lookup_bytes=SHARED_LOOKUP_BYTES)
    variants.save_graph(reference, tmp_path / "reference.onnx")
    released = onnx.load(str(tmp_path / "int8" / LM_STEP_NAME))
    assert released.graph == onnx.load(str(tmp_path / "reference.onnx")).graph
    assert any(n.op_type == "MatMulIntegerToFloat" for n in released.graph.node)

    # run as the export serves it, on the kernels' rewrite (exact on every CPU; the uint8 x
    # int8 node alone saturates in ONNX Runtime without VNNI)
    for graph in (tmp_path / "int8" / LM_STEP_NAME, tmp_path / "reference.onnx"):
        variants.use_kernels(graph, decoder=False)
    got = run_step(tmp_path / "int8" / LM_STEP_NAME, model.config, LM_PLAIN)
    want = run_step(tmp_path / "reference.onnx", model.config, LM_PLAIN)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_array_equal(x, y)
    fp32 = run_step(tmp_path / "fp32" / LM_STEP_NAME, model.config, LM_PLAIN)[0]
    assert (got[0].argmax(-1) == fp32.argmax(-1)).mean() >= 0.8  # int8 of this model, not noise
