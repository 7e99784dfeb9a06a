"""Giving freed heap memory back to the operating system while a server decodes.

A decoding step allocates and frees arrays of a few MB (logits, search scratch, cache copies
when rows join or leave). glibc serves an allocation over its mmap threshold with its own
mapping, returned at `free`, but it raises that threshold to the size of every such block freed
(up to 32 MB), so after the first steps these arrays come from the heaps of the engine threads'
arenas, where freed blocks between live ones stay resident. `malloc_trim(0)` releases the free
pages of every arena; it walks the free lists, so it runs at most once per interval, after a
step. It trades speed for memory, so it is off by default (`--trim-seconds`): with both default
models under chat and translation load, trimming every second took the peak RSS from 1075 to
1001 MB and 16 users' tokens/s from 186 to 166, as pages given back fault in again
(docs/BENCHMARKS.md, with the alternatives measured: a fixed MALLOC_MMAP_THRESHOLD_, cache
buffers in their own mappings).

Not glibc (musl, macOS): nothing to do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class MemoryTrimmer:
    """Calls malloc_trim(0) at most once every `interval` seconds, from any thread."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._trim = _malloc_trim() if interval > 0 else None
        self._lock = threading.Lock()
        self._last = clock()
        self.trims = 0

    @property
    def active(self) -> bool:
        return self._trim is not None

    def maybe_trim(self, *, force: bool = False) -> bool:
        """Trim if the interval has passed since the last trim (or `force`: an engine going
        idle, so that a burst's memory does not stay until the next one); True if it did."""
        if self._trim is None:
            return False
        now = self._clock()
        with self._lock:
            if not force and now - self._last < self.interval:
                return False
            self._last = now
            self.trims += 1
        self._trim(0)
        return True
