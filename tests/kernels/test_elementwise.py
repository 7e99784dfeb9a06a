"""AddRMSNorm and SwiGLU against the nodes they replace, and the rewrite."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from attnserve import kernels
from tests.kernels.helpers import (
    needs_library,
    session,
)


def mlp_block_graph(rows: int, columns: int, hidden: int, rewrite: bool) -> bytes:
    """A residual Add, the RMSNormalization of its sum (the sum also read on), and a SwiGLU
    (Split in halves, x * Sigmoid(x), times the other half), as the step graph writes them."""
    rng = np.random.default_rng(columns)
    inits = [
        onnx.numpy_helper.from_array(rng.random(columns, np.float32) + 0.5, "norm.weight"),
        onnx.numpy_helper.from_array(np.array([hidden, hidden], np.int64), "halves"),
    ]
    nodes = [
        helper.make_node("Add", ["x", "y"], ["sum"]),
        helper.make_node(
            "RMSNormalization",
            ["sum", "norm.weight"],
            ["normed"],
            axis=-1,
            epsilon=1e-5,
            stash_type=1,
        ),
        helper.make_node("Split", ["gate_up", "halves"], ["gate", "up"], axis=-1),
        helper.make_node("Sigmoid", ["gate"], ["sigmoid"]),
        helper.make_node("Mul", ["gate", "sigmoid"], ["silu"]),
        helper.make_node("Mul", ["up", "silu"], ["act"]),
        helper.make_node("Add", ["sum", "normed"], ["next"]),  # the sum read on
    ]
    value = lambda name, width: helper.make_tensor_value_info(  # noqa: E731
        name, TensorProto.FLOAT, [rows, width]
    )
    graph = helper.make_graph(
        nodes,
        "block",
        [value("x", columns), value("y", columns), value("gate_up", 2 * hidden)],
        [value("normed", columns), value("next", columns), value("act", hidden)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=11)
    if rewrite:
        assert kernels.use_elementwise_kernels(model) == 2
        assert kernels.use_elementwise_kernels(model) == 0  # once only
        ops = [n.op_type for n in model.graph.node]
        assert ops == [kernels.ADD_NORM, kernels.SWIGLU, "Add"], ops
    onnx.checker.check_model(model)
    return model.SerializeToString()


@needs_library
@pytest.mark.parametrize("shape", [(1, 576, 1536), (3, 64, 40), (70, 576, 1536), (2, 20, 7)])
def test_the_elementwise_kernels_compute_the_nodes_they_replace(shape: tuple[int, ...]) -> None:
    rows, columns, hidden = shape
    rng = np.random.default_rng(6)
    f = {
        "x": rng.standard_normal((rows, columns), dtype=np.float32),
        "y": rng.standard_normal((rows, columns), dtype=np.float32),
        "gate_up": rng.standard_normal((rows, 2 * hidden), dtype=np.float32) * 4,
    }
    want = session(mlp_block_graph(rows, columns, hidden, False), library=False).run(None, f)
    for library in (True, False):  # the kernels; their functions' stock bodies
        got = session(mlp_block_graph(rows, columns, hidden, True), library).run(None, f)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    alone = session(mlp_block_graph(1, columns, hidden, True), True)
    together = session(mlp_block_graph(rows, columns, hidden, True), True).run(None, f)
    for r in range(rows):  # a row's bits do not depend on the others
        got = alone.run(None, {k: v[r : r + 1] for k, v in f.items()})
        for a, b in zip(got, together, strict=True):
            np.testing.assert_array_equal(a[0], b[r])


def test_an_add_of_a_constant_keeps_its_norm() -> None:
    """A bias or a position table added before a norm would broadcast: not AddRMSNorm's."""
    model = onnx.load_from_string(mlp_block_graph(2, 16, 8, False))
    add = model.graph.node[0]
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.ones(16, np.float32), "bias"))
    add.input[1] = "bias"
    assert kernels.use_elementwise_kernels(model) == 1  # the SwiGLU only
    assert [n.op_type for n in model.graph.node][:2] == ["Add", "RMSNormalization"]


def test_nodes_the_elementwise_kernels_do_not_compute_are_left_alone() -> None:
    model = onnx.load_from_string(mlp_block_graph(2, 16, 8, False))
    norm = next(n for n in model.graph.node if n.op_type == "RMSNormalization")
    norm.attribute.append(helper.make_attribute("axis", 0))  # another axis (the last one wins)
    del norm.attribute[0]
    sigmoid = next(n for n in model.graph.node if n.op_type == "Sigmoid")
    model.graph.output.append(helper.make_tensor_value_info(sigmoid.output[0], 1, None))
    assert kernels.use_elementwise_kernels(model) == 0  # a norm of axis 0; a sigmoid read on
