"""Block-wise weight quantization (export/blockwise.py) against numpy: the grids it recovers
exactly (Q4_1, Q8_0), MatMulNBits' layout (an ONNX Runtime session at float accuracy gives
the dequantized product), the rewrite of a graph, and rows that do not depend on each other."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from attnserve import kernels
from attnserve.export import blockwise as bw
from tests.kernels.helpers import q4_1_weight, q8_0_weight

K, N, V = 64, 48, 96


def test_q4_1_and_q8_0_grids_are_recovered_exactly() -> None:
    rng = np.random.default_rng(0)
    w4 = q4_1_weight(rng)
    np.testing.assert_allclose(bw.dequantize(bw.affine4(w4)), w4, rtol=0, atol=1e-6)
    w8 = q8_0_weight(rng)
    np.testing.assert_allclose(bw.dequantize(bw.symmetric8(w8)), w8, rtol=0, atol=1e-7)


def test_other_weights_get_round_to_nearest_error() -> None:
    w = np.random.default_rng(1).normal(size=(K, N)).astype(np.float32)
    blocks = w.T.reshape(N, K // 32, 32)
    step4 = (blocks.max(-1) - blocks.min(-1)) / 15
    error4 = np.abs(bw.dequantize(bw.affine4(w)) - w).T.reshape(N, K // 32, 32).max(-1)
    assert np.all(error4 <= step4 / 2 + 1e-6)
    step8 = np.abs(blocks).max(-1) / 127
    error8 = np.abs(bw.dequantize(bw.symmetric8(w)) - w).T.reshape(N, K // 32, 32).max(-1)
    assert np.all(error8 <= step8 / 2 + 1e-6)


def test_constant_blocks() -> None:
    w = np.full((K, N), 0.25, dtype=np.float32)
    np.testing.assert_array_equal(bw.dequantize(bw.affine4(w)), w)
    zero = np.zeros((K, N), dtype=np.float32)
    np.testing.assert_array_equal(bw.dequantize(bw.symmetric8(zero)), zero)


def graph(w_q: np.ndarray, w_k: np.ndarray, w_head: np.ndarray) -> onnx.ModelProto:
    """x -> q = x @ Wq, k = x @ Wk (one input, two products), logits = q @ Whead."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", K])
    outputs = [
        helper.make_tensor_value_info("k", TensorProto.FLOAT, ["b", "t", N]),
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "t", V]),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"], name="q_proj"),
        helper.make_node("MatMul", ["x", "wk"], ["k"], name="k_proj"),
        helper.make_node("Pad", ["q", "pads"], ["q64"]),
        helper.make_node("MatMul", ["q64", "head"], ["logits"], name="head"),
    ]
    inits = [
        numpy_helper.from_array(w_q, "wq"),
        numpy_helper.from_array(w_k, "wk"),
        numpy_helper.from_array(w_head, "head"),
        numpy_helper.from_array(np.array([0, 0, 0, 0, 0, K - N], dtype=np.int64), "pads"),
    ]
    g = helper.make_graph(nodes, "g", [x], outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("accuracy_level", [0, 4])
def test_the_rewritten_graph_multiplies_by_the_dequantized_weights(accuracy_level: int) -> None:
    rng = np.random.default_rng(2)
    w_q, w_k, w_head = q4_1_weight(rng), q4_1_weight(rng), q8_0_weight(rng, K, V)
    model = graph(w_q, w_k, w_head)
    counts = bw.quantize_blockwise(model, V, accuracy_level=accuracy_level)
    assert counts == {"int4_affine": 2, "int8_symmetric": 1, "float": 0, "embedding_int8": 0}
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") == 3
    # x's block sums are computed once for both of its products
    assert sum(n.name == "x.block_sums" for n in model.graph.node) == 1
    assert {i.name for i in model.graph.initializer}.isdisjoint({"wq", "wk", "head"})
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.normal(size=(3, 5, K)).astype(np.float32)
    k, logits = session.run(None, {"x": x})
    q = np.pad(x @ w_q, [(0, 0), (0, 0), (0, K - N)])
    if accuracy_level == 0:  # float compute: the weights are exact, so is the product
        np.testing.assert_allclose(k, x @ w_k, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(logits, q @ w_head, rtol=1e-4, atol=1e-4)
    else:  # int8 activations per block of a row: close, not exact
        np.testing.assert_allclose(k, x @ w_k, rtol=0.05, atol=0.05 * np.abs(x @ w_k).max())
    # each row's result is that of the row alone
    for row in range(x.shape[0]):
        alone_k, alone_logits = session.run(None, {"x": x[row : row + 1]})
        np.testing.assert_array_equal(alone_k[0], k[row])
        np.testing.assert_array_equal(alone_logits[0], logits[row])


def test_weights_it_cannot_block_stay_float() -> None:
    rng = np.random.default_rng(3)
    model = graph(q4_1_weight(rng), q4_1_weight(rng), q8_0_weight(rng, K, V))
    counts = bw.quantize_blockwise(model, V, block=128)  # K = 64 is no multiple of 128
    assert counts == {"int4_affine": 0, "int8_symmetric": 0, "float": 3, "embedding_int8": 0}
    assert [n.op_type for n in model.graph.node].count("MatMulNBits") == 0


def test_products_with_the_same_node_name_get_their_own_weights() -> None:
    rng = np.random.default_rng(4)
    model = graph(q4_1_weight(rng), q4_1_weight(rng), q8_0_weight(rng, K, V))
    for node in model.graph.node:
        node.name = "mm"  # node names need not be unique
    bw.quantize_blockwise(model, V)
    onnx.checker.check_model(model)
    names = [i.name for i in model.graph.initializer]
    assert len(names) == len(set(names))


def lookup_graph(table: np.ndarray, other: np.ndarray) -> onnx.ModelProto:
    """ids -> (table[ids], other[ids]): `other` has fewer rows than the vocabulary."""
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "t"])
    outputs = [
        helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["b", "t", K]),
        helper.make_tensor_value_info("small", TensorProto.FLOAT, ["b", "t", K]),
    ]
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["emb"], name="embed"),
        helper.make_node("Gather", ["other", "ids"], ["small"], name="other"),
    ]
    inits = [numpy_helper.from_array(table, "table"), numpy_helper.from_array(other, "other")]
    g = helper.make_graph(nodes, "g", [ids], outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_the_token_embedding_becomes_an_exact_8_bit_block_lookup() -> None:
    rng = np.random.default_rng(5)
    table = np.ascontiguousarray(q8_0_weight(rng, K, V).T)  # (V, K), each row a Q8_0 row
    other = rng.normal(size=(V - 1, K)).astype(np.float32)  # not (vocabulary, C): left float
    model = lookup_graph(table, other)
    counts = bw.quantize_blockwise(model, V)
    assert counts["embedding_int8"] == 1
    ops = {n.name: n.op_type for n in model.graph.node}
    assert ops == {"emb.block8_lookup": "GatherBlockQuantized", "other": "Gather"}
    names = {i.name for i in model.graph.initializer}
    assert "table" not in names and "other" in names
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = rng.integers(0, V - 1, size=(3, 7))
    emb, small = session.run(None, {"ids": ids})
    np.testing.assert_array_equal(emb, table[ids])
    np.testing.assert_array_equal(small, other[ids])
    # a table off the Q8_0 grid gets round-to-nearest error within half a block's step
    noisy = rng.normal(size=(V, K)).astype(np.float32)
    model = lookup_graph(noisy, other)
    bw.quantize_blockwise(model, V)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (emb, _) = session.run(None, {"ids": ids})
    step = np.abs(noisy.reshape(V, K // 32, 32)).max(-1, keepdims=True) / 127
    error = np.abs(emb - noisy[ids]).reshape(3, 7, K // 32, 32)
    assert np.all(error <= step[ids] / 2 + 1e-6)


def test_two_lookups_of_one_table_share_its_8_bit_copy() -> None:
    rng = np.random.default_rng(7)
    table = np.ascontiguousarray(q8_0_weight(rng, K, V).T)
    model = lookup_graph(table, rng.normal(size=(3, K)).astype(np.float32))
    model.graph.node[1].input[0] = "table"  # the second lookup reads the same table
    model.graph.node[1].name = "again"
    counts = bw.quantize_blockwise(model, V)
    assert counts["embedding_int8"] == 2
    names = [i.name for i in model.graph.initializer]
    assert names.count("table.block8_table") == 1 and "table" not in names
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = rng.integers(0, V, size=(2, 5))
    emb, again = session.run(None, {"ids": ids})
    np.testing.assert_array_equal(emb, table[ids])
    np.testing.assert_array_equal(again, table[ids])


def test_only_leaves_the_embedding_float() -> None:
    rng = np.random.default_rng(6)
    model = lookup_graph(np.ascontiguousarray(q8_0_weight(rng, K, V).T), rng.normal(size=(3, K)))
    counts = bw.quantize_blockwise(model, V, only=["embed"], bits=8)
    assert counts["embedding_int8"] == 0
    assert [n.op_type for n in model.graph.node] == ["Gather", "Gather"]


def test_q4_panels_recover_a_q4_1_grid_exactly() -> None:
    """The kernel's layout (nibbles of 16-column panels, float16 d and m) holds a Q4_1 file's
    weights exactly, and any other weight to within half a step."""
    rng = np.random.default_rng(7)
    w = q4_1_weight(rng, 96, 48)
    np.testing.assert_array_equal(bw.dequantize_panels(bw.affine4_panels(w)), w)
    w8 = q8_0_weight(rng, 96, 48)
    np.testing.assert_array_equal(bw.dequantize_panels(bw.symmetric8_panels(w8)), w8)
    other = rng.normal(size=(64, 32)).astype(np.float32)
    blocks = other.T.reshape(32, 2, 32)
    step = (blocks.max(-1) - blocks.min(-1)) / 15
    error = np.abs(bw.dequantize_panels(bw.affine4_panels(other)) - other)
    assert np.all(error.T.reshape(32, 2, 32).max(-1) <= step / 2 + 1e-3 * np.abs(other).max())


def test_without_the_kernel_four_bit_products_stay_on_matmulnbits() -> None:
    rng = np.random.default_rng(5)
    model = graph(q4_1_weight(rng), q4_1_weight(rng), q8_0_weight(rng, K, V))
    counts = bw.quantize_blockwise(model, V)
    assert "on_kernel" not in counts
    assert kernels.BLOCK_Q4 not in [n.op_type for n in model.graph.node]
