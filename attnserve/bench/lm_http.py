"""`attnserve bench-lm --http`: streaming chat through HTTP, attnserve against llama.cpp's
servers on the same model.

Each server is started by the bench (a subprocess with `threads` intra-op threads; one at a
time, so none competes with another), then `clients` asyncio clients run a closed loop of
streaming OpenAI `/v1/chat/completions` requests (greedy, `max_tokens`, each client cycling
through `CHAT_PROMPTS`) for `seconds`. Servers:

* ``attnserve``: `attnserve serve --model MODEL --variant VARIANT` (int8 unless told;
  continuous batching);
* ``attnserve-ray``: the same on Ray Serve as `threads` replicas of one thread each, behind
  Serve's HTTP proxy (`--ray --replicas THREADS --threads 1`; the `ray` extra);
* ``attnserve-ray-one``: one replica of `threads` threads behind the proxy (`--ray`): against
  ``attnserve``, the proxy's own cost;
* ``llama-server``: llama.cpp's own server (`--server-bin`, built from the llama.cpp sources
  with cmake) on the model's GGUF source, one parallel slot per client (`-np`) and an HTTP
  thread for each, continuous batching;
* ``llama-cpp-python``: `python -m llama_cpp.server` (llama-cpp-python's OpenAI-compatible
  server; it decodes one request at a time; `--interrupt_requests False`, or each new request
  would cut the stream being decoded).

Reported per server and client count: completion tokens/s over the window (tokens of requests
that finished, from their `usage`, plus the streamed chunks of those still running at its end),
requests finished, mean completion length, requests whose connection dropped (counted, not
retried), and time to first token (first content chunk, from
sending; a request still waiting at the window's end counts with its wait so far) p50 / p99.
The server process's memory: `VmRSS` when ready (after a short warm-up) and `VmHWM`, its peak
resident set, at the window's end (Linux /proc; NaN elsewhere; for the Ray servers, the process
the bench started, not the replicas in Ray's workers). Each server writes its log to `work_dir`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnserve.bench.lm_peers import gguf_source
from attnserve.bench.report import write_table
from attnserve.defaults import DEFAULT_VARIANT
from attnserve.loadtest.runner import free_port, stop_server, wait_ready

log = logging.getLogger(__name__)

SERVERS = ("attnserve", "attnserve-ray", "attnserve-ray-one", "llama-server", "llama-cpp-python")
# What `attnserve serve --ray` logs once every replica is up (service/ray_serve.py).
RAY_READY = b"serving on"
# Tokens a llama-server slot holds: a chat prompt and its answer fit with room to spare.
SLOT_CONTEXT = 512
CHAT_PROMPTS = (
    "Tell me a short story about a dragon who learns to read.",
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a ten-year-old.",
    "Give me three tips for learning a new language.",
    "What is the difference between a virus and a bacterium?",
    "Describe a sunset over the mountains.",
    "How do I make a cup of tea?",
    "Why is the sky blue?",
    "Write a short poem about autumn leaves.",
    "What are the planets of the solar system?",
    "Suggest a name for a friendly robot and explain why.",
    "How does a bicycle stay upright?",
    "Summarize the story of Noah's ark in three sentences.",
    "What should I pack for a weekend hiking trip?",
    "Explain what a computer program is.",
)


@dataclass(frozen=True)
class ChatLoadResult:
    server: str
    clients: int
    seconds: float
    requests: int
    completion_tokens: int
    tokens_per_second: float
    mean_completion_tokens: float
    ttft_p50: float
    ttft_p99: float
    errors: int
    rss_ready_mb: float = float("nan")
    rss_peak_mb: float = float("nan")


def process_memory_mb(pid: int) -> tuple[float, float]:
    """VmRSS and VmHWM (the peak resident set) of process `pid` in MB; NaN where /proc has
    none."""
    found = {"VmRSS": float("nan"), "VmHWM": float("nan")}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in found:
                found[key] = int(value.split()[0]) / 1024.0  # kB
    except (OSError, ValueError, IndexError):
        pass
    return found["VmRSS"], found["VmHWM"]


def server_command(
    server: str,
    model_dir: Path,
    port: int,
    threads: int,
    clients: int,
    server_bin: Path | None,
    variant: str = DEFAULT_VARIANT,
    spinning: bool = False,
) -> list[str]:
    """The command that serves `model_dir` (or its GGUF source) on 127.0.0.1:`port`."""
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if server.startswith("attnserve"):
        replicas = {
            "attnserve": [],
            "attnserve-ray": ["--ray", "--replicas", str(threads)],
            "attnserve-ray-one": ["--ray"],
        }
        if server not in replicas:
            raise ValueError(f"unknown server {server!r}; choose from {', '.join(SERVERS)}")
        per_replica = 1 if server == "attnserve-ray" else threads
        return [
            sys.executable, "-m", "attnserve.cli", "serve", "--model", str(model_dir),
            "--threads", str(per_replica), "--variant", variant, *host, *replicas[server],
            *(["--spinning"] if spinning else []),
        ]  # fmt: skip
    gguf = str(gguf_source(model_dir))
    if server == "llama-server":
        binary = server_bin or (Path(found) if (found := shutil.which("llama-server")) else None)
        if binary is None or not binary.is_file():
            raise FileNotFoundError("llama-server: pass --server-bin (built from llama.cpp)")
        return [
            str(binary), "-m", gguf, "-t", str(threads), "-tb", str(threads),
            "-np", str(clients), "-c", str(clients * SLOT_CONTEXT),
            "--threads-http", str(clients + 4), *host,
        ]  # fmt: skip
    if server == "llama-cpp-python":
        return [
            sys.executable, "-m", "llama_cpp.server", "--model", gguf,
            "--n_threads", str(threads), "--n_threads_batch", str(threads),
            "--n_ctx", "2048", "--interrupt_requests", "False", *host,
        ]  # fmt: skip
    raise ValueError(f"unknown server {server!r}; choose from {', '.join(SERVERS)}")


@asynccontextmanager
async def _stream(http: Any, url: str, body: dict[str, Any]) -> AsyncIterator[Any]:
    """http.stream(POST), sent again once when a kept-alive connection turns out closed before
    any response (a server that closes idle or much-used connections, as llama-server does)."""
    import httpx

    answered = False
    for attempt in range(2):
        try:
            async with http.stream("POST", url, json=body) as response:
                answered = True
                yield response
                return
        except httpx.RemoteProtocolError as exc:
            if answered or attempt or "without sending a response" not in str(exc):
                raise


@contextmanager
def serving(
    command: list[str], port: int, log_path: Path, timeout: float, ready_line: bytes | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The server of `command` and its URL, ready (GET /v1/models answers 200, and its log
    holds `ready_line`: Ray Serve's proxy answers once one replica is up), stopped on exit."""
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as server_log:
        process = subprocess.Popen(command, stdout=server_log, stderr=subprocess.STDOUT)
        try:
            wait_ready(url, process, timeout, log_path, path="/v1/models")
            end = time.monotonic() + timeout
            while ready_line is not None and ready_line not in log_path.read_bytes():
                if process.poll() is not None or time.monotonic() > end:
                    raise RuntimeError(f"{command[0]}: no {ready_line!r} in {log_path}")
                time.sleep(0.5)
            yield url, process
        finally:
            stop_server(process)


@contextmanager
def running(
    command: list[str], port: int, log_path: Path, timeout: float, ready_line: bytes | None = None
) -> Iterator[str]:
    """The URL of the server of `command` (`serving`)."""
    with serving(command, port, log_path, timeout, ready_line) as (url, _):
        yield url


async def chat_load(
    url: str, model: str, clients: int, seconds: float, max_tokens: int
) -> tuple[int, int, list[float], int, int]:
    """A closed loop of `clients` streaming chat requests for `seconds`: requests finished,
    their completion tokens, times to first token, chunks streamed by unfinished ones, and
    requests that failed in transport (the connection dropped)."""
    import httpx

    finished = tokens = errors = 0
    ttft: list[float] = []
    running_chunks: dict[int, int] = {}
    waiting: dict[int, float] = {}  # sent, for requests without a first token yet
    end = time.perf_counter() + seconds

    async def one(http: httpx.AsyncClient, key: int, prompt: str) -> None:
        nonlocal finished, tokens
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent = time.perf_counter()
        chunks, usage, first = 0, None, True
        running_chunks[key] = 0
        waiting[key] = sent
        async with _stream(http, url + "/v1/chat/completions", body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status_code}: {text[:300]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                data = json.loads(line[5:])
                if data.get("usage"):
                    usage = data["usage"]
                choices = data.get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    if first:
                        ttft.append(time.perf_counter() - sent)
                        del waiting[key]
                        first = False
                    chunks += 1
                    running_chunks[key] = chunks
        del running_chunks[key]
        waiting.pop(key, None)  # an empty answer has no first token
        finished += 1
        tokens += int(usage["completion_tokens"]) if usage else chunks

    async def client(http: httpx.AsyncClient, index: int) -> None:
        nonlocal errors
        turn = 0
        while time.perf_counter() < end:
            prompt = CHAT_PROMPTS[(index + turn) % len(CHAT_PROMPTS)]
            key = index * 1_000_000 + turn
            try:
                await one(http, key, prompt)
            except httpx.TransportError as exc:  # counted and reported; the loop goes on
                errors += 1
                running_chunks.pop(key, None)
                waiting.pop(key, None)
                log.warning("client %d: %s: %s", index, type(exc).__name__, exc)
            turn += 1

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        tasks = [asyncio.create_task(client(http, i)) for i in range(clients)]
        done, pending = await asyncio.wait(tasks, timeout=seconds)
        unfinished = sum(running_chunks.values())
        now = time.perf_counter()
        ttft += [now - sent for sent in waiting.values()]  # still waiting: at least this long
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            task.result()  # a client's error is the bench's error
    return finished, tokens, ttft, unfinished, errors


def bench_chat_http(
    model_dir: str | Path,
    servers: Sequence[str],
    clients: Sequence[int],
    *,
    threads: int = 1,
    seconds: float = 60.0,
    max_tokens: int = 128,
    server_bin: Path | None = None,
    variant: str = DEFAULT_VARIANT,
    spinning: bool = False,
    work_dir: Path,
    ready_timeout: float = 600.0,
) -> list[ChatLoadResult]:
    """Every server at every client count (a fresh server per count: llama-server's slots are
    fixed at start), one after the other."""
    model_dir = Path(model_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for count in clients:
        for server in servers:
            port = free_port()
            command = server_command(server, model_dir, port, threads, count, server_bin, variant)
            log_path = work_dir / f"{server}-{count}.log"
            log.info("starting %s for %d clients: %s", server, count, " ".join(command))
            ready_line = RAY_READY if server.startswith("attnserve-ray") else None
            with serving(command, port, log_path, ready_timeout, ready_line) as (url, process):
                asyncio.run(chat_load(url, model_dir.name, 1, 5.0, 8))  # warm up
                ready_mb, _ = process_memory_mb(process.pid)
                started = time.perf_counter()
                finished, tokens, ttft, unfinished, errors = asyncio.run(
                    chat_load(url, model_dir.name, count, seconds, max_tokens)
                )
                elapsed = time.perf_counter() - started
                _, peak_mb = process_memory_mb(process.pid)
            result = ChatLoadResult(
                server=server,
                clients=count,
                seconds=elapsed,
                requests=finished,
                completion_tokens=tokens + unfinished,
                tokens_per_second=(tokens + unfinished) / elapsed,
                mean_completion_tokens=tokens / finished if finished else float("nan"),
                ttft_p50=float(np.percentile(ttft, 50)) if ttft else float("nan"),
                ttft_p99=float(np.percentile(ttft, 99)) if ttft else float("nan"),
                errors=errors,
                rss_ready_mb=ready_mb,
                rss_peak_mb=peak_mb,
            )
            log.info("%s", json.dumps(result.__dict__))
            results.append(result)
    return results


def chat_markdown(results: Sequence[ChatLoadResult]) -> str:
    lines = [
        "| clients | server | completion tokens/s | x first server | requests | mean tokens "
        "| TTFT p50 s | TTFT p99 s | errors | RSS ready / peak MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base: dict[int, float] = {}
    for r in results:
        base.setdefault(r.clients, r.tokens_per_second)
        ratio = r.tokens_per_second / base[r.clients] if base[r.clients] else float("nan")
        lines.append(
            f"| {r.clients} | {r.server} | {r.tokens_per_second:.1f} | {ratio:.2f} | "
            f"{r.requests} | {r.mean_completion_tokens:.0f} | {r.ttft_p50:.2f} | "
            f"{r.ttft_p99:.2f} | {r.errors} | {r.rss_ready_mb:.0f} / {r.rss_peak_mb:.0f} |"
        )
    return "\n".join(lines) + "\n"


def write_chat_chart(results: Sequence[ChatLoadResult], path: Path, title: str) -> Path | None:
    """Grouped bars per client count: completion tokens/s and TTFT p50 of each server; None
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no chart (pip install matplotlib)")
        return None
    servers = list(dict.fromkeys(r.server for r in results))
    counts = list(dict.fromkeys(r.clients for r in results))
    cell = {(r.server, r.clients): r for r in results}
    fig, axes = plt.subplots(1, 2, figsize=(9.0, 3.2), dpi=80)
    width = 0.8 / len(servers)
    panels = (
        ("completion tokens/s", "tokens_per_second"),
        ("time to first token p50 (s)", "ttft_p50"),
    )
    for ax, (label, field) in zip(axes, panels, strict=True):
        top = max((getattr(r, field) for r in results), default=1.0)
        ax.set_ylim(0, (top if top == top else 1.0) * 1.35)  # room for the legend (NaN: 1)
        for j, server in enumerate(servers):
            values = [
                getattr(cell[server, c], field) if (server, c) in cell else 0.0 for c in counts
            ]
            xs = [i + (j - (len(servers) - 1) / 2) * width for i in range(len(counts))]
            ax.bar(xs, values, width, label=server, color=f"C{j % 10}")
            for x, value in zip(xs, values, strict=True):
                ax.text(x, value, f"{value:.0f}" if value >= 10 else f"{value:.1f}",
                        ha="center", va="bottom", fontsize=7)  # fmt: skip
        ax.set_xticks(range(len(counts)))
        ax.set_xticklabels([f"{c} clients" for c in counts], fontsize=8)
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    axes[0].legend(fontsize=7, loc="upper right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_chat_report(
    results: Sequence[ChatLoadResult], out_dir: Path, name: str, title: str = ""
) -> None:
    """NAME.json, NAME.md and, with matplotlib, NAME.png in `out_dir`."""
    write_table(out_dir, name, [r.__dict__ for r in results], chat_markdown(results))
    write_chat_chart(results, out_dir / f"{name}.png", title or name)
