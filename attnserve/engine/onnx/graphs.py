"""Tiny ONNX graphs that gather, slice, pad, concat and append cache tensors on a device."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from attnserve.defaults import IR_VERSION, OPSET

INT64_MAX = np.iinfo(np.int64).max


def _tensor(name: str, elem_type: int, rank: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, [None] * rank)


def _model(nodes: list[Any], name: str, inputs: list[Any], outputs: list[Any]) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION
    )


def select_graph(n: int, elem_type: int) -> onnx.ModelProto:
    """rows (R,), start (1,), x{j} (B, H, T, D) -> y{j} = x{j}[rows][:, :, start:]"""
    nodes = [
        helper.make_node("Constant", [], ["ends"], value_ints=[int(INT64_MAX)]),
        helper.make_node("Constant", [], ["axes"], value_ints=[2]),
    ]
    inputs = [_tensor("rows", TensorProto.INT64, 1), _tensor("start", TensorProto.INT64, 1)]
    outputs = []
    for j in range(n):
        inputs.append(_tensor(f"x{j}", elem_type, 4))
        outputs.append(_tensor(f"y{j}", elem_type, 4))
        nodes.append(helper.make_node("Gather", [f"x{j}", "rows"], [f"g{j}"], axis=0))
        nodes.append(helper.make_node("Slice", [f"g{j}", "start", "ends", "axes"], [f"y{j}"]))
    return _model(nodes, "select_rows", inputs, outputs)


def concat_graph(k: int, n: int, elem_type: int) -> onnx.ModelProto:
    """pads{m} (8,), x{m}_{j} (B_m, H, T_m, D) -> y{j} = concat_m(pad(x{m}_{j}, pads{m}))"""
    nodes = []
    inputs = [_tensor(f"pads{m}", TensorProto.INT64, 1) for m in range(k)]
    outputs = []
    for j in range(n):
        padded = []
        for m in range(k):
            inputs.append(_tensor(f"x{m}_{j}", elem_type, 4))
            nodes.append(helper.make_node("Pad", [f"x{m}_{j}", f"pads{m}"], [f"p{m}_{j}"]))
            padded.append(f"p{m}_{j}")
        nodes.append(helper.make_node("Concat", padded, [f"y{j}"], axis=0))
        outputs.append(_tensor(f"y{j}", elem_type, 4))
    return _model(nodes, "concat_rows", inputs, outputs)


def append_graph(n: int, elem_type: int) -> onnx.ModelProto:
    """x{j} (B, H, T, D), c{j} (B, H, T', D) -> y{j} = concat(x{j}, c{j}) on axis 2 (T' = 1 a
    decoding step, a prompt chunk's length a language model's prefill)"""
    nodes, inputs, outputs = [], [], []
    for j in range(n):
        inputs += [_tensor(f"x{j}", elem_type, 4), _tensor(f"c{j}", elem_type, 4)]
        nodes.append(helper.make_node("Concat", [f"x{j}", f"c{j}"], [f"y{j}"], axis=2))
        outputs.append(_tensor(f"y{j}", elem_type, 4))
    return _model(nodes, "append_column", inputs, outputs)
