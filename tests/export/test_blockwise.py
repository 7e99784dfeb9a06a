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

K, N, V = 64, 48, 96


def q4_1_weight(rng: np.random.Generator, k: int = K, n: int = N) -> np.ndarray:
    """(K, N) float32 on a Q4_1 grid: fp16 scale and minimum per block of 32 inputs."""
    q = rng.integers(0, 16, size=(n, k // 32, 32)).astype(np.float32)
    q[..., 0], q[..., 1] = 0, 15  # llama.cpp's quantizer maps a block's min to 0, max to 15
    d = rng.uniform(0.01, 0.1, size=(n, k // 32, 1)).astype(np.float16).astype(np.float32)
    m = rng.normal(size=(n, k // 32, 1)).astype(np.float16).astype(np.float32)
    return np.ascontiguousarray((d * q + m).reshape(n, k).T)


def q8_0_weight(rng: np.random.Generator, k: int = K, n: int = N) -> np.ndarray:
    q = rng.integers(-127, 128, size=(n, k // 32, 32)).astype(np.float32)
    q[..., 0] = 127
    d = rng.uniform(0.001, 0.01, size=(n, k // 32, 1)).astype(np.float16).astype(np.float32)
    return np.ascontiguousarray((d * q).reshape(n, k).T)


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


# ---- attnserve's 4-bit kernel (BlockQ4MatMul) ----------------------------------------------


def q4_graph(w: np.ndarray, bits: int = 4) -> onnx.ModelProto:
    """y = x @ W for x (b, t, K), rewritten onto BlockQ4MatMul (or, as an output projection,
    BlockQ8MatMul)."""
    k, n = w.shape
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "t", n])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    counts = bw.quantize_blockwise(model, n if bits == 8 else 0, q4_kernel=True)
    assert counts["on_kernel"] == counts["int4_affine" if bits == 4 else "int8_symmetric"] == 1
    op = kernels.BLOCK_Q4 if bits == 4 else kernels.BLOCK_Q8
    assert [node.op_type for node in model.graph.node] == [op]
    onnx.checker.check_model(model)
    return model


def q4_session(model: onnx.ModelProto, library: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    if library:
        assert kernels.register(options)
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def block_quantized(x: np.ndarray) -> np.ndarray:
    """x with each block of 32 of a row quantized as RowQuantize quantizes a row, in float64."""
    blocks = x.reshape(-1, 32).astype(np.float64)
    scale = np.abs(blocks).max(axis=-1, keepdims=True)
    q = np.clip(np.rint(blocks / np.where(scale > 0, scale, 1) * 127), -127, 127)
    return (q / 127 * scale).reshape(x.shape)


needs_q4 = pytest.mark.skipif(
    not kernels.integer_products(), reason="BlockQ4MatMul runs on AVX-512 VNNI with the library"
)


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


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("library", [False, pytest.param(True, marks=needs_q4)])
@pytest.mark.parametrize(
    "shape",
    [
        (1, 1, 64, 16),
        (2, 5, 96, 80),
        (1, 7, 32, 48),
        (1, 200, 1024, 80),  # rows in two tasks; the activations quantized on the threads
    ],
)
def test_block_q4_multiplies_by_the_blocks_with_block_quantized_activations(
    shape: tuple[int, ...], library: bool, bits: int
) -> None:
    """Kernel (rows in blocks of 4 and their rest, panels in groups of 4 and their rest) and the
    stock body (any ONNX Runtime) give x_blocks @ W: x quantized per block of 32 of a row,
    W the dequantized blocks (4-bit affine or 8-bit symmetric); a row gets the same bits alone
    as in any batch."""
    b, t, k, n = shape
    rng = np.random.default_rng(sum(shape))
    w = q4_1_weight(rng, k, n) if bits == 4 else q8_0_weight(rng, k, n)
    session = q4_session(q4_graph(w, bits), library)
    x = rng.normal(size=(b, t, k)).astype(np.float32)
    x[0, 0, :8] *= 40  # an outlier block
    (y,) = session.run(None, {"x": x})
    want = block_quantized(x) @ w.astype(np.float64)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    (alone,) = session.run(None, {"x": x[-1:, -1:]})
    np.testing.assert_array_equal(alone[0, 0], y[-1, -1])


@needs_q4
def test_block_q4_kernel_and_body_agree_on_zeros_and_empty_batches() -> None:
    rng = np.random.default_rng(3)
    w = q4_1_weight(rng, 64, 32)
    model = q4_graph(w)
    kernel, body = q4_session(model, True), q4_session(model, False)
    x = np.zeros((1, 2, 64), dtype=np.float32)
    x[0, 1, 32:] = rng.normal(size=32)  # one all-zero block, one not
    for feed in (x, np.zeros((0, 3, 64), dtype=np.float32)):
        got, want = kernel.run(None, {"x": feed})[0], body.run(None, {"x": feed})[0]
        assert got.shape == want.shape == (*feed.shape[:-1], 32)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.all(kernel.run(None, {"x": x})[0][0, 0] == 0)


@needs_q4
@pytest.mark.parametrize("bits", [4, 8])
def test_block_products_refuse_a_weight_of_another_shape(bits: int) -> None:
    rng = np.random.default_rng(4)
    w = q4_1_weight(rng, 64, 32) if bits == 4 else q8_0_weight(rng, 64, 32)
    model = q4_graph(w, bits)
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "k"
    session = q4_session(model, True)
    with pytest.raises(Exception, match=f"BlockQ{bits}MatMul wants x"):
        session.run(None, {"x": np.zeros((1, 1, 96), dtype=np.float32)})


def test_without_the_kernel_four_bit_products_stay_on_matmulnbits() -> None:
    rng = np.random.default_rng(5)
    model = graph(q4_1_weight(rng), q4_1_weight(rng), q8_0_weight(rng, K, V))
    counts = bw.quantize_blockwise(model, V)
    assert "on_kernel" not in counts
    assert kernels.BLOCK_Q4 not in [n.op_type for n in model.graph.node]
