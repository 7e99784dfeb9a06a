"""Offline decoding benchmark: target tokens/s of backends on the same sources and lengths."""

from __future__ import annotations

import logging
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from attnserve.engine.backend import Backend
from attnserve.engine.options import DecodingOptions
from attnserve.engine.translator import decode_batch, length_sorted_batches

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchResult:
    backend: str
    beam_size: int
    batch_size: int
    sentences: int
    target_tokens: int
    tokens_per_second: float  # median over runs
    runs: list[float]  # tokens/s of every run
    peak_rss_mb: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def random_sources(
    n: int,
    vocab_size: int,
    *,
    min_len: int = 8,
    max_len: int = 40,
    eos_id: int = 0,
    seed: int = 0,
    reserved: int = 3,
) -> list[list[int]]:
    """Random token-id sentences (ids >= reserved, ending in EOS) for speed measurements."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=n)
    return [rng.integers(reserved, vocab_size, size=int(k)).tolist() + [eos_id] for k in lengths]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def time_decoding(
    backend: Backend[Any],
    sources: Sequence[Sequence[int]],
    options: DecodingOptions,
    batch_size: int,
    *,
    repeats: int = 3,
    name: str = "backend",
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """Decode all sources `repeats` times in length-sorted batches; median tokens/s."""
    runs: list[float] = []
    tokens = 0
    for run in range(repeats):
        start = time.perf_counter()
        tokens = 0
        for batch in length_sorted_batches([len(s) for s in sources], batch_size):
            nbest = decode_batch(backend, [sources[i] for i in batch], [options] * len(batch))
            tokens += sum(len(h[0].tokens) + int(h[0].ended_with_eos) for h in nbest)
        seconds = time.perf_counter() - start
        runs.append(tokens / seconds)
        if progress:
            progress(
                f"{name} beam={options.beam_size} batch={batch_size} run {run + 1}/{repeats}: "
                f"{tokens / seconds:.1f} tokens/s"
            )
    return BenchResult(
        backend=name,
        beam_size=options.beam_size,
        batch_size=batch_size,
        sentences=len(sources),
        target_tokens=tokens,
        tokens_per_second=statistics.median(runs),
        runs=runs,
        peak_rss_mb=peak_rss_mb(),
    )
