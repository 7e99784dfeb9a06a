"""Row and column operations on the ONNX backend's cache tensors, on the host or on the device.

The self-attention cache of every layer is a `(B, H, T, D)` tensor whose first `length` columns
are in use (left-padded, as `KVCache`); the decoder graph returns only the new column of every
step (`new.{i}.self.*`, `(B, H, 1, D)`; a language model's prompt chunk: its T columns), which
`append` writes after them. Cross-attention K/V
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

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import helper

from attnserve.engine.backend import IntArray
from attnserve.engine.onnx.buffers import BufferPool
from attnserve.engine.onnx.graphs import append_graph, concat_graph, select_graph

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


class HostRowOps:
    """numpy tensors with spare columns: in-place appends, one copy per reorder."""

    def __init__(self, spare: int = SPARE, pool: BufferPool | None = None) -> None:
        self.spare = spare
        self.pool = pool if pool is not None else BufferPool()

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
        shapes = {(t.shape[1:], t.dtype) for t in tensors}
        if len(shapes) == 1:  # a language model's layers: one pass over the pool for all
            ((shape, dtype),) = shapes
            ys = self.pool.get_many((rows.shape[0], *shape), dtype, len(tensors))
        else:
            ys = [self.pool.get((rows.shape[0], *t.shape[1:]), t.dtype) for t in tensors]
        return [
            np.take(t, rows, axis=0, out=y, mode="clip") for t, y in zip(tensors, ys, strict=True)
        ]

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
        """Write new[j] (B, H, T, D) at columns `length`.. (T = 1 for a decoding step, a
        prompt chunk's length for a language model's prefill): in place when there is room and
        no other state wrote there, else into copies with SPARE more columns."""
        width, t_new = tensors[0].shape[2], new[0].shape[2]
        end = length + t_new
        if end <= width and columns.written == length:
            for t, n in zip(tensors, new, strict=True):
                t[:, :, length:end] = n
            columns.written = end
            return list(tensors), columns
        grown = self.resize(tensors, None, 0, length, end + self.spare)
        for t, n in zip(grown, new, strict=True):
            t[:, :, length:end] = n
        return grown, Columns(end)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Tensor:
        """Zeros (B, H, SPARE, D): a new row's cache, all columns free."""
        b, h, _, d = shape
        return np.zeros((b, h, self.spare, d), dtype=dtype)


def _shape(value: Any) -> tuple[int, ...]:
    """The shape of a numpy array (.shape) or an OrtValue (.shape())."""
    return tuple(value.shape if isinstance(value, np.ndarray) else value.shape())


def _rows(value: Any) -> int:
    return int(_shape(value)[0])


def width_of(value: Any) -> int:
    """Columns (axis 2) of a cache tensor: a numpy array or an OrtValue."""
    return int(_shape(value)[2])


def run_bound(
    session: ort.InferenceSession,
    host: dict[str, IntArray],
    device: dict[str, Any],
    outputs: Sequence[str],
    place: tuple[str, int],
    on_host: Collection[str] = (),
) -> list[Any]:
    """Run a session with IO binding: numpy inputs from the host, OrtValue inputs where they
    are; outputs stay on the device `place` as OrtValues, except `on_host` ones (numpy)."""
    binding = session.io_binding()
    for name, array in host.items():
        binding.bind_cpu_input(name, array)
    for name, value in device.items():
        binding.bind_ortvalue_input(name, value)
    for name in outputs:
        if name in on_host:
            binding.bind_output(name, "cpu")
        else:
            binding.bind_output(name, *place)
    session.run_with_iobinding(binding)
    values = binding.get_outputs()
    return [v.numpy() if n in on_host else v for n, v in zip(outputs, values, strict=True)]


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
        outputs = [f"y{j}" for j in range(n)]
        return run_bound(session, host, device, outputs, (self.device_type, self.device_id))

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
        """concat(tensors[j], new[j]) on axis 2, on the device (new: one column a decoding step,
        a prompt chunk's columns a prefill)."""
        n = len(tensors)
        device = {f"x{j}": t for j, t in enumerate(tensors)}
        device.update({f"c{j}": c for j, c in enumerate(new)})
        grown = self._run(self._session("append", 1, n), {}, device, n)
        return grown, Columns(length + width_of(new[0]))

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any:
        """A zero-filled OrtValue on the device (the zero-length past of a new row)."""
        return ort.OrtValue.ortvalue_from_numpy(
            np.zeros(shape, dtype=dtype), self.device_type, self.device_id
        )
