"""QMatMul, PackedQMatMul and RowQMatMul: per-row int8 products with their bias, the stock
nodes' floats bit for bit, batch-invariant, packed weights, the switch, and the rewrites."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from attnserve import kernels
from tests.kernels.helpers import (
    BUILT,
    activations,
    needs_library,
    needs_vnni,
    session,
    unsigned_weights,
)


def products_graph(k: int, n: int, rank: int, rewrite: bool) -> bytes:
    """Three float products of one activation, as the torch export writes a Linear (MatMul, then
    the bias Add), per-row int8 quantized by the export's own pass: one with a bias, one without,
    one with a bias whose product is also a graph output (its Add must stay)."""
    from attnserve.export.quantize import quantize_rows

    rng = np.random.default_rng(k * 1000 + n)
    dims = [f"d{i}" for i in range(rank - 1)]
    inits = []
    for name, shape in [("w1", (k, n)), ("w2", (k, n)), ("w3", (k, n)), ("b1", (n,)), ("b3", (n,))]:
        inits.append(onnx.numpy_helper.from_array(rng.standard_normal(shape, np.float32), name))
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["p1"]),
        helper.make_node("Add", ["p1", "b1"], ["y1"]),
        helper.make_node("MatMul", ["x", "w2"], ["y2"]),
        helper.make_node("MatMul", ["x", "w3"], ["p3"]),
        helper.make_node("Add", ["b3", "p3"], ["y3"]),
    ]
    outputs = [
        helper.make_tensor_value_info(y, TensorProto.FLOAT, [*dims, n])
        for y in ("y1", "y2", "y3", "p3")
    ]
    graph = helper.make_graph(
        nodes,
        "products",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*dims, k])],
        outputs,
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    quantize_rows(model)
    if rewrite:
        assert kernels.use_row_quantize_kernel(model) == 1
        assert kernels.use_qmatmul_kernel(model) == 3
        assert kernels.use_qmatmul_kernel(model) == 0  # once only
        ops = [n.op_type for n in model.graph.node]
        # weights with K a multiple of 4 and N of 64 are stored packed, the others as they were
        packed = "Packed" if k % 4 == 0 and n % kernels.PANEL == 0 else ""
        want = ["RowQuantize", f"{packed}QMatMulBias", f"{packed}QMatMul", f"{packed}QMatMul"]
        assert ops == [*want, "Add"], ops
        ranks = {len(i.dims) for i in model.graph.initializer if i.data_type == TensorProto.INT8}
        assert ranks == ({4} if packed else {2})
    onnx.checker.check_model(model)
    return model.SerializeToString()


@pytest.mark.parametrize(
    "shape",
    [
        (1, 1, 1),
        (2, 3, 5),
        (7, 4, 16),
        (5, 510, 70),
        (13, 64, 130),
        (1, 576, 1536),
        (128, 512, 64),
        (9, 12, 192),
        (1, 20, 330),
        (1, 64, 512),
        (3, 2, 8, 20),
    ],
)
def test_qmatmul_gives_the_stock_nodes_floats(shape: tuple[int, ...]) -> None:
    *rows, k, n = shape
    rank = len(rows) + 1
    rng = np.random.default_rng(sum(shape))
    x = activations(rng, (*rows, k))
    stock = session(unsigned_weights(products_graph(k, n, rank, False)), False).run(None, {"x": x})
    portable = session(products_graph(k, n, rank, True), False).run(None, {"x": x})
    runs = [portable]
    if BUILT:
        runs.append(session(products_graph(k, n, rank, True), True).run(None, {"x": x}))
    for run in runs:
        for got, want in zip(run, stock, strict=True):
            assert got.shape == want.shape == (*rows, n)
            np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
    if np.prod(rows) > 1:
        assert not np.any(stock[1].reshape(-1, n)[0])  # the all-zero row's product


@needs_library
def test_qmatmul_gives_a_row_the_same_bits_alone_as_in_any_batch() -> None:
    run = session(products_graph(300, 100, 2, True), True)
    x = activations(np.random.default_rng(3), (37, 300))
    batch = run.run(None, {"x": x})
    for i in [0, 1, 5, 6, 11, 36]:
        for start in [i, max(0, i - 7)]:
            alone = run.run(None, {"x": x[start : i + 1]})
            for got, want in zip(alone, batch, strict=True):
                np.testing.assert_array_equal(got[-1].view(np.int32), want[i].view(np.int32))


def qmatmul_node_graph(k: int, n: int) -> bytes:
    """A QMatMulBias node whose weight is a graph input (a buffer that moves between runs)."""
    graph = helper.make_graph(
        [helper.make_node("QMatMulBias", ["q", "w", "s", "ws", "b"], ["y"], domain=kernels.DOMAIN)],
        "qmatmul",
        [
            helper.make_tensor_value_info("q", TensorProto.UINT8, ["m", k]),
            helper.make_tensor_value_info("w", TensorProto.INT8, [k, n]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, ["m", 1]),
            helper.make_tensor_value_info("ws", TensorProto.FLOAT, [n]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [n]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    kernels.declare(model)
    model.opset_import.append(helper.make_opsetid(kernels.MS_DOMAIN, 1))
    return model.SerializeToString()


@needs_vnni  # the kernel's own check: elsewhere the body runs
def test_qmatmul_packs_a_weight_again_at_another_address() -> None:
    """The kernel keeps its packed copy by the weight's address (weights are constants in the
    exported graphs); a weight at another address is packed again."""
    model = qmatmul_node_graph(20, 33)
    ours, stock = session(model, True), session(model, False)
    rng = np.random.default_rng(5)
    for _ in range(3):
        feed = {
            "q": rng.integers(0, 256, (9, 20), dtype=np.uint8),
            "w": rng.integers(-127, 128, (20, 33), dtype=np.int8),
            "s": rng.random((9, 1), dtype=np.float32),
            "ws": rng.random(33, dtype=np.float32),
            "b": rng.standard_normal(33, dtype=np.float32),
        }
        np.testing.assert_array_equal(ours.run(None, feed)[0], stock.run(None, feed)[0])
    feed["s"] = feed["s"][:3]
    with pytest.raises(Exception, match="a scale per row"):
        ours.run(None, feed)


def executed_ops(model: bytes, tmp_path: Path) -> set[str]:
    """The op types ONNX Runtime ran for one call (its profiler's node events)."""
    import json

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.enable_profiling = True
    tmp_path.mkdir(parents=True, exist_ok=True)
    options.profile_file_prefix = str(tmp_path / "profile")
    assert kernels.register(options)
    run = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    run.run(None, {"x": np.ones((2, 16), np.float32)})
    events = json.loads(Path(run.end_profiling()).read_text())
    return {e["args"]["op_name"] for e in events if e.get("cat") == "Node" and "args" in e}


@needs_vnni
def test_qmatmul_runs_on_the_kernel_and_the_switch_leaves_the_stock_body(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, packed = products_graph(16, 24, 2, True), products_graph(16, 64, 2, True)
    assert {"QMatMul", "QMatMulBias", "RowQuantize"} <= executed_ops(model, tmp_path / "on")
    assert {"PackedQMatMul", "PackedQMatMulBias"} <= executed_ops(packed, tmp_path / "packed")
    monkeypatch.setenv("ATTNSERVE_KERNELS_QMATMUL", "0")
    for graph, name in [(model, "off"), (packed, "packed-off")]:
        ran = executed_ops(graph, tmp_path / name)
        assert "MatMulIntegerToFloat" in ran and not {"QMatMul", "QMatMulBias"} & ran
        assert not {"PackedQMatMul", "PackedQMatMulBias"} & ran
        assert "RowQuantize" in ran


def test_weights_beside_the_graph_are_packed_and_saved_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph whose weights are external data (large models) is loaded whole, its products'
    weights packed, and saved again without the (K, N) copies: the data file holds each weight
    once, and the graph computes what it did."""
    from attnserve.export import variants

    model = onnx.load_from_string(products_graph(16, 64, 2, False))
    exact = unsigned_weights(model.SerializeToString())  # the reference, before it is saved
    path = tmp_path / "graph.onnx"
    onnx.save(
        model, str(path), save_as_external_data=True, location="graph.onnx.data", size_threshold=512
    )
    x = activations(np.random.default_rng(7), (5, 16))
    stock = ort.InferenceSession(exact, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    weights_bytes = (path.parent / "graph.onnx.data").stat().st_size
    monkeypatch.setattr(variants, "EXTERNAL_DATA_BYTES", 1)  # saved beside the graph again
    assert variants.use_kernels(path, decoder=False) == 4  # RowQuantize and the 3 products
    rewritten = onnx.load(str(path), load_external_data=False)
    assert [n.op_type for n in rewritten.graph.node][1:4] == [
        "PackedQMatMulBias",
        "PackedQMatMul",
        "PackedQMatMul",
    ]
    # the packed weights replace the (K, N) ones: not a byte more than before
    assert (path.parent / "graph.onnx.data").stat().st_size <= weights_bytes
    for library in [False, *([True] if BUILT else [])]:
        options = ort.SessionOptions()
        if library:
            assert kernels.register(options)
        got = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(
            None, {"x": x}
        )
        for a, b in zip(got, stock, strict=True):
            np.testing.assert_array_equal(a.view(np.int32), b.view(np.int32))


def test_products_without_a_scale_per_row_or_with_a_shared_weight_keep_their_nodes() -> None:
    """A MatMulIntegerToFloat whose activation scale is one value for the tensor stays (the
    kernel wants one per row); a weight that two products read stays (K, N) for both."""
    from attnserve.export.quantize import quantize_rows

    model = onnx.load_from_string(products_graph(8, 64, 2, False))
    for node in model.graph.node:
        if node.op_type == "MatMulIntegerToFloat":
            node.input[2] = "one_scale"
    model.graph.initializer.append(helper.make_tensor("one_scale", TensorProto.FLOAT, [], [0.5]))
    assert kernels.use_qmatmul_kernel(model) == 0
    rng = np.random.default_rng(2)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["y1"]),
            helper.make_node("MatMul", ["x", "w"], ["y2"]),
        ],
        "shared",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", 8])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["m", 64]) for y in ("y1", "y2")],
        [onnx.numpy_helper.from_array(rng.standard_normal((8, 64), np.float32), "w")],
    )
    shared = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    quantize_rows(shared)
    assert kernels.use_qmatmul_kernel(shared) == 2
    assert [n.op_type for n in shared.graph.node][-2:] == ["QMatMul", "QMatMul"]
    assert {len(i.dims) for i in shared.graph.initializer if i.data_type == TensorProto.INT8} == {2}


def row_product_graph(k: int, n: int, rank: int, rewrite: bool) -> bytes:
    """One per-row int8 product of a float activation (a language model's projection: no bias,
    its quantization read by it alone), optionally on RowQMatMul."""
    from attnserve.export.quantize import quantize_rows

    rng = np.random.default_rng(k + n)
    dims = [f"d{i}" for i in range(rank - 1)]
    weight = onnx.numpy_helper.from_array(rng.standard_normal((k, n), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "product",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*dims, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*dims, n])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    quantize_rows(model)
    if rewrite:
        kernels.use_row_quantize_kernel(model)
        kernels.use_qmatmul_kernel(model)
        assert kernels.use_row_qmatmul_kernel(model) == 1
        assert kernels.use_row_qmatmul_kernel(model) == 0  # once only
        assert [n.op_type for n in model.graph.node] == [kernels.ROW_QMATMUL]
    onnx.checker.check_model(model)
    return model.SerializeToString()


@pytest.mark.parametrize("shape", [(1, 576, 960), (5, 64, 128), (40, 1536, 576), (2, 3, 12, 64)])
def test_row_qmatmul_gives_the_stock_nodes_floats(shape: tuple[int, ...]) -> None:
    """RowQuantize and PackedQMatMul in one node: the same bytes, the same product, bit for bit
    (kernel and function body), with a few rows quantized on the calling thread or many on the
    session's threads."""
    *rows, k, n = shape
    x = activations(np.random.default_rng(k * n), (*rows, k))
    reference = unsigned_weights(row_product_graph(k, n, len(rows) + 1, False))
    stock = session(reference, False).run(None, {"x": x})[0]
    runs = [session(row_product_graph(k, n, len(rows) + 1, True), False)]
    if BUILT:
        runs.append(session(row_product_graph(k, n, len(rows) + 1, True), True))
    for run in runs:
        got = run.run(None, {"x": x})[0]
        np.testing.assert_array_equal(got.view(np.int32), stock.view(np.int32))


def test_a_quantization_read_by_two_products_stays_apart() -> None:
    model = onnx.load_from_string(products_graph(64, 128, 2, True))  # one RowQuantize, 3 reads
    assert kernels.use_row_qmatmul_kernel(model) == 0
