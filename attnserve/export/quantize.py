"""Per-row dynamic int8 quantization of an ONNX graph's matrix products with constant weights.

Every `MatMul` whose second input is a constant 2-D weight `W (K, N)` becomes

    s    = max(|x|, over K) / 127                      one scale per row (token position)
    x_q  = QuantizeLinear(x / s, 1, 128)               round(x / s) + 128 as uint8
    y    = MatMulIntegerToFloat(x_q, W_q, s, s_w, 128)  (+ the bias Add, as before)

with `W_q` int8, symmetric per output column (`s_w`). A row's scale comes from that row's values
alone and the integer product is exact, so a row's result does not depend on the other rows of
the batch: padding, dead rows and other requests cannot change it. The quantization of an input
is shared by the products that read it (the q/k/v projections of one layer).

u8 activations with s8 weights is the fast integer path of ONNX Runtime's CPU GEMM on x86 (s8
activations run several times slower there). `MatMulIntegerToFloat` (ORT's contrib op, the one
ORT's own dynamic quantization fuses into) applies the per-column weight scale in the GEMM's
output stage. Its activation scale `s` may be a tensor (ONNX Runtime 1.18 and later): the kernel
then multiplies its output by `s`, broadcast, so the (..., 1) per-row scales need no node of their
own after the product. On a decoder step the tensors are small, so the cost is the number of
nodes: the rewrite uses as few as it can (6 per quantized activation, 1 per product).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

MS_DOMAIN = "com.microsoft"
ZERO_POINT = 128  # u8 activations are symmetric: x_q - 128 in [-127, 127]
MIN_OPSET = 18  # ReduceMax takes its axes as an input from opset 18
TINY = 1e-30  # an all-zero row gets this scale instead of 0 (its products are 0 either way)


@dataclass
class QuantizeReport:
    """What `quantize_rows` changed."""

    quantized: list[str] = field(default_factory=list)  # MatMul node names
    shared_inputs: int = 0  # distinct activations quantized
    skipped: list[str] = field(default_factory=list)  # excluded by name


def quantize_weight(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """W (K, N) float -> int8 (K, N) and per-column scales (N,), symmetric in [-127, 127]."""
    scale = np.maximum(np.abs(w).max(axis=0), TINY) / 127.0
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)


class _Builder:
    """Accumulates the rewritten node list and the new initializers."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.names = {n for node in graph.node for n in (*node.input, *node.output)}
        self.names |= {i.name for i in graph.initializer}
        self.initializers: list[onnx.TensorProto] = []
        self.nodes: list[onnx.NodeProto] = []

    def unique(self, base: str) -> str:
        name, i = base, 0
        while name in self.names:
            i += 1
            name = f"{base}_{i}"
        self.names.add(name)
        return name

    def const(self, base: str, value: np.ndarray) -> str:
        name = self.unique(base)
        self.initializers.append(numpy_helper.from_array(value, name))
        return name

    def node(self, op: str, inputs: list[str], base: str, **attrs: object) -> str:
        out = self.unique(base)
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))  # type: ignore[arg-type]
        return out


def quantize_rows(model: onnx.ModelProto, exclude: Collection[str] = ()) -> QuantizeReport:
    """Rewrite `model` in place: per-row int8 products for MatMuls with constant 2-D weights.

    `exclude`: MatMul node names to keep in float (e.g. the output projection).
    """
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < MIN_OPSET:
        raise ValueError(
            f"per-row int8 needs ONNX opset {MIN_OPSET} or newer, the graph has {opset}"
        )
    graph = model.graph
    weights = {i.name: i for i in graph.initializer}
    b = _Builder(graph)
    report = QuantizeReport()
    axis_last = b.const("rowq_axis_last", np.array([-1], dtype=np.int64))
    c127 = b.const("rowq_127", np.array(127.0, dtype=np.float32))
    tiny = b.const("rowq_tiny", np.array(TINY, dtype=np.float32))
    zero_point = b.const("rowq_zero_point", np.array(ZERO_POINT, dtype=np.uint8))
    one = b.const("rowq_one", np.array(1.0, dtype=np.float32))
    # activation name -> (quantized activation, its per-row scale (..., 1))
    quantized: dict[str, tuple[str, str]] = {}
    int8_weights: dict[str, tuple[str, str]] = {}  # weight -> (int8 weight, column scales)
    replaced: set[str] = set()
    for node in graph.node:
        weight = weights.get(node.input[1]) if node.op_type == "MatMul" else None
        if weight is None or len(weight.dims) != 2:
            b.nodes.append(node)
            continue
        if node.name in exclude:
            report.skipped.append(node.name)
            b.nodes.append(node)
            continue
        x = node.input[0]
        if x not in quantized:
            amax = b.node("ReduceMax", [b.node("Abs", [x], "rowq_abs"), axis_last], "rowq_amax")
            amax = b.node("Max", [amax, tiny], "rowq_amax_pos")  # (..., 1)
            scale = b.node("Div", [amax, c127], "rowq_scale")  # s, (..., 1)
            unit = b.node("Div", [x, scale], "rowq_unit")
            # round(x / s) + 128 with saturation: per-tensor QuantizeLinear with scale 1 works
            # at any rank, so no reshape to the 2-D view per-axis scales would need.
            quantized[x] = (b.node("QuantizeLinear", [unit, one, zero_point], "rowq_q"), scale)
            report.shared_inputs += 1
        x_q, scale = quantized[x]
        if weight.name not in int8_weights:  # a weight two products share is quantized once
            w_q, w_scale = quantize_weight(numpy_helper.to_array(weight))
            int8_weights[weight.name] = (
                b.const(weight.name + "_int8", w_q),
                b.const(weight.name + "_scale", w_scale),
            )
        w_q_name, w_scale_name = int8_weights[weight.name]
        b.nodes.append(
            helper.make_node(
                "MatMulIntegerToFloat",
                [x_q, w_q_name, scale, w_scale_name, zero_point],
                [node.output[0]],
                name=node.name or b.unique(node.output[0] + "_rowq"),
                domain=MS_DOMAIN,
            )
        )
        replaced.add(weight.name)
        report.quantized.append(node.name)
    still_read = {name for node in b.nodes for name in node.input}
    kept = [i for i in graph.initializer if i.name not in replaced or i.name in still_read]
    del graph.node[:]
    graph.node.extend(b.nodes)
    del graph.initializer[:]
    graph.initializer.extend([*kept, *b.initializers])
    if report.quantized and not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return report
