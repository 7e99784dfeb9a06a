"""RowQuantize: the stock nodes' bytes (kernel and function body), NaN rows, the rewrite and the
domain's declaration."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from attnserve import kernels
from tests.kernels.helpers import (
    BUILT,
    activations,
    needs_library,
    session,
)


def row_quantize_graph(rank: int, rewrite: bool) -> bytes:
    """Per-row int8 quantization as attnserve.export.quantize writes it, optionally rewritten."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [f"d{i}" for i in range(rank)])
    graph = helper.make_graph(
        [
            helper.make_node("Abs", ["x"], ["magnitude"]),
            helper.make_node("ReduceMax", ["magnitude", "last"], ["scale"], keepdims=1),
            helper.make_node("Div", ["x", "scale"], ["unit"]),
            helper.make_node("QuantizeLinear", ["unit", "step", "zero_point"], ["q"]),
        ],
        "row_quantize",
        [x],
        [
            helper.make_tensor_value_info("q", TensorProto.UINT8, None),
            helper.make_tensor_value_info("scale", TensorProto.FLOAT, None),
        ],
        [
            helper.make_tensor("last", TensorProto.INT64, [1], [-1]),
            helper.make_tensor("step", TensorProto.FLOAT, [], [1.0 / 127.0]),
            helper.make_tensor("zero_point", TensorProto.UINT8, [], [128]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    if rewrite:
        assert kernels.use_row_quantize_kernel(model) == 1
        assert kernels.use_row_quantize_kernel(model) == 0
        assert [n.op_type for n in model.graph.node] == [kernels.ROW_QUANTIZE]
    return model.SerializeToString()


@pytest.mark.parametrize("shape", [(3, 1), (5, 15), (4, 16), (2, 3, 17), (9, 256), (1, 7, 1000)])
def test_row_quantize_gives_the_stock_nodes_bytes(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(sum(shape))
    x = activations(rng, shape)
    stock = session(row_quantize_graph(len(shape), False), False).run(None, {"x": x})
    portable = session(row_quantize_graph(len(shape), True), False).run(None, {"x": x})
    runs = [portable]
    if BUILT:
        runs.append(session(row_quantize_graph(len(shape), True), True).run(None, {"x": x}))
    for run in runs:
        for got, want in zip(run, stock, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)


@needs_library
@pytest.mark.parametrize("at", [0, 5, 17, 39])
def test_row_quantize_of_a_row_with_a_nan_gives_it_a_nan_scale(at: int) -> None:
    """Wherever the NaN is, its row's scale is NaN and its bytes 0 (the products then carry the
    NaN on); the other rows get the stock bytes. ONNX Runtime's ReduceMax skips a NaN unless it
    comes first, so the stock graph's scale depends on where the NaN is."""
    x = activations(np.random.default_rng(at), (3, 40))
    x[1, at] = np.nan
    stock = session(row_quantize_graph(2, False), False).run(None, {"x": x})
    q, scale = session(row_quantize_graph(2, True), True).run(None, {"x": x})
    assert np.isnan(scale[1, 0]) and not q[1].any()
    for got, want in zip((q, scale), stock, strict=True):
        np.testing.assert_array_equal(got[[0, 2]], want[[0, 2]])


def test_a_quantization_whose_intermediate_value_is_read_keeps_its_nodes() -> None:
    exposed = onnx.load_from_string(row_quantize_graph(2, False))
    exposed.graph.output.append(helper.make_tensor_value_info("unit", TensorProto.FLOAT, None))
    assert kernels.use_row_quantize_kernel(exposed) == 0


def test_the_kernels_domain_is_declared_at_version_1() -> None:
    model = onnx.load_from_string(row_quantize_graph(2, False))
    model.opset_import.append(helper.make_opsetid(kernels.DOMAIN, 1000))  # as ORT's saver writes
    assert kernels.use_row_quantize_kernel(model) == 1
    assert [o.version for o in model.opset_import if o.domain == kernels.DOMAIN] == [1]
    assert not {"last", "step", "zero_point"} & {i.name for i in model.graph.initializer}
