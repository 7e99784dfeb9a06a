"""The graph queries and edits the rewrites share (private to attnserve.kernels)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from attnserve.kernels.ops import DOMAIN

if TYPE_CHECKING:
    import onnx


def _small_constant(initializers: dict[str, onnx.TensorProto], name: str) -> np.ndarray | None:
    """The value of initializer `name` stored in the graph, or None (not an initializer, or
    weights beside the graph: never a step, zero point or axes)."""
    import onnx
    from onnx import numpy_helper

    tensor = initializers.get(name)
    if tensor is None or tensor.data_location == onnx.TensorProto.EXTERNAL:
        return None
    return numpy_helper.to_array(tensor)


def _is_scalar(
    initializers: dict[str, onnx.TensorProto], name: str, value: float, dtype: str
) -> bool:
    """Whether initializer `name` is the one value `value` of numpy dtype `dtype`."""
    array = _small_constant(initializers, name)
    return (
        array is not None
        and array.size == 1
        and str(array.dtype) == dtype
        and float(array.reshape(())) == value
    )


def _drop_unread(graph: onnx.GraphProto, readers: dict[str, int]) -> None:
    """Remove the initializers that were read (`readers`, from before a rewrite) and no longer
    are."""
    _, still_read = _wiring(graph)
    for tensor in [i for i in graph.initializer if i.name in readers and i.name not in still_read]:
        graph.initializer.remove(tensor)


def _is(node: onnx.NodeProto, op: str) -> bool:
    """Whether `node` is the standard ONNX operator `op`."""
    return node.op_type == op and node.domain in ("", "ai.onnx")


def _wiring(graph: onnx.GraphProto) -> tuple[dict[str, onnx.NodeProto], dict[str, int]]:
    """Each value's producing node, and how many times each value is read (a graph output
    counts as a read)."""
    producers = {out: node for node in graph.node for out in node.output}
    readers: dict[str, int] = {}
    for name in [*(i for node in graph.node for i in node.input), *(o.name for o in graph.output)]:
        readers[name] = readers.get(name, 0) + 1
    return producers, readers


def _consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """The nodes reading each value, in graph order."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    return consumers


def _set_nodes(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    """Replace the graph's node list (protobuf repeated fields are not assigned)."""
    del graph.node[:]
    graph.node.extend(nodes)


def _node(op: str, inputs: list[str], outputs: list[str], name: str) -> onnx.NodeProto:
    """A node of one of attnserve's ops."""
    from onnx import helper

    return helper.make_node(op, inputs, outputs, name=f"{name}_{op}", domain=DOMAIN)
