"""`BufferPool`: numpy buffers reused for the host cache tensors once no state holds them."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np


class BufferPool:
    """Hands out numpy arrays again once no state holds them, with rows to spare.

    A fresh array of a few MB is mapped memory whose pages fault and are zeroed by the kernel on
    first touch, which costs more than the copy into it, and a cache grows or is reordered at
    every beam step. So arrays are views of pooled flat buffers, reused for any shape that fits
    (a cache one column wider, a batch a few rows smaller). A buffer is free when the pool holds
    its only reference (CPython reference counts; a view keeps its buffer alive). Buffers are
    allocated with room to spare, so rows that join a running batch go into the rows after a view
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
    # (pages never touched cost no memory); with less room every growth faults fresh pages in.
    ROOM = 2
    # A free buffer serves requests down to 1/REUSE of its size: a batch that lost rows keeps
    # its buffers, but a small request does not pin a large buffer (memory after a peak).
    REUSE = 16
    # Free buffers are kept up to the recent high-water mark of the bytes in use, which decays
    # by this factor a request (halved in ~140): a batch that ends and a next one that grows
    # back reuse the same memory (trimming to the bytes in use at once would fault it in
    # again), and after a peak the memory is given back under a lighter load.
    HIGH_DECAY = 0.995

    def __init__(self, room: float = ROOM, rows: int = ROWS, keep: float = 1.0) -> None:
        """`room` and `rows` override ROOM and ROWS; free buffers are kept up to `keep` times
        the high-water mark. A language model's cache (~46 KB a token per row for SmolLM2,
        against ~4 KB for the translation model) takes less of all three."""
        self.room_factor = room
        self.row_quantum = rows
        self.keep = keep
        self._buffers: list[np.ndarray] = []  # flat
        self._claimed: list[int] = []  # elements of each buffer the last view handed out holds
        self._high = 0.0  # decaying high-water mark of the bytes in use

    def capacity(self, rows: int) -> int:
        """Rows allocated for a request of `rows`: a quarter and `rows` (ROWS) more, rounded
        up to a multiple of it."""
        q = self.row_quantum
        return -(-(rows + rows // 4 + q) // q) * q

    def _free(self, i: int) -> bool:
        return sys.getrefcount(self._buffers[i]) <= self.FREE

    def get(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """An array of this shape and dtype, with finite but arbitrary contents."""
        return self.get_many(shape, dtype, 1)[0]

    def get_many(
        self, shape: tuple[int, ...], dtype: np.dtype[Any], count: int
    ) -> list[np.ndarray]:
        """`count` arrays of this shape and dtype (a cache's layers): one pass over the pool
        for all of them, the smallest free buffers that fit first."""
        need = int(np.prod(shape))
        fitting = [
            i
            for i in range(len(self._buffers))  # indices: a loop variable would hold a reference
            if self._buffers[i].dtype == dtype
            and need <= self._buffers[i].size <= self.REUSE * need + 1024
            and self._free(i)
        ]
        fitting.sort(key=lambda i: self._buffers[i].size)
        views = []
        for i in fitting[:count]:
            self._claimed[i] = need
            views.append(self._buffers[i][:need].reshape(shape))
        row = int(np.prod(shape[1:]))
        size = int(self.capacity(shape[0]) * row * self.room_factor)
        for _ in range(count - len(views)):
            self._buffers.append(np.zeros(size, dtype=dtype))
            self._claimed.append(need)
            views.append(self._buffers[-1][:need].reshape(shape))
        self._trim(count)
        return views

    def _trim(self, requests: int = 1) -> None:
        """Drop the largest free buffers while the free ones outweigh the recent high-water mark
        of those in use (it decays by HIGH_DECAY a request: `requests` of them for `get_many`)."""
        free = [i for i in range(len(self._buffers)) if self._free(i)]
        free_bytes = sum(self._buffers[i].nbytes for i in free)
        busy_bytes = sum(b.nbytes for b in self._buffers) - free_bytes
        self._high = max(float(busy_bytes), self._high * self.HIGH_DECAY**requests)
        dropped = set()
        for i in sorted(free, key=lambda i: -self._buffers[i].nbytes):
            if free_bytes <= self._high * self.keep:
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
