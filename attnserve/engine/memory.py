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
(MADV_COLLAPSE, 6.1+) to back the anonymous memory the session mapped with huge pages, in place,
one huge page at a time and only where that page's memory is already resident (so it costs no
memory). SmolLM2 int8, one thread: 111 -> 128 tokens/s (docs/BENCHMARKS.md). It is best effort:
`ATTNSERVE_HUGE_PAGES=0` turns it off, and so does the system's transparent huge pages setting
"never"; elsewhere (other systems, kernels before 6.1) the calls fail and nothing changes.
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
from pathlib import Path

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
THP_SYSFS = Path("/sys/kernel/mm/transparent_hugepage")
_MADV_COLLAPSE = 25  # linux/mman.h, 6.1+
_MIN_RESIDENT = 0.9  # of a huge page's small pages, for it to be collapsed
Span = tuple[int, int]  # [start, end) of a mapping


def huge_page_size(sysfs: Path = THP_SYSFS) -> int:
    """The transparent huge page size (2 MB on x86-64; arm64's depends on its base page)."""
    try:
        return int((sysfs / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2 << 20


def huge_pages_allowed(sysfs: Path = THP_SYSFS) -> bool:
    """False when the switch or the system's setting ("never") says no."""
    if os.environ.get(HUGE_PAGES_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    try:
        return "[never]" not in (sysfs / "enabled").read_text()
    except OSError:
        return True  # no sysfs: the madvise calls answer


def anonymous_mappings(maps: str = "/proc/self/maps") -> list[Span]:
    """This process's private anonymous read-write mappings, in address order (Linux; else [])."""
    spans = []
    try:
        with open(maps, encoding="ascii", errors="replace") as lines:  # paths are raw bytes
            for line in lines:
                fields = line.split()
                if len(fields) < 5 or fields[1][:2] != "rw" or fields[1][3:4] != "p":
                    continue
                if len(fields) > 5 and fields[5] != "[heap]":  # a file, the stack, vdso...
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                spans.append((start, end))
    except (OSError, ValueError):
        return []
    return spans


def new_parts(before: list[Span], after: list[Span]) -> list[Span]:
    """The parts of `after`'s spans that no span of `before` covered (both sorted, disjoint)."""
    parts = []
    i = 0
    for start, end in after:
        while i < len(before) and before[i][1] <= start:
            i += 1
        at, j = start, i
        while j < len(before) and before[j][0] < end:
            lo, hi = before[j]
            if lo > at:
                parts.append((at, lo))
            at = max(at, hi)
            j += 1
        if at < end:
            parts.append((at, end))
    return parts


class _Libc:
    """madvise and mincore through ctypes (None where there is no C library to load)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self.madvise = libc.madvise
        self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.madvise.restype = ctypes.c_int
        self.mincore = libc.mincore
        self.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        self.mincore.restype = ctypes.c_int


def collapse(spans: list[Span], size: int | None = None) -> int:
    """Ask Linux to back the whole huge pages of `spans` whose memory is resident (>= 90 %) with
    huge pages, one at a time (a page it refuses does not stop the others); the bytes it did."""
    try:
        libc = _Libc()
    except (OSError, AttributeError):
        return 0
    size = size or huge_page_size()
    small = os.sysconf("SC_PAGE_SIZE")
    resident = ctypes.create_string_buffer(size // small)
    done = 0
    for lo, hi in spans:
        for page in range((lo + size - 1) // size * size, hi // size * size, size):
            if libc.mincore(page, size, resident) != 0:
                continue
            if sum(b & 1 for b in resident.raw) < _MIN_RESIDENT * len(resident.raw):
                continue  # mostly untouched: collapsing would make all of it resident
            if libc.madvise(page, size, _MADV_COLLAPSE) == 0:
                done += size
    return done


@contextlib.contextmanager
def weights_on_huge_pages(enabled: bool = True) -> Iterator[None]:
    """Back the resident anonymous memory that the block maps (a session's weights) with huge
    pages. Best effort: whatever fails leaves the memory as it was."""
    before: list[Span] = []
    if enabled and huge_pages_allowed():
        before = anonymous_mappings()
    yield
    if not before:
        return
    try:
        done = collapse(new_parts(before, anonymous_mappings()))
    except Exception as exc:  # never fail a model's load for a speed-up
        log.debug("huge pages: %s", exc)
        return
    log.debug("%.0f MB of new mappings on huge pages", done / 1e6)
