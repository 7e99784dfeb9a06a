"""Per-row dynamic int8 quantization of an ONNX graph's matrix products with constant weights.

Every `MatMul` whose second input is a constant 2-D weight `W (K, N)` becomes

    m    = max(|x|, over K)                               one scale per row (token position)
    x_q  = QuantizeLinear(x / m, 1/127, 128)              round(127 x / m) + 128 as uint8
    y    = MatMulIntegerToFloat(x_q, W_q, m, s_w/127, 128)  (+ the bias Add, as before)

with `W_q` int8, symmetric per output column (`s_w`): the row's scale is m / 127, its 1/127
folded into the column scales. A row's scale comes from that row's values alone and the integer
product is exact, so a row's result does not depend on the other rows of the batch: padding,
dead rows and other requests cannot change it. An all-zero row has m = 0: its quantized values
are those of 0/0 (whatever the kernel makes of NaN), and its scale 0 makes its products exactly
0, as they should be. The quantization of an input is shared by the products that read it (the
q/k/v projections of one layer).

u8 activations with s8 weights is the fast integer path of ONNX Runtime's CPU GEMM on x86 (s8
activations run several times slower there); without VNNI that path adds byte pairs into saturating
int16, so the graph served is the kernels' rewrite (attnserve.kernels), whose stock bodies shift
the weight to uint8 and are exact everywhere (for the products it rewrites: all of an export's).
`MatMulIntegerToFloat` (ORT's contrib op, the one ORT's own dynamic quantization fuses into)
applies the per-column weight scale in the GEMM's output stage. Its activation scale `s` may be a
tensor (ONNX Runtime 1.18 and later): the kernel then multiplies its output by `s`, broadcast, so
the (..., 1) per-row scales need no node of their own after the product. On a decoder step the
tensors are small, so the cost is the number of nodes: the rewrite uses as few as it can (4 per
quantized activation: Abs, ReduceMax, Div and QuantizeLinear; 1 per product).

Token embeddings (`Gather` from a constant (V, C) table with `embedding_rows` = V rows) are
stored int8 with one scale per row (token), dequantized after the lookup: a row's values are its
own, so batch invariance holds. A table whose transpose is a quantized product's weight (tied
input and output embeddings) has the same int8 values: per-row scales of the table are
per-column scales of its transpose. In a graph of its own (a language model's step), a large one
is stored once, and the lookup reads the (C, V) weight along axis 1 (for a 256k x 1024
vocabulary: 1 GB of float32 down to 256 MB, shared with the output projection); a small one
(`SHARED_LOOKUP_BYTES`) is also stored as rows, because gathering columns costs a copy per value.
With embeddings shared between encoder and decoder, the decoder keeps rows
(`column_lookup_bytes=None`): they are the encoder's rows, stored once for both graphs
(`attnserve.export.variants.share_weights`).
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
TINY = 1e-30  # an all-zero weight column or table row gets this scale instead of 0
# A tied embedding (the output projection's transpose) of more int8 bytes than this is looked up
# in the projection's (C, V) weight, stored once; a smaller one gets its own (V, C) copy, as a
# gather of columns copies value by value (~1 ms a step at 128 rows of the default model).
SHARED_LOOKUP_BYTES = 64 << 20


@dataclass
class QuantizeReport:
    """What `quantize_rows` changed."""

    quantized: list[str] = field(default_factory=list)  # MatMul node names
    embeddings: list[str] = field(default_factory=list)  # Gather node names (int8 tables)
    tied: int = 0  # embeddings read from an output projection's int8 weight
    shared_inputs: int = 0  # distinct activations quantized
    skipped: list[str] = field(default_factory=list)  # excluded by name


def quantize_weight(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """W (K, N) float -> int8 (K, N) and per-column scales (N,), symmetric in [-127, 127]."""
    scale = row_scales(w.T)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale


def row_scales(table: np.ndarray) -> np.ndarray:
    """Symmetric int8 scales of a (R, C) table's rows: max |row| / 127, float32 (R,)."""
    return (np.maximum(np.abs(table).max(axis=1), TINY) / 127.0).astype(np.float32)


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


def quantize_rows(
    model: onnx.ModelProto,
    exclude: Collection[str] = (),
    embedding_rows: int | None = None,
    column_lookup_bytes: int | None = SHARED_LOOKUP_BYTES,
) -> QuantizeReport:
    """Rewrite `model` in place: per-row int8 products for MatMuls with constant 2-D weights,
    and int8 token embeddings (Gathers from constant tables of `embedding_rows` rows).

    `exclude`: MatMul and Gather node names to keep in float (e.g. the output projection).
    `column_lookup_bytes`: a table tied to a quantized product and larger than this is looked
    up in that product's weight instead of its own rows (None: never).
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
    step = b.const("rowq_step", np.array(1.0 / 127.0, dtype=np.float32))
    zero_point = b.const("rowq_zero_point", np.array(ZERO_POINT, dtype=np.uint8))
    # activation name -> (quantized activation, its per-row scale (..., 1))
    quantized: dict[str, tuple[str, str]] = {}
    int8_weights: dict[str, tuple[str, str]] = {}  # weight -> (int8 weight, column scales)
    replaced: set[str] = set()
    tables = _embedding_tables(graph, weights, embedding_rows, exclude)
    for node in graph.node:
        if node.name in tables:
            _quantize_gather(b, node, tables[node.name], int8_weights, report, column_lookup_bytes)
            replaced.add(node.input[0])
            continue
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
            unit = b.node("Div", [x, amax], "rowq_unit")  # (..., K) in [-1, 1]
            # round(127 x / m) + 128 with saturation: a per-tensor QuantizeLinear works at any
            # rank, so no reshape to the 2-D view per-axis scales would need.
            quantized[x] = (b.node("QuantizeLinear", [unit, step, zero_point], "rowq_q"), amax)
            report.shared_inputs += 1
        x_q, scale = quantized[x]
        w_q_name, w_scale_name = _int8_weight(b, weight, int8_weights)
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


def _int8_weight(
    b: _Builder, weight: onnx.TensorProto, done: dict[str, tuple[str, str]]
) -> tuple[str, str]:
    """The int8 weight of `weight` and its products' column scales s_w / 127 (a product's row
    scale is max |x|, its 1/127 folded in here), made once however many nodes read it."""
    if weight.name not in done:
        w_q, w_scale = quantize_weight(numpy_helper.to_array(weight))
        done[weight.name] = (
            b.const(weight.name + "_int8", w_q),
            b.const(weight.name + "_scale", w_scale / np.float32(127.0)),
        )
    return done[weight.name]


@dataclass
class _Table:
    """A token embedding to store int8: its float table, and the product weight it is tied to."""

    table: onnx.TensorProto
    tied: onnx.TensorProto | None


def lookup_table(
    node: onnx.NodeProto, weights: dict[str, onnx.TensorProto], rows: int
) -> onnx.TensorProto | None:
    """The constant float (rows, C) table `node` looks rows up in (a Gather along axis 0), if
    it is such a lookup: a token embedding when `rows` is the vocabulary size."""
    table = weights.get(node.input[0]) if node.op_type == "Gather" else None
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    if (
        table is None
        or axis != 0
        or len(table.dims) != 2
        or table.dims[0] != rows
        or table.data_type != onnx.TensorProto.FLOAT
    ):
        return None
    return table


def _embedding_tables(
    graph: onnx.GraphProto,
    weights: dict[str, onnx.TensorProto],
    rows: int | None,
    exclude: Collection[str],
) -> dict[str, _Table]:
    """Gather node name -> its table, for lookups in constant float (rows, C) tables."""
    if rows is None:
        return {}
    found: dict[str, _Table] = {}
    arrays: dict[str, np.ndarray] = {}  # float tables, loaded once
    for node in graph.node:
        table = lookup_table(node, weights, rows)
        if table is None or node.name in exclude:
            continue
        if table.name not in arrays:
            arrays[table.name] = numpy_helper.to_array(table)
        tied = _tied_weight(graph, weights, arrays[table.name], exclude)
        found[node.name] = _Table(table, tied)
    return found


def _tied_weight(
    graph: onnx.GraphProto,
    weights: dict[str, onnx.TensorProto],
    table: np.ndarray,
    exclude: Collection[str],
) -> onnx.TensorProto | None:
    """The quantized MatMul's weight equal to `table` transposed (a tied output projection)."""
    shape = [table.shape[1], table.shape[0]]
    for node in graph.node:
        product = node.op_type == "MatMul" and node.name not in exclude
        weight = weights.get(node.input[1]) if product else None
        if (
            weight is not None
            and list(weight.dims) == shape
            and weight.data_type == onnx.TensorProto.FLOAT
            and np.array_equal(numpy_helper.to_array(weight), table.T)
        ):
            return weight
    return None


def _quantize_gather(
    b: _Builder,
    node: onnx.NodeProto,
    found: _Table,
    int8_weights: dict[str, tuple[str, str]],
    report: QuantizeReport,
    column_lookup_bytes: int | None,
) -> None:
    """Replace the lookup `node` by an int8 lookup times its rows' scales:
    y = Cast(Gather(T_q, ids)) * Gather(s, ids)."""
    ids = node.input[1]
    table = numpy_helper.to_array(found.table)
    scales = b.const(found.table.name + "_row_scale", row_scales(table).reshape(-1, 1))
    if (
        found.tied is not None
        and column_lookup_bytes is not None
        and table.size > column_lookup_bytes
    ):
        # The product's (C, V) int8 weight holds the same values: gather its columns (C, n),
        # transpose to rows and give them the ids' shape.
        w_q, _ = _int8_weight(b, found.tied, int8_weights)
        flat = b.node("Reshape", [ids, b.const("emb_flat", np.array([-1], np.int64))], "emb_ids")
        columns = b.node("Gather", [w_q, flat], "emb_q_columns", axis=1)
        rows_q = b.node("Transpose", [columns], "emb_q_rows", perm=[1, 0])
        channels = b.const("emb_channels", np.array([table.shape[1]], np.int64))
        shape = b.node("Shape", [ids], "emb_ids_shape")
        shape = b.node("Concat", [shape, channels], "emb_shape", axis=0)
        looked_up = b.node("Reshape", [rows_q, shape], "emb_q")
        report.tied += 1
    else:
        q, _ = quantize_weight(table.T)
        table_q = b.const(found.table.name + "_int8", np.ascontiguousarray(q.T))
        looked_up = b.node("Gather", [table_q, ids], "emb_q")
    row_scale = b.node("Gather", [scales, ids], "emb_scale")  # (..., 1)
    as_float = b.node("Cast", [looked_up], "emb_float", to=onnx.TensorProto.FLOAT)
    b.nodes.append(helper.make_node("Mul", [as_float, row_scale], [node.output[0]], name=node.name))
    report.embeddings.append(node.name)
