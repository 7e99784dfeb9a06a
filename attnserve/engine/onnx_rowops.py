"""Row operations on cache tensors that stay on the device (OrtValues), as tiny ONNX graphs.

With IO binding the KV cache lives where the provider computes (CUDA memory); numpy cannot index
it. Beam reordering and rows joining or leaving need a gather, a slice and a padded concat, so
these run as two small graphs on the same provider:

* select: ``Gather(x, rows, axis=0)`` then ``Slice(axis=2, start:)`` for n tensors at once;
* concat: ``Pad`` every tensor of k groups along axis 2 (left or right) and ``Concat`` on axis 0.

Shapes, pads and row indices come from the masks, which stay in host memory (they are tiny).
The same graphs run on the CPU provider, which is how the tests cover this path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from attnserve.engine.backend import IntArray

OPSET = 18
IR_VERSION = 9  # what opset 18 needs; onnx's default (newest) may be too new for ORT
INT64_MAX = np.iinfo(np.int64).max


def _tensor(name: str, elem_type: int, rank: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, [None] * rank)


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
    graph = helper.make_graph(nodes, "select_rows", inputs, outputs)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION
    )


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
    graph = helper.make_graph(nodes, "concat_rows", inputs, outputs)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION
    )


def time_pads(left: int, right: int) -> IntArray:
    """ONNX Pad amounts for (B, H, T, D): `left` columns before and `right` after on axis 2."""
    return np.array([0, 0, left, 0, 0, 0, right, 0], dtype=np.int64)


class DeviceRowOps:
    """Select and concat OrtValue tensors on one device, through cached tiny sessions."""

    def __init__(
        self,
        dtype: np.dtype[Any],
        providers: Sequence[Any],
        options: ort.SessionOptions,
        device: tuple[str, int],
    ) -> None:
        self.elem_type = helper.np_dtype_to_tensor_dtype(dtype)
        self.providers = list(providers)
        self.options = options
        self.device_type, self.device_id = device
        self._sessions: dict[tuple[str, int, int], ort.InferenceSession] = {}

    def _session(self, kind: str, k: int, n: int) -> ort.InferenceSession:
        key = (kind, k, n)
        if key not in self._sessions:
            model = (
                select_graph(n, self.elem_type)
                if kind == "select"
                else concat_graph(k, n, self.elem_type)
            )
            self._sessions[key] = ort.InferenceSession(
                model.SerializeToString(), self.options, providers=self.providers
            )
        return self._sessions[key]

    def _run(
        self,
        session: ort.InferenceSession,
        host: dict[str, IntArray],
        device: dict[str, Any],
        n: int,
    ) -> list[Any]:
        binding = session.io_binding()
        for name, array in host.items():
            binding.bind_cpu_input(name, array)
        for name, value in device.items():
            binding.bind_ortvalue_input(name, value)
        for j in range(n):
            binding.bind_output(f"y{j}", self.device_type, self.device_id)
        session.run_with_iobinding(binding)
        return list(binding.get_outputs())

    def select(self, tensors: Sequence[Any], rows: IntArray, start: int) -> list[Any]:
        """tensors[j][rows][:, :, start:] for every j, on the device."""
        n = len(tensors)
        host = {"rows": np.ascontiguousarray(rows, dtype=np.int64)}
        host["start"] = np.array([start], dtype=np.int64)
        device = {f"x{j}": t for j, t in enumerate(tensors)}
        return self._run(self._session("select", 1, n), host, device, n)

    def concat(self, groups: Sequence[Sequence[Any]], pads: Sequence[tuple[int, int]]) -> list[Any]:
        """Row-concatenation of the groups, group m padded by pads[m] = (left, right) on axis 2."""
        k, n = len(groups), len(groups[0])
        host = {f"pads{m}": time_pads(*pads[m]) for m in range(k)}
        device = {f"x{m}_{j}": t for m, group in enumerate(groups) for j, t in enumerate(group)}
        return self._run(self._session("concat", k, n), host, device, n)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any:
        """A zero-filled OrtValue on the device (the zero-length past of a new row)."""
        return ort.OrtValue.ortvalue_from_numpy(
            np.zeros(shape, dtype=dtype), self.device_type, self.device_id
        )
