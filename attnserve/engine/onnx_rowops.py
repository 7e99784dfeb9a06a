"""Row and column operations on the ONNX backend's cache tensors, on the host or on the device.

The self-attention cache of every layer is a `(B, H, T, D)` tensor whose first `length` columns
are in use (left-padded, as `KVCache`); the decoder graph returns only the new column of every
step (`new.{i}.self.*`, `(B, H, 1, D)`), which `append` writes after them. Cross-attention K/V
are `(N, H, S, D)` per encoded source; `slot_index` tells the graph which rows share a source.

* `HostRowOps` (numpy, the CPU path): cache tensors keep `SPARE` free columns, so appending
  writes one column in place and beam reordering (`take_rows`) copies each row once. A
  `Columns` object shared by the states that share tensors records how many columns are
  written: a state appends in place only if nobody appended after it (copy on write). Their
  memory comes from a `BufferPool`.
* `DeviceRowOps` (IO binding, CUDA): tensors are OrtValues on the device, exactly `length`
  columns wide; gather / slice / pad / concat / append run as tiny ONNX graphs on the provider.
  The same graphs run on the CPU provider, which is how the tests cover this path.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from attnserve.engine.backend import IntArray

OPSET = 18
IR_VERSION = 9  # what opset 18 needs; onnx's default (newest) may be too new for ORT
INT64_MAX = np.iinfo(np.int64).max
# Free columns a host cache tensor gets when it is (re)allocated; left padding no row uses is
# trimmed once it is this wide.
SPARE = 8
# A cache tensor: a numpy array (host path) or an onnxruntime.OrtValue (IO binding path).
Tensor = Any


@dataclass
class Columns:
    """How many columns of a group of shared cache tensors hold data (copy-on-write marker)."""

    written: int


def slot_index(row_source: IntArray, n_sources: int) -> tuple[IntArray, IntArray]:
    """Query slots of grouped cross-attention: rows of source s fill slots s*G .. s*G+G-1.

    row_source (B,) -> row_slots (B,) and slot_rows (N * G,) int64, G = the most rows of one
    source; unused slots repeat row 0 (their output is never read).
    """
    rows = row_source.shape[0]
    counts = np.bincount(row_source, minlength=n_sources)
    group = max(int(counts.max(initial=1)), 1)
    order = np.argsort(row_source, kind="stable")
    first = np.cumsum(counts) - counts  # where each source's rows start in `order`
    rank = np.empty(rows, dtype=np.int64)
    rank[order] = np.arange(rows) - first[row_source[order]]
    row_slots = (row_source * group + rank).astype(np.int64)
    slot_rows = np.zeros(n_sources * group, dtype=np.int64)
    slot_rows[row_slots] = np.arange(rows, dtype=np.int64)
    return row_slots, slot_rows


def first_used_column(mask: IntArray) -> int:
    """First past column that some row uses (the left padding shared by all rows ends)."""
    if mask.shape[0] == 0 or mask.shape[1] == 0:
        return 0
    used = mask.any(axis=0)
    return int(used.argmax()) if used.any() else int(mask.shape[1])


class BufferPool:
    """Hands out numpy arrays again once no state holds them, with rows to spare.

    A fresh array of a few MB is mapped memory whose pages fault and are zeroed by the kernel on
    first touch: on the benchmark machine that took 5x as long as the copy into it, every beam
    step. So arrays are views of pooled flat buffers, reused for any shape that fits (a cache
    one column wider, a batch a few rows smaller). A buffer is free when the pool holds its only
    reference (CPython reference counts; a view keeps its buffer alive). Buffers are allocated
    with room to spare, so rows that join a running batch go into the rows after a view
    (`extend`) instead of a copy of the whole batch. A request takes the smallest free buffer
    that holds it and is at most REUSE times its size. After every request the largest free
    buffers are dropped until the free ones weigh no more than the recent high-water mark of
    those in use: about one spare generation of the cache, given back after a peak.
    """

    # References to a free buffer while `_free` counts them: the list's and getrefcount's.
    FREE = 2
    ROWS = 16  # allocations round their rows up to a multiple of this
    # Columns grow too (a cache gains one a step): buffers get twice the room the rows need, so
    # that a cache outgrowing its buffer often finds the one before it free and big enough
    # (pages never touched cost no memory). At 5/4 every growth faulted fresh pages in: beam 4 /
    # batch 32 spent 2x as long in np.zeros and 1.3x as long resizing.
    ROOM = 2
    # A free buffer serves requests down to 1/REUSE of its size: a batch that lost rows keeps
    # its buffers, but a small request does not pin a large buffer (memory after a peak).
    REUSE = 16
    # Free buffers are kept up to the recent high-water mark of the bytes in use, which decays
    # by this factor a request (halved in ~140): a batch that ends and a next one that grows
    # back reuse the same memory (trimming to the bytes in use at once faulted it in again:
    # np.zeros 0.015 -> 0.235 s for 384 sentences; with this decay 0.039 s), and after a peak
    # the memory is given back under a lighter load.
    HIGH_DECAY = 0.995

    def __init__(self) -> None:
        self._buffers: list[np.ndarray] = []  # flat
        self._claimed: list[int] = []  # elements of each buffer the last view handed out holds
        self._high = 0.0  # decaying high-water mark of the bytes in use

    @classmethod
    def capacity(cls, rows: int) -> int:
        """Rows allocated for a request of `rows`: a quarter and ROWS more, rounded up."""
        return -(-(rows + rows // 4 + cls.ROWS) // cls.ROWS) * cls.ROWS

    def _free(self, i: int) -> bool:
        return sys.getrefcount(self._buffers[i]) <= self.FREE

    def get(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """An array of this shape and dtype, with finite but arbitrary contents."""
        need = int(np.prod(shape))
        best = -1
        for i in range(len(self._buffers)):  # no loop variable: it would hold a reference
            size = self._buffers[i].size
            if (
                self._buffers[i].dtype == dtype
                and need <= size <= self.REUSE * need + 1024
                and (best < 0 or size < self._buffers[best].size)
                and self._free(i)
            ):
                best = i
        if best >= 0:
            self._claimed[best] = need
            view = self._buffers[best][:need].reshape(shape)
        else:
            row = int(np.prod(shape[1:]))
            size = self.capacity(shape[0]) * row * self.ROOM
            self._buffers.append(np.zeros(size, dtype=dtype))
            self._claimed.append(need)
            view = self._buffers[-1][:need].reshape(shape)
        self._trim()
        return view

    def _trim(self) -> None:
        """Drop the largest free buffers while the free ones outweigh the recent high-water mark
        of those in use (it decays by HIGH_DECAY a request)."""
        free = [i for i in range(len(self._buffers)) if self._free(i)]
        free_bytes = sum(self._buffers[i].nbytes for i in free)
        busy_bytes = sum(b.nbytes for b in self._buffers) - free_bytes
        self._high = max(float(busy_bytes), self._high * self.HIGH_DECAY)
        dropped = set()
        for i in sorted(free, key=lambda i: -self._buffers[i].nbytes):
            if free_bytes <= self._high:
                break
            dropped.add(i)
            free_bytes -= self._buffers[i].nbytes
        if dropped:
            self._buffers = [b for i, b in enumerate(self._buffers) if i not in dropped]
            self._claimed = [c for i, c in enumerate(self._claimed) if i not in dropped]

    def _index(self, view: np.ndarray) -> int | None:
        """The buffer whose first elements `view` is, if any."""
        for i, buffer in enumerate(self._buffers):
            if view.base is buffer:
                whole = view.ctypes.data == buffer.ctypes.data and view.flags.c_contiguous
                return i if whole else None
        return None

    def room(self, view: np.ndarray, rows: int) -> bool:
        """Whether `view` can grow by `rows` rows in place: its buffer has them, and no other
        view grew into them (the last one handed out of this buffer was `view`)."""
        i = self._index(view)
        grown = (view.shape[0] + rows) * (view.size // max(view.shape[0], 1))
        return (
            i is not None
            and view.shape[0] > 0
            and self._claimed[i] == view.size
            and self._buffers[i].size >= grown
        )

    def extend(self, view: np.ndarray, rows: int) -> np.ndarray:
        """`view` and `rows` more rows after it in its buffer (check `room` first)."""
        i = self._index(view)
        assert i is not None
        shape = (view.shape[0] + rows, *view.shape[1:])
        need = int(np.prod(shape))
        self._claimed[i] = need
        return self._buffers[i][:need].reshape(shape)


class HostRowOps:
    """numpy tensors with spare columns: in-place appends, one copy per reorder."""

    spare = SPARE

    def __init__(self) -> None:
        self.pool = BufferPool()

    def select(self, tensors: Sequence[Tensor], rows: IntArray, start: int) -> list[Tensor]:
        """tensors[j][rows][:, :, start:] (all columns), one contiguous copy each."""
        return [t[rows, :, start:] for t in tensors]

    def reorder(self, tensors: Sequence[Tensor], rows: IntArray, length: int) -> list[Tensor]:
        """In place: row i of every tensor becomes row rows[i] (first `length` columns), for
        the rows where they differ. Only for tensors no other state reads."""
        changed = np.flatnonzero(rows != np.arange(rows.shape[0]))
        if not changed.size:
            return list(tensors)
        source = rows[changed]
        # A row copied from a row that is itself overwritten needs the old contents: those go
        # through numpy's gather (a temporary copy), before anything is written. The others
        # (most, once beams stay in their parents' rows) are copied directly, row by row.
        aliased = np.isin(source, changed)
        if aliased.any():
            for t in tensors:
                t[changed[aliased], :, :length] = t[source[aliased], :, :length]
        for row, parent in zip(changed[~aliased].tolist(), source[~aliased].tolist(), strict=True):
            for t in tensors:
                t[row, :, :length] = t[parent, :, :length]
        return list(tensors)

    def take_rows(self, tensors: Sequence[Tensor], rows: IntArray) -> list[Tensor]:
        """tensors[j][rows], whole rows (spare columns included): a single copy each."""
        out = []
        for t in tensors:
            y = self.pool.get((rows.shape[0], *t.shape[1:]), t.dtype)
            out.append(np.take(t, rows, axis=0, out=y, mode="clip"))
        return out

    def resize(
        self,
        tensors: Sequence[Tensor],
        rows: IntArray | None,
        start: int,
        length: int,
        width: int,
    ) -> list[Tensor]:
        """tensors[j][rows][:, :, start:length] (rows None: all) in new (R, H, width, D) tensors;
        the columns after `length - start` hold finite leftovers (they are masked)."""
        out = []
        for t in tensors:
            n = t.shape[0] if rows is None else rows.shape[0]
            y = self.pool.get((n, t.shape[1], width, t.shape[3]), t.dtype)
            y[:, :, : length - start] = (
                t[:, :, start:length] if rows is None else t[rows, :, start:length]
            )
            out.append(y)
        return out

    def concat(
        self,
        groups: Sequence[Sequence[Tensor]],
        pads: Sequence[tuple[int, int]],
        widths: Sequence[int] | None = None,
    ) -> list[Tensor]:
        """Row-concatenation, group m's first widths[m] columns (default: all) padded by pads[m]
        = (left, right) columns on axis 2."""
        out = []
        for j in range(len(groups[0])):
            parts = [g[j] for g in groups]
            used = widths or [p.shape[2] for p in parts]
            _, h, _, d = parts[0].shape
            width = pads[0][0] + used[0] + pads[0][1]
            y = self.pool.get((sum(p.shape[0] for p in parts), h, width, d), parts[0].dtype)
            row = 0
            for part, (left, _), n in zip(parts, pads, used, strict=True):
                y[row : row + part.shape[0], :, left : left + n] = part[:, :, :n]
                row += part.shape[0]
            out.append(y)
        return out

    def room(self, tensors: Sequence[Tensor], rows: int) -> bool:
        """Whether `extend` can add `rows` rows to every tensor in place."""
        return all(self.pool.room(t, rows) for t in tensors)

    def extend(
        self, tensors: Sequence[Tensor], rows: int, new: Sequence[Tensor] | None = None
    ) -> list[Tensor]:
        """The tensors with `rows` more rows, in place (check `room` first): new[j] (rows, H,
        S', D), when given, is written into the first S' columns of the new rows; the other
        columns keep finite leftovers (the caller's masks hide them)."""
        out = []
        for j, t in enumerate(tensors):
            grown = self.pool.extend(t, rows)
            if new is not None:
                grown[t.shape[0] :, :, : new[j].shape[2]] = new[j]
            out.append(grown)
        return out

    def append(
        self, tensors: Sequence[Tensor], new: Sequence[Tensor], length: int, columns: Columns
    ) -> tuple[list[Tensor], Columns]:
        """Write new[j] (B, H, 1, D) at column `length`: in place when there is room and no
        other state wrote there, else into copies with SPARE more columns."""
        width = tensors[0].shape[2]
        if length < width and columns.written == length:
            for t, n in zip(tensors, new, strict=True):
                t[:, :, length] = n[:, :, 0]
            columns.written = length + 1
            return list(tensors), columns
        grown = self.resize(tensors, None, 0, length, length + 1 + self.spare)
        for t, n in zip(grown, new, strict=True):
            t[:, :, length] = n[:, :, 0]
        return grown, Columns(length + 1)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Tensor:
        """Zeros (B, H, SPARE, D): a new row's cache, all columns free."""
        b, h, _, d = shape
        return np.zeros((b, h, self.spare, d), dtype=dtype)


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
    """x{j} (B, H, T, D), c{j} (B, H, 1, D) -> y{j} = concat(x{j}, c{j}) on axis 2"""
    nodes, inputs, outputs = [], [], []
    for j in range(n):
        inputs += [_tensor(f"x{j}", elem_type, 4), _tensor(f"c{j}", elem_type, 4)]
        nodes.append(helper.make_node("Concat", [f"x{j}", f"c{j}"], [f"y{j}"], axis=2))
        outputs.append(_tensor(f"y{j}", elem_type, 4))
    return _model(nodes, "append_column", inputs, outputs)


def _rows(value: Any) -> int:
    """Rows of a numpy array or an OrtValue."""
    shape = value.shape if isinstance(value, np.ndarray) else value.shape()
    return int(shape[0])


def time_pads(left: int, right: int) -> IntArray:
    """ONNX Pad amounts for (B, H, T, D): `left` columns before and `right` after on axis 2."""
    return np.array([0, 0, left, 0, 0, 0, right, 0], dtype=np.int64)


class DeviceRowOps:
    """Select, concat and append OrtValue tensors on one device, through cached tiny sessions.

    Tensors are exactly `length` columns wide (no spare columns: a device copy is cheap, and
    ONNX Runtime cannot write into an input in place).
    """

    spare = 0

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
            if kind == "select":
                model = select_graph(n, self.elem_type)
            elif kind == "append":
                model = append_graph(n, self.elem_type)
            else:
                model = concat_graph(k, n, self.elem_type)
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

    def take_rows(self, tensors: Sequence[Any], rows: IntArray) -> list[Any]:
        return self.select(tensors, rows, 0)

    def resize(
        self,
        tensors: Sequence[Any],
        rows: IntArray | None,
        start: int,
        length: int,
        width: int,
    ) -> list[Any]:
        """tensors[j][rows][:, :, start:length] (device tensors are `length` wide already)."""
        if rows is None:
            rows = np.arange(_rows(tensors[0]), dtype=np.int64)
        return self.select(tensors, rows, start)

    def concat(
        self,
        groups: Sequence[Sequence[Any]],
        pads: Sequence[tuple[int, int]],
        widths: Sequence[int] | None = None,
    ) -> list[Any]:
        """Row-concatenation of the groups, group m padded by pads[m] = (left, right) on axis 2."""
        k, n = len(groups), len(groups[0])
        host = {f"pads{m}": time_pads(*pads[m]) for m in range(k)}
        device = {f"x{m}_{j}": t for m, group in enumerate(groups) for j, t in enumerate(group)}
        return self._run(self._session("concat", k, n), host, device, n)

    def append(
        self, tensors: Sequence[Any], new: Sequence[Any], length: int, columns: Columns
    ) -> tuple[list[Any], Columns]:
        """concat(tensors[j], new[j]) on axis 2, on the device."""
        n = len(tensors)
        device = {f"x{j}": t for j, t in enumerate(tensors)}
        device.update({f"c{j}": c for j, c in enumerate(new)})
        return self._run(self._session("append", 1, n), {}, device, n), Columns(length + 1)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any:
        """A zero-filled OrtValue on the device (the zero-length past of a new row)."""
        return ort.OrtValue.ortvalue_from_numpy(
            np.zeros(shape, dtype=dtype), self.device_type, self.device_id
        )
