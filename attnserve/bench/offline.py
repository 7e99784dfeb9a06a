"""Offline decoding benchmark: target tokens/s of runtimes on the same sources and output lengths.

A `Runner` decodes token-id sources with a fixed output length (min = max new tokens, so every
runtime writes exactly the same number of tokens) in length-sorted batches; attnserve's backends,
Hugging Face `generate` and CTranslate2 (peers.py) are runners. `run_interleaved` times
them round-robin (one pass of every runner, then the next repeat), so that a machine whose load
changes during the benchmark slows every runner alike, and reports the median of the repeats.
workers.py runs each runner in its own process, so its peak RSS is its own.
"""

from __future__ import annotations

import logging
import resource
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from attnserve.engine.backend import Backend
from attnserve.engine.options import DecodingOptions
from attnserve.engine.translator import decode_batch, length_sorted_batches

log = logging.getLogger(__name__)

Sources = Sequence[Sequence[int]]


@dataclass(frozen=True)
class BenchConfig:
    """One measured setting: beam size, sentences per batch, fixed output length."""

    beam_size: int
    batch_size: int
    new_tokens: int


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
    model_size_mb: float | None = None
    threads: int | None = None
    isolated: bool = False  # peak RSS is that of a process running this backend alone
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Runner(Protocol):
    """A runtime that decodes token ids with a fixed output length."""

    def decode(self, sources: Sources, config: BenchConfig) -> int:
        """Decode every source (batches of config.batch_size); return the target tokens written."""
        ...

    def model_size_mb(self) -> float | None:
        """Size on disk of the files the runtime loads (None when it has none)."""
        ...


class Timed(Protocol):
    """A runner as the benchmark loop sees it: in this process or in a worker process."""

    def timed_decode(self, config: BenchConfig) -> tuple[int, float]:
        """Decode the benchmark sources once: (target tokens, seconds)."""
        ...

    def peak_rss_mb(self) -> float: ...

    def model_size_mb(self) -> float | None: ...


def random_sources(
    n: int,
    vocab_size: int,
    *,
    min_len: int = 8,
    max_len: int = 40,
    eos_id: int = 0,
    seed: int = 0,
    reserved: int = 3,
    exclude: Iterable[int] = (),
) -> list[list[int]]:
    """Random token-id sentences (ids >= reserved, none in `exclude`, ending in EOS)."""
    rng = np.random.default_rng(seed)
    banned = np.array(sorted(set(exclude)), dtype=np.int64)
    allowed = np.setdiff1d(np.arange(reserved, vocab_size, dtype=np.int64), banned)
    lengths = rng.integers(min_len, max_len + 1, size=n)
    return [rng.choice(allowed, size=int(k)).tolist() + [eos_id] for k in lengths]


def peak_rss_mb() -> float:
    """Peak resident set size of this process, in MB.

    Linux: VmHWM of /proc/self/status, the high-water mark of this address space. getrusage's
    ru_maxrss survives execve, so a worker spawned by a process that had loaded torch would
    report the parent's peak; it is only the fallback.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0  # kB
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def files_size_mb(paths: Iterable[Path]) -> float:
    return sum(p.stat().st_size for p in paths if p.is_file()) / 1e6


def fixed_length(beam_size: int, new_tokens: int) -> DecodingOptions:
    """Options that make every output exactly `new_tokens` long (EOS banned until then)."""
    return DecodingOptions(
        beam_size=beam_size, max_new_tokens=new_tokens, min_new_tokens=new_tokens
    )


class BackendRunner:
    """An attnserve Backend (torch or ONNX Runtime) decoding through RunningBatch."""

    def __init__(self, backend: Backend[Any], files: Sequence[Path] = ()) -> None:
        self.backend = backend
        self.files = list(files)

    def decode(self, sources: Sources, config: BenchConfig) -> int:
        options = fixed_length(config.beam_size, config.new_tokens)
        tokens = 0
        for batch in length_sorted_batches([len(s) for s in sources], config.batch_size):
            nbest = decode_batch(self.backend, [sources[i] for i in batch], [options] * len(batch))
            tokens += sum(len(h[0].tokens) + int(h[0].ended_with_eos) for h in nbest)
        return tokens

    def model_size_mb(self) -> float | None:
        return files_size_mb(self.files) if self.files else None


class InProcess:
    """A runner timed in this process (peak RSS is the whole process's)."""

    def __init__(self, runner: Runner, sources: Sources) -> None:
        self.runner = runner
        self.sources = sources

    def timed_decode(self, config: BenchConfig) -> tuple[int, float]:
        start = time.perf_counter()
        tokens = self.runner.decode(self.sources, config)
        return tokens, time.perf_counter() - start

    def peak_rss_mb(self) -> float:
        return peak_rss_mb()

    def model_size_mb(self) -> float | None:
        return self.runner.model_size_mb()


def run_interleaved(
    runners: Mapping[str, Timed],
    configs: Sequence[BenchConfig],
    *,
    sentences: int,
    repeats: int = 3,
    warmup: bool = True,
    threads: int | None = None,
    isolated: bool = False,
    progress: Callable[[str], None] | None = None,
) -> list[BenchResult]:
    """Time every runner on every config, round-robin over repeats; medians of tokens/s.

    Before the timed repeats of a config every runner decodes once untimed (sessions warm up,
    allocators settle). Every runner must write sentences x new_tokens tokens; a runtime that
    writes a different number is reported (the `extra` field) rather than hidden.
    """
    results: list[BenchResult] = []
    for config in configs:
        if warmup:
            for runner in runners.values():
                runner.timed_decode(config)
        runs: dict[str, list[float]] = {name: [] for name in runners}
        written: dict[str, int] = {}
        for repeat in range(repeats):
            for name, runner in runners.items():
                tokens, seconds = runner.timed_decode(config)
                runs[name].append(tokens / seconds)
                written[name] = tokens
                if progress:
                    progress(
                        f"{name} beam={config.beam_size} batch={config.batch_size} "
                        f"run {repeat + 1}/{repeats}: {tokens / seconds:.1f} tokens/s"
                    )
        expected = sentences * config.new_tokens
        for name, runner in runners.items():
            extra = {}
            if written[name] != expected:
                log.warning("%s wrote %d tokens, expected %d", name, written[name], expected)
                extra["expected_tokens"] = expected
            results.append(
                BenchResult(
                    backend=name,
                    beam_size=config.beam_size,
                    batch_size=config.batch_size,
                    sentences=sentences,
                    target_tokens=written[name],
                    tokens_per_second=statistics.median(runs[name]),
                    runs=runs[name],
                    peak_rss_mb=runner.peak_rss_mb(),
                    model_size_mb=runner.model_size_mb(),
                    threads=threads,
                    isolated=isolated,
                    extra=extra,
                )
            )
    return results


def time_decoding(
    backend: Backend[Any],
    sources: Sources,
    options: DecodingOptions,
    batch_size: int,
    *,
    repeats: int = 3,
    name: str = "backend",
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """One backend, one setting, no warm-up: median tokens/s of `repeats` runs (in process).

    `options` must fix the output length (max_new_tokens == min_new_tokens).
    """
    config = BenchConfig(options.beam_size, batch_size, options.max_new_tokens)
    runner = InProcess(BackendRunner(backend), sources)
    [result] = run_interleaved(
        {name: runner},
        [config],
        sentences=len(sources),
        repeats=repeats,
        warmup=False,
        progress=progress,
    )
    return result
