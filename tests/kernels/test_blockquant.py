"""BlockQ4MatMul and BlockQ8MatMul (weights in llama.cpp's Q4_1 / Q8_0 blocks, written by
attnserve/export/blockwise.py) against numpy, kernel and stock body."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from attnserve import kernels
from attnserve.export import blockwise as bw
from tests.kernels.helpers import (
    q4_1_weight,
    q8_0_weight,
)


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
    not kernels.block_products(),
    reason="BlockQ4MatMul runs on AVX-512 VNNI or AVX2 with the library",
)


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
