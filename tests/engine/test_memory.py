"""MemoryTrimmer: glibc's malloc_trim at most once per interval, after engine steps."""

from __future__ import annotations

import asyncio
import ctypes.util
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attnserve.engine.engine_loop import EngineLoop
from attnserve.engine.memory import (
    HUGE_PAGES_SWITCH,
    THP_SYSFS,
    MemoryTrimmer,
    anonymous_mappings,
    collapse,
    huge_page_size,
    huge_pages_allowed,
    new_parts,
    weights_on_huge_pages,
)
from attnserve.engine.options import DecodingOptions
from attnserve.engine.scheduler import Request, Scheduler
from tests.engine.fakes import TableBackend

GLIBC = ctypes.util.find_library("c") is not None


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.skipif(not GLIBC, reason="needs a C library with malloc_trim")
def test_trims_at_most_once_per_interval() -> None:
    clock = FakeClock()
    trimmer = MemoryTrimmer(2.0, clock=clock)
    assert trimmer.active
    assert not trimmer.maybe_trim()  # the interval counts from creation
    clock.now += 2.0
    assert trimmer.maybe_trim() and not trimmer.maybe_trim()
    clock.now += 1.0
    assert not trimmer.maybe_trim()
    clock.now += 1.5
    assert trimmer.maybe_trim() and trimmer.trims == 2
    assert trimmer.maybe_trim(force=True) and trimmer.trims == 3  # an engine going idle


def test_interval_zero_never_trims() -> None:
    trimmer = MemoryTrimmer(0.0)
    assert not trimmer.active and not trimmer.maybe_trim() and trimmer.trims == 0


@pytest.mark.skipif(not GLIBC, reason="needs a C library with malloc_trim")
def test_trimming_gives_freed_heap_memory_back() -> None:
    """Blocks freed between live ones stay resident until trimmed (the case the engine hits)."""

    def resident_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    MemoryTrimmer(1.0)  # loads malloc_trim before measuring
    # 100 KB each: under glibc's smallest mmap threshold, so from the heap in any process
    blocks = [np.ones(25_000, dtype=np.float32) for _ in range(3000)]
    del blocks[::2]  # half freed, each between two live blocks
    before = resident_mb()
    clock = FakeClock()
    trimmer = MemoryTrimmer(1.0, clock=clock)
    clock.now += 1.0
    assert trimmer.maybe_trim()
    assert resident_mb() < before - 100  # ~150 MB were freed in the middle of the heap
    del blocks


def test_the_engine_loop_trims_after_steps() -> None:
    class Counting(MemoryTrimmer):
        def __init__(self) -> None:
            super().__init__(0.0)
            self.calls = self.forced = 0

        def maybe_trim(self, *, force: bool = False) -> bool:
            self.calls += 1
            self.forced += force
            return False

    def three_tokens(src: tuple[int, ...], prefix: tuple[int, ...]) -> list[float]:
        return [1.0, 0, 0, 0] if len(prefix) >= 3 else [0.1, 0, 0.9, 0]

    trimmer = Counting()
    assert trimmer.calls == 0
    loop = EngineLoop(Scheduler(TableBackend(three_tokens, 4)), trimmer=trimmer)
    loop.start()

    async def main() -> None:
        await loop.submit(Request("r", [2, 0], DecodingOptions(max_new_tokens=8)))

    try:
        asyncio.run(asyncio.wait_for(main(), 10))
        deadline = time.monotonic() + 10
        while not trimmer.forced and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop(timeout=5)
    assert trimmer.calls >= 3  # once after every step
    assert trimmer.forced == 1  # and once when the engine went idle


def test_new_parts_subtracts_what_was_mapped_before() -> None:
    before = [(0, 10), (20, 30), (50, 60)]
    after = [(0, 15), (18, 32), (40, 45), (50, 60)]
    assert new_parts(before, after) == [(10, 15), (18, 20), (30, 32), (40, 45)]
    assert new_parts([], [(1, 2)]) == [(1, 2)]
    assert new_parts([(0, 100)], [(10, 20)]) == []
    assert new_parts([(5, 6), (8, 9)], [(0, 3), (4, 10), (12, 13)]) == [
        (0, 3),
        (4, 5),
        (6, 8),
        (9, 10),
        (12, 13),
    ]


def test_anonymous_mappings_are_private_read_write_and_not_files(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_bytes(
        b"00400000-00452000 r-xp 00000000 08:02 173521 /usr/bin/python3\n"
        b"00651000-00652000 rw-p 00051000 08:02 173521 /home/jos\xc3\xa9/\xff python\n"
        b"00e03000-01e24000 rw-p 00000000 00:00 0 [heap]\n"
        b"7f0000000000-7f0000800000 rw-p 00000000 00:00 0\n"
        b"7f0000800000-7f0000a00000 rw-s 00000000 00:01 7 /dev/zero (deleted)\n"
        b"7f0000a00000-7f0000c00000 r--p 00000000 00:00 0\n"
        b"7ffc0000000-7ffc0021000 rw-p 00000000 00:00 0 [stack]\n"
    )
    assert anonymous_mappings(str(maps)) == [
        (0x00E03000, 0x01E24000),
        (0x7F0000000000, 0x7F0000800000),
    ]
    assert anonymous_mappings(str(tmp_path / "missing")) == []


def test_huge_pages_follow_the_switch_and_the_system_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    (tmp_path / "hpage_pmd_size").write_text("33554432\n")
    assert huge_pages_allowed(tmp_path) and huge_page_size(tmp_path) == 32 << 20
    (tmp_path / "enabled").write_text("always madvise [never]\n")
    assert not huge_pages_allowed(tmp_path)
    assert huge_pages_allowed(tmp_path / "missing") and huge_page_size(tmp_path / "x") == 2 << 20
    monkeypatch.setenv(HUGE_PAGES_SWITCH, "off")
    assert not huge_pages_allowed(tmp_path / "missing")


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text(errors="replace").splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


class _Mappings:
    """Private anonymous mappings (mmap through ctypes), unmapped at the end."""

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.libc.mmap.restype = ctypes.c_void_p
        self.libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, *[ctypes.c_int] * 3]
        self.libc.mmap.argtypes.append(ctypes.c_long)
        self.libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.live: list[tuple[int, int]] = []

    def map(self, size: int, flags: int = 0, touch: Any = None) -> tuple[int, np.ndarray]:
        # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS (|NORESERVE: Linux merges adjacent mappings
        # with equal flags into one, and smaps counts huge pages per mapping)
        address = self.libc.mmap(None, size, 3, 0x22 | flags, -1, 0)
        assert address not in (None, ctypes.c_void_p(-1).value)
        self.live.append((address, size))
        view = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(address))
        if touch is None:
            view[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)
        else:
            view[touch] = 1
        return address, view

    def close(self) -> None:
        for address, size in self.live:
            self.libc.munmap(address, size)


@pytest.fixture
def mappings() -> Iterator[_Mappings]:
    """Skips unless this kernel collapses pages on request and does not on its own."""
    if not Path("/proc/self/smaps").exists():
        pytest.skip("Linux /proc only")
    if "[madvise]" not in (THP_SYSFS / "enabled").read_text():
        pytest.skip("transparent huge pages are not in 'madvise' mode here")
    maps = _Mappings()
    try:
        size = 4 * huge_page_size()
        probe, _ = maps.map(size)
        if collapse([(probe, probe + size)]) == 0:
            pytest.skip("this kernel does not collapse pages (MADV_COLLAPSE: Linux 6.1+)")
        yield maps
    finally:
        maps.close()


def test_weights_on_huge_pages_collapses_what_the_block_mapped(
    mappings: _Mappings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory mapped (and written, as ONNX Runtime writes a session's weights) inside the block
    is on huge pages after it, with its contents; memory mapped before is left as it was; the
    switch and `enabled=False` turn it off."""
    size = 8 * huge_page_size()
    before, _ = mappings.map(size, 0x4000)
    before_kb = _anon_huge_kb(before)
    with weights_on_huge_pages():
        inside, view = mappings.map(size)
        assert _anon_huge_kb(inside) == 0
    assert _anon_huge_kb(inside) >= 4 * huge_page_size() // 1024
    assert np.array_equal(view, np.arange(size, dtype=np.uint64).astype(np.uint8))
    assert _anon_huge_kb(before) == before_kb
    with weights_on_huge_pages(enabled=False):
        disabled, _ = mappings.map(size, 0x4000)
    assert _anon_huge_kb(disabled) == 0
    monkeypatch.setenv(HUGE_PAGES_SWITCH, "0")
    with weights_on_huge_pages():
        switched_off, _ = mappings.map(size)
    assert _anon_huge_kb(switched_off) == 0


def test_collapse_leaves_untouched_huge_pages_alone(mappings: _Mappings) -> None:
    """A huge page whose memory is mostly untouched stays small pages (collapsing would make all
    of it resident), and does not stop the pages after it."""
    page = huge_page_size()
    address, view = mappings.map(5 * page, touch=slice(0, 0))
    start = (address + page - 1) // page * page
    at = start - address
    view[at : at + page] = 1
    view[at + page] = 1  # the second huge page: one byte of it touched
    view[at + 2 * page : at + 4 * page] = 1
    assert collapse([(start, start + 4 * page)]) == 3 * page
