"""Graph rewrites of per-row int8's nodes as the export writes them (attnserve.export.quantize)
onto RowQuantize, QMatMul[Bias], PackedQMatMul[Bias] and RowQMatMul, bit for bit the same
values, each adding the ops' functions to the model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnserve.kernels.functions import declare
from attnserve.kernels.graph import (
    _consumers,
    _drop_unread,
    _is,
    _is_scalar,
    _node,
    _set_nodes,
    _small_constant,
    _wiring,
)
from attnserve.kernels.ops import (
    DOMAIN,
    MS_DOMAIN,
    PACKED_QMATMUL,
    PACKED_QMATMUL_BIAS,
    PANEL,
    QMATMUL,
    QMATMUL_BIAS,
    ROW_QMATMUL,
    ROW_QUANTIZE,
    ROW_STEP32,
    ROW_ZERO_POINT,
)
from attnserve.kernels.packing import pack_weight

if TYPE_CHECKING:
    import onnx


def use_row_quantize_kernel(model: onnx.ModelProto) -> int:
    """Rewrite `model` in place: each per-row int8 activation quantization as the export writes it
    (Abs, ReduceMax over the last axis, Div, QuantizeLinear by 1/127 around 128; see
    attnserve.export.quantize) becomes one RowQuantize node, bit for bit the same values.
    Returns how many were rewritten."""
    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    producers, readers = _wiring(graph)

    def constant(name: str, value: float, dtype: str) -> bool:
        return _is_scalar(initializers, name, value, dtype)

    dropped: set[int] = set()
    replaced: dict[int, onnx.NodeProto] = {}
    for node in graph.node:
        if not _is(node, "QuantizeLinear"):
            continue
        if len(node.input) != 3 or not constant(node.input[1], ROW_STEP32, "float32"):
            continue
        if not constant(node.input[2], ROW_ZERO_POINT, "uint8") or node.attribute:
            continue
        div = producers.get(node.input[0])
        if div is None or not _is(div, "Div") or readers.get(div.output[0]) != 1:
            continue
        x, scale = div.input
        reduce = producers.get(scale)
        if reduce is None or not _is(reduce, "ReduceMax") or len(reduce.input) != 2:
            continue
        keep = {a.name: a.i for a in reduce.attribute}
        axes = _small_constant(initializers, reduce.input[1])
        if keep.get("keepdims", 1) != 1 or axes is None or axes.tolist() != [-1]:
            continue
        magnitude = producers.get(reduce.input[0])
        if magnitude is None or not _is(magnitude, "Abs") or magnitude.input[0] != x:
            continue
        if readers.get(magnitude.output[0]) != 1:
            continue
        fused = _node(ROW_QUANTIZE, [x], [node.output[0], scale], node.name or scale)
        replaced[id(node)] = fused
        dropped.update((id(div), id(reduce), id(magnitude)))
    if not replaced:
        return 0
    _set_nodes(graph, [replaced.get(id(n), n) for n in graph.node if id(n) not in dropped])
    _drop_unread(graph, readers)  # the quantization's step, zero point and axes
    declare(model)
    return len(replaced)


def use_row_qmatmul_kernel(model: onnx.ModelProto) -> int:
    """Rewrite `model` in place: a PackedQMatMul whose quantized rows and scales come from a
    RowQuantize that nothing else reads becomes one RowQMatMul of the float rows (the same bytes,
    the same product); returns how many."""
    graph = model.graph
    producers, readers = _wiring(graph)
    replaced: dict[int, onnx.NodeProto | None] = {}
    for node in graph.node:
        if node.domain != DOMAIN or node.op_type != PACKED_QMATMUL:
            continue
        q, packed, scale, w_scale = node.input
        source = producers.get(q)
        if (
            source is None
            or source.domain != DOMAIN
            or source.op_type != ROW_QUANTIZE
            or list(source.output) != [q, scale]
            or readers.get(q) != 1
            or readers.get(scale) != 1
        ):
            continue
        replaced[id(source)] = None
        replaced[id(node)] = _node(ROW_QMATMUL, [source.input[0], packed, w_scale],
                                   list(node.output), node.name)  # fmt: skip
    if not replaced:
        return 0
    nodes = [replaced.get(id(n), n) for n in graph.node]
    _set_nodes(graph, [n for n in nodes if n is not None])
    declare(model)
    return len(replaced) // 2


def use_qmatmul_kernel(model: onnx.ModelProto) -> int:
    """Rewrite `model` in place: each per-row int8 product as the export writes it
    (MatMulIntegerToFloat of uint8 rows around 128, an int8 (K, N) weight, the rows' scales and
    the columns' scales; see attnserve.export.quantize) becomes a QMatMul node, or a QMatMulBias
    node with the Add of a constant (N,) bias that is the product's only reader. Bit for bit the
    same values. A weight stored in the graph file, read by this product only, with K a
    multiple of 4 and N of 64, is stored packed instead (PackedQMatMul[Bias]: the kernel reads
    it where it is, where a (K, N) weight gets a packed copy in memory). Returns how many
    products were rewritten."""
    import onnx
    from onnx import numpy_helper

    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    inputs = {i.name for i in graph.input}  # initializers a caller may override stay as they are
    producers, readers = _wiring(graph)
    consumers = _consumers(graph)

    def shaped(name: str, dtype: int, dims: list[int] | None = None) -> onnx.TensorProto | None:
        tensor = initializers.get(name)
        if tensor is None or tensor.data_type != dtype:
            return None
        return tensor if dims is None or list(tensor.dims) == dims else None

    def packable(weight: onnx.TensorProto) -> bool:
        k, n = weight.dims
        return (
            weight.data_location != onnx.TensorProto.EXTERNAL
            and weight.name not in inputs
            and readers.get(weight.name) == 1
            and k % 4 == 0
            and n % PANEL == 0
        )

    dropped: set[int] = set()
    replaced: dict[int, onnx.NodeProto] = {}
    packed: dict[str, onnx.TensorProto] = {}  # weight name -> its packed initializer
    for node in graph.node:
        if node.op_type != "MatMulIntegerToFloat" or node.domain != MS_DOMAIN:
            continue
        if len(node.input) != 5 or node.attribute:
            continue
        if not _is_scalar(initializers, node.input[4], ROW_ZERO_POINT, "uint8"):
            continue
        q, w, scale, w_scale, _ = node.input
        weight = shaped(w, onnx.TensorProto.INT8)
        if weight is None or len(weight.dims) != 2 or w in inputs:
            continue
        source = producers.get(scale)  # one scale per row: the per-row quantization's
        if source is None or (source.op_type, source.domain) not in (
            (ROW_QUANTIZE, DOMAIN),
            ("ReduceMax", ""),
        ):
            continue
        columns = int(weight.dims[1])
        if shaped(w_scale, onnx.TensorProto.FLOAT, [columns]) is None:
            continue
        in_place = packable(weight)
        if in_place:
            packed[w] = numpy_helper.from_array(
                pack_weight(numpy_helper.to_array(weight)), f"{w}_packed"
            )
            w = packed[w].name
        product = node.output[0]
        add = consumers.get(product, [None])[0] if readers.get(product) == 1 else None
        bias = None
        if add is not None and _is(add, "Add") and len(add.input) == 2:
            other = add.input[1] if add.input[0] == product else add.input[0]
            if shaped(other, onnx.TensorProto.FLOAT, [columns]) is not None:
                bias = other
        if bias is not None:
            assert add is not None
            op = PACKED_QMATMUL_BIAS if in_place else QMATMUL_BIAS
            fused = _node(op, [q, w, scale, w_scale, bias], [add.output[0]], product)
            dropped.add(id(add))
        else:
            op = PACKED_QMATMUL if in_place else QMATMUL
            fused = _node(op, [q, w, scale, w_scale], [product], product)
        replaced[id(node)] = fused
    if not replaced:
        return 0
    _set_nodes(graph, [replaced.get(id(n), n) for n in graph.node if id(n) not in dropped])
    graph.initializer.extend(packed.values())
    _drop_unread(graph, readers)  # the zero point and the packed weights' (K, N) copies
    declare(model)
    return len(replaced)
