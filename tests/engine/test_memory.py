"""MemoryTrimmer: glibc's malloc_trim at most once per interval, after engine steps."""

from __future__ import annotations

import asyncio
import ctypes.util
import time

import numpy as np
import pytest

from attnserve.engine.engine_loop import EngineLoop
from attnserve.engine.memory import MemoryTrimmer
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
