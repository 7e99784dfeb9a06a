"""Per-row int8 quantization: a row's result depends on that row alone; the export gate."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from attnserve import kernels
from attnserve.export import quantize
from attnserve.export.quantize import quantize_rows, quantize_weight
from attnserve.export.verify import (
    INT8_GATE,
    ParityError,
    check_int8,
    measure_parity,
    sentence_sources,
    torch_reference,
)
from attnserve.model.checkpoint import load_model_dir

K, N = 64, 48


def linear_graph(seed: int = 0) -> onnx.ModelProto:
    """y = x @ W + b for x (B, T, K): what an exported Linear looks like after folding."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.normal(size=(K, N)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.normal(size=N).astype(np.float32), "b")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"], name="proj"),
        helper.make_node("Add", ["xw", "b"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None, N])],
        [w, b],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"x": x})[0])


def rows(seed: int, n: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(n, 1, K)) * scale).astype(np.float32)


def test_quantize_weight_is_symmetric_per_column() -> None:
    w = np.random.default_rng(1).normal(size=(K, N)).astype(np.float32)
    q, scale = quantize_weight(w)
    assert q.dtype == np.int8 and scale.shape == (N,) and np.abs(q).max() == 127
    np.testing.assert_allclose(q * scale, w, atol=float(scale.max()) / 2 + 1e-7)


def test_rows_quantized_alone_or_in_any_batch_give_identical_results() -> None:
    """Every row's output is bit-identical whatever shares its batch: a huge row, zero rows
    (padding), more rows; and it stays close to the float product."""
    model = linear_graph()
    float_model = linear_graph()
    report = quantize_rows(model)
    assert report.quantized == ["proj"] and report.shared_inputs == 1
    assert "MatMul" not in {n.op_type for n in model.graph.node}
    # run as the export serves it, on the kernels' rewrite: their stock bodies are exact on
    # every CPU (the uint8 x int8 node alone saturates in ONNX Runtime without VNNI)
    assert kernels.use_row_quantize_kernel(model) == 1 and kernels.use_qmatmul_kernel(model) == 1
    x = rows(0, 3)
    alone = np.concatenate([run(model, x[i : i + 1]) for i in range(3)])
    batches = [  # (batch, where x's rows are in it)
        (x, slice(0, 3)),
        (np.concatenate([x, rows(1, 2, scale=1e4)]), slice(0, 3)),  # 10,000x larger rows join
        (np.concatenate([np.zeros((2, 1, K), np.float32), x]), slice(2, 5)),  # zero padding
    ]
    for batch, where in batches:
        out = run(model, batch)
        assert np.array_equal(out[where], alone)
        assert np.isfinite(out).all()
    # An all-zero row's scale is 0 (its quantized values those of 0 / 0): its product is 0.
    bias = numpy_helper.to_array(next(i for i in float_model.graph.initializer if i.name == "b"))
    assert np.array_equal(run(model, np.zeros((2, 1, K), np.float32)), np.tile(bias, (2, 1, 1)))
    expected = run(float_model, x)
    assert np.abs(alone - expected).max() < 0.05 * np.abs(expected).max()
    # Time positions are rows too: a (1, 3, K) input equals the three (1, 1, K) inputs.
    assert np.array_equal(run(model, x.reshape(1, 3, K)).reshape(3, 1, N), alone)


def test_per_tensor_scales_make_a_row_depend_on_its_batch(tmp_path: Path) -> None:
    """The contrast this rewrite removes: ONNX Runtime's quantize_dynamic (one activation scale
    per tensor) changes row 0's result when a large row joins."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    onnx.save(linear_graph(), str(tmp_path / "f.onnx"))
    quantize_dynamic(tmp_path / "f.onnx", tmp_path / "q.onnx", weight_type=QuantType.QInt8)
    model = onnx.load(str(tmp_path / "q.onnx"))
    x = rows(0, 1)
    assert not np.array_equal(run(model, x)[0], run(model, np.concatenate([x, rows(1, 1, 1e4)]))[0])


def test_excluded_products_stay_float() -> None:
    model = linear_graph()
    report = quantize_rows(model, exclude={"proj"})
    assert report.quantized == [] and report.skipped == ["proj"]
    x = rows(0, 2)
    np.testing.assert_array_equal(run(model, x), run(linear_graph(), x))


def test_parity_sentences_come_from_the_model_directory(
    tiny_marian_import: Path, tmp_path: Path
) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_marian_import, model_dir)
    assert sentence_sources(model_dir) is None
    (model_dir / "parity.tsv").write_text("xx\tyy\nKaka ro.\tZo re.\nMa ti.\tLo ka.\n")
    sources = sentence_sources(model_dir)
    assert sources is not None and len(sources) == 4
    assert all(s[-1] == 0 for s in sources)  # eos-terminated token ids


@pytest.mark.slow
def test_the_export_gate_passes_int8_and_rejects_a_broken_graph(
    tiny_onnx_import: Path, tmp_path: Path
) -> None:
    """The exported int8 variant passed the gate (its manifest records the thresholds); the same
    graph with its weight scales off by 25% fails it."""
    import json

    manifest = json.loads((tiny_onnx_import / "onnx" / "int8" / "manifest.json").read_text())
    parity = manifest["parity"]
    assert parity["gate"] == INT8_GATE and manifest["options"]["activation_scales"] == "row"
    assert parity["top1_agreement"] >= INT8_GATE["top1_agreement"]
    assert parity["mean_kl"] <= INT8_GATE["mean_kl"]

    broken = tmp_path / "int8"
    shutil.copytree(tiny_onnx_import / "onnx" / "int8", broken)
    for name in ("encoder.onnx", "decoder.onnx"):
        graph = onnx.load(str(broken / name))
        for init in graph.graph.initializer:
            if init.name.endswith("_scale"):
                init.CopyFrom(
                    numpy_helper.from_array(numpy_helper.to_array(init) * 1.25, init.name)
                )
        onnx.save(graph, str(broken / name))
    model, _ = load_model_dir(tiny_onnx_import)
    reference = torch_reference(model)
    ok = measure_parity(reference, model.config, tiny_onnx_import / "onnx" / "int8", "int8")
    check_int8(ok, tiny_onnx_import / "onnx" / "int8")
    bad = measure_parity(reference, model.config, broken, "int8")
    with pytest.raises(ParityError, match="int8 graphs fail the export gate"):
        check_int8(bad, broken)


def test_older_opsets_are_refused() -> None:
    model = linear_graph()
    model.opset_import[0].version = 17
    with pytest.raises(ValueError, match="needs ONNX opset 18"):
        quantize_rows(model)


def test_the_gate_fails_nan_and_graphs_that_do_not_run(
    tiny_onnx_import: Path, tmp_path: Path
) -> None:
    with pytest.raises(ParityError):
        check_int8({"top1_agreement": 0.95, "mean_kl": float("nan")}, tmp_path)
    broken = tmp_path / "int8"
    shutil.copytree(tiny_onnx_import / "onnx" / "int8", broken)
    (broken / "decoder.onnx").write_bytes(b"not an onnx file")
    model, _ = load_model_dir(tiny_onnx_import)
    with pytest.raises(ParityError, match="int8 graphs do not run"):
        measure_parity(torch_reference(model), model.config, broken, "int8")


@pytest.mark.slow
def test_a_verified_export_warns_of_nothing(
    tiny_marian_import: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The staged int8 graphs are verified with their manifest's options in place (no false
    per-tensor warning while exporting)."""
    import logging

    from attnserve.export.onnx_export import export_variants

    model, _ = load_model_dir(tiny_marian_import)
    with caplog.at_level(logging.WARNING):
        export_variants(model, tmp_path / "onnx", ["int8"], verify=True)
    assert "per tensor" not in caplog.text


def test_a_weight_shared_by_two_products_is_quantized_once() -> None:
    model = linear_graph()
    model.graph.node.append(helper.make_node("MatMul", ["y", "w2"], ["z"], name="again"))
    w2 = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "w"))[:N, :]
    model.graph.initializer.append(numpy_helper.from_array(w2, "w2"))
    model.graph.node.append(helper.make_node("MatMul", ["x", "w"], ["x_again"], name="twice"))
    model.graph.output.append(helper.make_tensor_value_info("x_again", TensorProto.FLOAT, None))
    report = quantize_rows(model)
    assert sorted(report.quantized) == ["again", "proj", "twice"]
    int8 = [i.name for i in model.graph.initializer if i.data_type == TensorProto.INT8]
    assert sorted(int8) == ["w2_int8", "w_int8"]
    x = rows(0, 2)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    y, x_again = session.run(["y", "x_again"], {"x": x})
    bias = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "b"))
    np.testing.assert_allclose(x_again, np.asarray(y) - bias, atol=1e-4)  # the same product


V, C = 40, 16


def embedding_graph(tied: bool, seed: int = 0) -> tuple[onnx.ModelProto, np.ndarray]:
    """h = table[ids]; logits = h @ W, W = table.T when `tied` (else another matrix)."""
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(V, C)).astype(np.float32)
    weight = table.T.copy() if tied else rng.normal(size=(C, V)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["h"], name="embed"),
        helper.make_node("MatMul", ["h", "w"], ["logits"], name="proj"),
    ]
    graph = helper.make_graph(
        nodes,
        "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [None, None])],
        [
            helper.make_tensor_value_info("h", TensorProto.FLOAT, [None, None, C]),
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, None, V]),
        ],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    return model, table


@pytest.mark.parametrize(
    ("tied", "shared", "columns"),
    [
        (True, True, V * C - 1),
        (True, False, quantize.SHARED_LOOKUP_BYTES),
        (True, False, None),
        (False, False, V * C - 1),
    ],
    ids=["shared", "tied", "rows-asked", "separate"],
)
def test_token_embeddings_are_int8_per_row_and_large_tied_ones_stored_once(
    tied: bool, shared: bool, columns: int | None
) -> None:
    """A lookup gives each token's row as int8 times that row's scale, whatever the ids'
    shape or neighbours; a table tied to the output projection and larger than
    `column_lookup_bytes` is kept once, as its int8 weight, a small one (or any, with None)
    also as rows; the float table is gone."""
    model, table = embedding_graph(tied)
    report = quantize_rows(model, embedding_rows=V, column_lookup_bytes=columns)
    assert report.embeddings == ["embed"] and report.quantized == ["proj"]
    assert report.tied == int(shared)
    stored = {i.name: tuple(i.dims) for i in model.graph.initializer}
    assert "table" not in stored
    int8 = [i for i in model.graph.initializer if i.data_type == TensorProto.INT8]
    assert len(int8) == (1 if shared else 2)
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.array([[3, 0, 39], [7, 7, 12]], np.int64)
    h, logits = session.run(None, {"ids": ids})
    q, scale = quantize_weight(table.T)  # the table's rows are W.T's columns
    np.testing.assert_array_equal(h, (q.T * scale[:, None])[ids])
    assert np.abs(h - table[ids]).max() <= scale.max() / 2 + 1e-6
    for i in range(ids.shape[0]):  # a row alone, and as a (1,) sequence
        alone = session.run(None, {"ids": ids[i : i + 1]})
        np.testing.assert_array_equal(alone[0], h[i : i + 1])
        np.testing.assert_array_equal(alone[1], logits[i : i + 1])
    one = session.run(None, {"ids": ids[:1, 1:2]})[0]
    np.testing.assert_array_equal(one, h[:1, 1:2])


def test_embeddings_stay_float_without_a_vocabulary_size_or_when_excluded() -> None:
    model, _ = embedding_graph(tied=True)
    assert quantize_rows(model).embeddings == []
    model, _ = embedding_graph(tied=True)
    assert quantize_rows(model, embedding_rows=V + 1).embeddings == []  # not the vocabulary
    model, _ = embedding_graph(tied=True)
    report = quantize_rows(model, exclude={"embed"}, embedding_rows=V)
    assert report.embeddings == [] and "table" in {i.name for i in model.graph.initializer}
    # The output projection kept float: the table is stored int8 on its own, not tied.
    model, _ = embedding_graph(tied=True)
    report = quantize_rows(model, exclude={"proj"}, embedding_rows=V)
    assert report.embeddings == ["embed"] and report.tied == 0 and report.quantized == []
