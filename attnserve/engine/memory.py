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

The other half: model weights on 2 MB pages. A language model's single-stream decode reads
every weight once per token, faster than the CPU's prefetchers can follow across 4 KB pages
(they stop at each page's edge, and each new page costs a TLB walk). Transparent huge pages are
usually enabled only for memory that asks (`madvise`), and ONNX Runtime does not ask for its
initializers. `weights_on_huge_pages()` wraps a session's creation: afterwards it asks Linux
(MADV_COLLAPSE, 6.1+) to back the anonymous memory the session mapped with 2 MB pages, in place.
SmolLM2 int8, one thread: 111 -> 125 tokens/s (docs/BENCHMARKS.md). `ATTNSERVE_HUGE_PAGES=0`
turns it off; elsewhere (other systems, older kernels, THP "never") it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

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


HUGE_PAGES_SWITCH = "ATTNSERVE_HUGE_PAGES"
HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KB granule) PMD size
_MADV_COLLAPSE = 25  # linux/mman.h, 6.1+
Span = tuple[int, int]  # [start, end) of a mapping


def anonymous_mappings(maps: str = "/proc/self/maps") -> list[Span]:
    """This process's private anonymous read-write mappings, in address order (Linux; else [])."""
    spans = []
    try:
        with open(maps, encoding="ascii") as lines:
            for line in lines:
                fields = line.split()
                if len(fields) < 5 or fields[1][:2] != "rw" or fields[1][3:4] != "p":
                    continue
                if len(fields) > 5 and fields[5] != "[heap]":  # a file, the stack, vdso...
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                spans.append((start, end))
    except OSError:
        return []
    return spans


def new_parts(before: list[Span], after: list[Span]) -> list[Span]:
    """The parts of `after`'s spans that no span of `before` covered (both in address order)."""
    parts = []
    for start, end in after:
        at = start
        for lo, hi in before:
            if hi <= at or lo >= end:
                continue
            if lo > at:
                parts.append((at, lo))
            at = max(at, hi)
        if at < end:
            parts.append((at, end))
    return parts


def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def collapse(spans: list[Span]) -> int:
    """Ask Linux to back each span's whole 2 MB pages with huge pages; the bytes it did."""
    madvise = _madvise()
    done = 0
    if madvise is None:
        return 0
    for lo, hi in spans:
        start = (lo + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
        end = hi // HUGE_PAGE * HUGE_PAGE
        if end > start and madvise(start, end - start, _MADV_COLLAPSE) == 0:
            done += end - start
    return done


@contextlib.contextmanager
def weights_on_huge_pages() -> Iterator[None]:
    """Back the anonymous memory that the block maps (a session's weights) with huge pages."""
    if os.environ.get(HUGE_PAGES_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        yield
        return
    before = anonymous_mappings()
    yield
    if before:
        done = collapse(new_parts(before, anonymous_mappings()))
        log.debug("%.0f MB of new mappings on huge pages", done / 1e6)
