"""`attnserve bench-lm`: a language model's single-stream speed, variant against variant and
against peers on the same weights (attnserve/bench/lm_peers.py: ONNX Runtime GenAI, llama.cpp).

Two numbers per runtime, as users feel them: **decode** tokens/s of one greedy stream (a chat
prompt, then exactly `new_tokens` generated tokens; the prefill's time is taken off) and
**prefill** tokens/s of a long prompt (`prefill_tokens` of held-out English, the backend's
chunked prefill). Every runtime gets the same token ids. Runtimes are timed round-robin, so
the shared machine's drift hits them alike, and each figure is the median of `repeats`. With
each, the weight bytes a decoding step reads (attnserve/bench/lm_bytes.py), so that decode
tokens/s converts to the rate a runtime streams its weights (GB/s), and the rate at which the
same number of threads reads memory on this machine (a plain streaming read, measured in the
same run): a single stream's decode reads every weight once, so the share of that rate a
runtime reaches says how close it runs to the memory's speed.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnserve.bench.lm_bytes import machine_read_rate
from attnserve.bench.report import write_table
from attnserve.defaults import DEFAULT_VARIANT
from attnserve.engine.generator import Generator
from attnserve.engine.options import DecodingOptions
from attnserve.kernels import physical_cores

log = logging.getLogger(__name__)

STORY = [{"role": "user", "content": "Tell me a short story about a dragon who learns to read."}]


@dataclass(frozen=True)
class LMBenchResult:
    variant: str
    prompt_tokens: int
    new_tokens: int
    decode_tokens_per_second: float
    decode_runs: list[float]
    prefill_tokens: int
    prefill_tokens_per_second: float
    prefill_runs: list[float]
    # MB of weights a decoding step reads (None: unknown)
    step_weight_mb: float | None = None
    # the machine's 1-minute load average when timing began (the machine may be shared)
    load_at_start: float | None = None
    # GB/s at which as many threads read memory here (lm_bytes.machine_read_rate; None: not run)
    machine_read_gb_s: float | None = None

    @property
    def weight_gb_per_second(self) -> float | None:
        """Decode's rate of streaming the weights."""
        if self.step_weight_mb is None:
            return None
        return self.step_weight_mb * self.decode_tokens_per_second / 1000.0


def _prefill_seconds(generator: Generator, ids: Sequence[int]) -> float:
    backend = generator.backend
    src = np.asarray([ids], dtype=np.int64)
    start = time.perf_counter()
    backend.encode(src, np.asarray([len(ids)], dtype=np.int64))
    return time.perf_counter() - start


def _decode_tokens_per_second(generator: Generator, prompt: Sequence[int], new: int) -> float:
    options = DecodingOptions(max_new_tokens=new, min_new_tokens=new)
    start = time.perf_counter()
    (result,) = generator.generate([prompt], options)
    total = time.perf_counter() - start
    written = len(result.completions[0].token_ids)
    if written != new:
        raise RuntimeError(f"wrote {written} tokens, not {new}")
    return new / max(total - _prefill_seconds(generator, prompt), 1e-9)


class VariantRunner:
    """attnserve's ONNX backend (one variant) through its Generator, as a bench runner."""

    def __init__(self, generator: Generator, step_graph: Path | None = None) -> None:
        self.generator = generator
        self.step_graph = step_graph

    def step_weight_bytes(self) -> int | None:
        from attnserve.bench.lm_bytes import onnx_step_bytes

        return None if self.step_graph is None else onnx_step_bytes(self.step_graph)

    def prefill_seconds(self, ids: Sequence[int]) -> float:
        return _prefill_seconds(self.generator, ids)

    def decode_tokens_per_second(self, prompt: Sequence[int], new: int) -> float:
        return _decode_tokens_per_second(self.generator, prompt, new)


def bench_lm(
    model_dir: str | Path,
    variants: Sequence[str],
    *,
    peers: Sequence[str] = (),
    new_tokens: int = 128,
    prefill_tokens: int = 500,
    repeats: int = 3,
    threads: int | None = 1,
    spinning: bool = False,
    long_text: str = "",
    llama_cpp_src: Path | None = None,
    read_rate_megabytes: int = 512,
) -> list[LMBenchResult]:
    """Results for attnserve's `variants`, then `peers` (LM_PEERS; one that cannot run here is
    skipped with a warning), in that order. `llama_cpp_src`: a llama.cpp source tree whose
    converter makes the `llama.cpp-<type>` peers' GGUF files when missing. The machine's read
    rate at `threads` (over `read_rate_megabytes`; 0: not measured) is measured after the
    warm-up, before the timed runs."""
    from attnserve.bench.lm_peers import PeerUnavailable, peer_runner
    from attnserve.engine.onnx.layout import LM_STEP_NAME, variant_dir
    from attnserve.provision import Runtime, load_generator

    generators = {
        v: load_generator(model_dir, Runtime(variant=v, threads=threads, spinning=spinning))
        for v in variants
    }
    if not generators:
        raise ValueError("bench-lm needs at least one attnserve variant")
    runners: dict[str, Any] = {
        v: VariantRunner(g, variant_dir(model_dir, v) / LM_STEP_NAME) for v, g in generators.items()
    }
    for name in peers:
        try:
            runners[name] = peer_runner(model_dir, name, threads, llama_cpp_src)
        except PeerUnavailable as exc:
            log.warning("skipping %s: %s", name, exc)
    any_generator = next(iter(generators.values()))
    prompt = any_generator.prompt_ids(messages=STORY)
    long_ids = any_generator.tokenizer.encode(long_text)[:prefill_tokens]
    if len(long_ids) < prefill_tokens:
        raise ValueError(f"the long text has {len(long_ids)} tokens, not {prefill_tokens}")
    for runner in runners.values():  # warm up: sessions, allocators, caches
        runner.decode_tokens_per_second(prompt, 8)
        runner.prefill_seconds(long_ids)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    read_rate = (
        machine_read_rate(threads or physical_cores(), read_rate_megabytes)
        if read_rate_megabytes > 0
        else None
    )
    decode: dict[str, list[float]] = {v: [] for v in runners}
    prefill: dict[str, list[float]] = {v: [] for v in runners}
    for repeat in range(repeats):
        for variant, runner in runners.items():
            decode[variant].append(runner.decode_tokens_per_second(prompt, new_tokens))
            prefill[variant].append(len(long_ids) / runner.prefill_seconds(long_ids))
            print(
                f"repeat {repeat + 1}/{repeats} {variant}: decode {decode[variant][-1]:.1f} "
                f"tokens/s, prefill {prefill[variant][-1]:.0f} tokens/s",
                file=sys.stderr,
            )
    weights = {v: runner.step_weight_bytes() for v, runner in runners.items()}
    return [
        LMBenchResult(
            variant=v,
            prompt_tokens=len(prompt),
            new_tokens=new_tokens,
            decode_tokens_per_second=statistics.median(decode[v]),
            decode_runs=decode[v],
            prefill_tokens=len(long_ids),
            prefill_tokens_per_second=statistics.median(prefill[v]),
            prefill_runs=prefill[v],
            step_weight_mb=None if weights[v] is None else weights[v] / 1e6,
            load_at_start=load,
            machine_read_gb_s=read_rate,
        )
        for v in runners
    ]


def runtime_name(variant: str) -> str:
    """A result's row label: attnserve's variants by name, peers as they are called."""
    from attnserve.bench.lm_peers import LM_PEERS

    return variant if variant in LM_PEERS else f"attnserve {variant}"


def markdown(results: Sequence[LMBenchResult]) -> str:
    base = results[0]
    first = runtime_name(base.variant)
    machine = base.machine_read_gb_s
    lines = [
        f"| runtime | decode tokens/s (1 stream) | x {first} | "
        f"prefill tokens/s ({base.prefill_tokens}-token prompt) | x {first} | "
        "MB of weights a step | decode GB/s of weights |"
        + ("" if machine is None else " % of the machine's read rate |"),
        "|---|---|---|---|---|---|---|" + ("" if machine is None else "---|"),
    ]
    for r in results:
        rate = r.weight_gb_per_second
        lines.append(
            f"| {runtime_name(r.variant)} | {r.decode_tokens_per_second:.1f} | "
            f"{r.decode_tokens_per_second / base.decode_tokens_per_second:.2f} | "
            f"{r.prefill_tokens_per_second:.0f} | "
            f"{r.prefill_tokens_per_second / base.prefill_tokens_per_second:.2f} | "
            + ("- | - |" if rate is None else f"{r.step_weight_mb:.0f} | {rate:.1f} |")
            + ("" if machine is None else (" - |" if rate is None else f" {rate / machine:.0%} |"))
        )
    if machine is not None:
        lines.append(f"\nThe machine reads memory at {machine:.1f} GB/s with as many threads.")
    return "\n".join(lines) + "\n"


def write_chart(results: Sequence[LMBenchResult], path: Path, title: str) -> Path | None:
    """Bars of decode and prefill tokens/s per runtime; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no chart (pip install matplotlib)")
        return None
    names = [runtime_name(r.variant) for r in results]
    colors = [f"C{i % 10}" for i in range(len(results))]
    fig, axes = plt.subplots(1, 2, figsize=(9.0, 0.32 * len(results) + 1.6), dpi=80)
    panels = (
        ("decode tokens/s (1 stream)", [r.decode_tokens_per_second for r in results]),
        (f"prefill tokens/s ({results[0].prefill_tokens}-token prompt)",
         [r.prefill_tokens_per_second for r in results]),
    )  # fmt: skip
    for i, (ax, (label, values)) in enumerate(zip(axes, panels, strict=True)):
        ax.barh(range(len(values)), values, color=colors)
        ax.set_yticks(range(len(values)))
        ax.set_yticklabels(names if i == 0 else [], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(label, fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        for y, value in enumerate(values):
            ax.text(value, y, f" {value:.0f}", va="center", fontsize=7)
        ax.set_xlim(0, max(values) * 1.25)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_report(
    results: Sequence[LMBenchResult], out_dir: Path, name: str, title: str = ""
) -> None:
    """NAME.json, NAME.md and, with matplotlib, NAME.png in `out_dir`."""
    write_table(out_dir, name, [asdict(r) for r in results], markdown(results))
    write_chart(results, out_dir / f"{name}.png", title or name)


@dataclass(frozen=True)
class WorkloadResult:
    mode: str
    clients: int
    seconds: float
    requests: int
    output_tokens: int
    tokens_per_second: float
    ttft_p50: float
    ttft_p99: float


def mixed_workload(
    model_dir: str | Path,
    mode: str,
    clients: int,
    *,
    variant: str = DEFAULT_VARIANT,
    seconds: float = 60.0,
    threads: int | None = 1,
    seed: int = 0,
    long_share: float = 0.3,
) -> WorkloadResult:
    """A closed loop of `clients` streaming requests through the service's scheduler (its
    limits for `mode`: continuous, request or static batching), in process, no HTTP: a share
    `long_share` of prompts are long (200-400 tokens, else 10-40) and, independently, of
    outputs (96-160 tokens, else 8-24; exact lengths), all cut to the model's context. Output
    tokens/s counts every token generated in the window (requests still running at its end
    included); time to first token counts from submission, and a request still waiting for its
    first token at the end counts with its wait so far."""
    from attnserve.engine.generator import fit_to_context
    from attnserve.engine.scheduler import Outcome, Scheduler, lm_request
    from attnserve.provision import Runtime, open_backend
    from attnserve.service.models import scheduler_limits
    from attnserve.service.settings import Settings

    backend = open_backend(model_dir, Runtime(variant=variant, threads=threads, provider="cpu"))
    limits = scheduler_limits(Settings.model_validate({"batching": mode}), 256, generation=True)
    scheduler = Scheduler(backend, limits)
    rng = np.random.default_rng(seed)
    vocab = backend.spec.vocab_size
    submitted: dict[str, float] = {}
    ttft: list[float] = []
    count = 0

    def submit() -> None:
        nonlocal count
        count += 1
        length = int(rng.integers(200, 400) if rng.random() < long_share else rng.integers(10, 40))
        new = int(rng.integers(96, 160) if rng.random() < long_share else rng.integers(8, 24))
        options = DecodingOptions(max_new_tokens=new, min_new_tokens=new)
        context = backend.spec.max_positions
        prompt = rng.integers(10, vocab, min(length, context // 2)).tolist()
        fitted = fit_to_context(prompt, options, context)
        fitted = fitted.replace(min_new_tokens=min(new, fitted.max_new_tokens))
        request = lm_request(f"w{count}", prompt, fitted, stream=True)
        submitted[request.id] = time.perf_counter()
        scheduler.submit(request)

    for _ in range(clients):
        submit()
    tokens = finished = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        events = scheduler.step()
        now = time.perf_counter()
        for request, new_tokens in events.new_tokens:
            tokens += len(new_tokens)
            if request.id in submitted:
                ttft.append(now - submitted.pop(request.id))
        for request in events.ended:
            if request.outcome is not Outcome.DONE:
                raise RuntimeError(f"request {request.id} ended {request.outcome}")
            finished += 1
            submit()
    elapsed = time.perf_counter() - start
    end = time.perf_counter()
    ttft += [end - t for t in submitted.values()]  # still waiting: at least this long
    return WorkloadResult(
        mode=mode,
        clients=clients,
        seconds=elapsed,
        requests=finished,
        output_tokens=tokens,
        tokens_per_second=tokens / elapsed,
        ttft_p50=float(np.percentile(ttft, 50)) if ttft else float("nan"),
        ttft_p99=float(np.percentile(ttft, 99)) if ttft else float("nan"),
    )


def workload_markdown(results: Sequence[WorkloadResult]) -> str:
    lines = [
        "| clients | batching | output tokens/s | x first mode | TTFT p50 s | TTFT p99 s |",
        "|---|---|---|---|---|---|",
    ]
    base: dict[int, float] = {}
    for r in results:
        base.setdefault(r.clients, r.tokens_per_second)
        lines.append(
            f"| {r.clients} | {r.mode} | {r.tokens_per_second:.1f} | "
            f"{r.tokens_per_second / base[r.clients] if base[r.clients] else float('nan'):.2f} | "
            f"{r.ttft_p50:.2f} | {r.ttft_p99:.2f} |"
        )
    return "\n".join(lines) + "\n"


def write_workload_chart(results: Sequence[WorkloadResult], path: Path, title: str) -> Path | None:
    """Bars of output tokens/s and TTFT p99 per client count, one bar per batching mode;
    None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no chart (pip install matplotlib)")
        return None
    clients = sorted({r.clients for r in results})
    modes = list(dict.fromkeys(r.mode for r in results))
    by = {(r.clients, r.mode): r for r in results}
    width = 0.8 / len(modes)
    fig, axes = plt.subplots(1, 2, figsize=(9.0, 3.2), dpi=80)
    panels = (
        ("output tokens/s", "tokens_per_second"),
        ("time to first token, p99 (s)", "ttft_p99"),
    )
    for ax, (label, field) in zip(axes, panels, strict=True):
        for m, mode in enumerate(modes):
            xs = [i + (m - (len(modes) - 1) / 2) * width for i in range(len(clients))]
            values = [getattr(by[c, mode], field) if (c, mode) in by else 0.0 for c in clients]
            ax.bar(xs, values, width, label=mode, color=f"C{m % 10}")
            for x, value in zip(xs, values, strict=True):
                ax.text(x, value, f"{value:.1f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(clients)))
        ax.set_xticklabels([f"{c} clients" for c in clients], fontsize=8)
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
        ax.margins(y=0.15)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
