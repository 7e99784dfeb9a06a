"""`attnserve bench-http`: the service at saturation against offline `translate`, and
continuous against request-level batching, on the same sentences.

Each repeat runs, one after the other (round-robin, so a change of machine load hits all alike):

- offline: the `Translator` of `attnserve translate` (length-sorted batches of `--batch-size`
  sentences) on all sentences;
- one server per mode (`--modes`: `continuous`, `request`, `static` or LABEL=SERVE FLAGS;
  started once, `--max-batch-rows` = batch size x beam so a batch holds as many sentences as
  offline), driven by `--concurrency` asyncio clients that each send one request at a time until
  every sentence was sent: a closed loop (it saturates the server once there are enough clients).

With `--in-process` the modes run without HTTP: each mode's flags make the scheduler limits the
server would use, and a closed loop of `--concurrency` requests drives a `Scheduler` on the
offline translator's backend directly (engine-<mode>), so the batching policy is measured apart
from the HTTP stack; it also reports decoder steps and rows per step.

`--concurrency` may be a ladder (`4,8,16,64`): every level runs its repeats (offline included,
so each ratio is taken side by side) on the same servers, the table gets a `clients` column and,
with `--output-dir`, NAME.png plots tokens/s and the p99 latency against clients.

Target tokens are counted the same way on both sides (`output_tokens`, the server's `usage`).
With `--mixed`, the sentences alternate between the shortest and the longest third of the
test books, and latencies are reported per class (short / long).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shlex
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from attnserve.loadtest.sentences import LanguagePool

log = logging.getLogger(__name__)

MODES = ("continuous", "request", "static")


@dataclass
class Work:
    texts: list[str]
    kinds: list[str]  # "short" / "long" / "any", per text


@dataclass
class Run:
    """One pass of one system over all sentences."""

    system: str  # "offline" or "http-<mode>"
    repeat: int
    seconds: float
    output_tokens: int
    latency_ms: dict[str, dict[str, float]]  # kind -> p50/p99 (not offline)
    detail: dict[str, float] = field(default_factory=dict)  # in-process: steps, rows per step
    clients: int = 0  # the --concurrency level it ran at (offline: the level it was paired with)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def concurrency_levels(text: str) -> list[int]:
    """--concurrency: one client count or a comma-separated ladder of them."""
    try:
        levels = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of client counts: {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"client counts must be >= 1: {text!r}")
    return list(dict.fromkeys(levels))  # each level once, in the order given


def choose_work(pool: LanguagePool, count: int, mixed: bool, seed: int) -> Work:
    rng = random.Random(seed)
    if not mixed:
        texts = [rng.choice(pool.all) for _ in range(count)]
        return Work(texts, ["any"] * count)
    kinds = ["short" if i % 2 == 0 else "long" for i in range(count)]
    return Work([rng.choice(pool.short if k == "short" else pool.long) for k in kinds], kinds)


def percentiles(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {}

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": round(at(0.50), 1), "p99": round(at(0.99), 1), "n": len(ordered)}


async def drive(
    url: str, work: Work, body: dict[str, Any], concurrency: int
) -> tuple[float, int, dict[str, dict[str, float]]]:
    """Send every text as its own request, `concurrency` at a time; wall seconds, output
    tokens and latency percentiles per kind. Any answer but 200 is an error."""
    import httpx

    todo = iter(range(len(work.texts)))
    latencies: dict[str, list[float]] = {}
    tokens = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        for i in todo:
            sent = time.perf_counter()
            response = await http.post(url + "/v1/translate", json={**body, "text": work.texts[i]})
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
            tokens += int(response.json()["usage"]["output_tokens"])
            elapsed = (time.perf_counter() - sent) * 1000
            latencies.setdefault(work.kinds[i], []).append(elapsed)
            latencies.setdefault("all", []).append(elapsed)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    return seconds, tokens, {kind: percentiles(v) for kind, v in latencies.items()}


def cmd_bench_http(args: argparse.Namespace) -> int:
    from contextlib import ExitStack

    from attnserve.engine.options import DecodingOptions
    from attnserve.engine.scheduler import Scheduler
    from attnserve.loadtest.runner import served
    from attnserve.loadtest.sentences import load_pools
    from attnserve.provision import Runtime, load_translator

    mode_args = dict(mode_serve_args(m) for m in args.modes.split(",") if m)
    modes = list(mode_args)
    pool = load_pools(max_chars=args.max_chars)[args.source_lang]
    work = choose_work(pool, args.sentences, args.mixed, args.seed)
    translator = load_translator(args.model, Runtime(variant=args.variant, threads=args.threads))
    max_new = translator.defaults.max_new_tokens
    options = DecodingOptions(beam_size=args.beam_size, max_new_tokens=max_new)
    body: dict[str, Any] = {"beam_size": args.beam_size, "max_new_tokens": max_new}
    # A single-direction model has no target-language tags: send no languages then.
    target_lang = args.target_lang if translator.tokenizer.target_languages else None
    if target_lang is not None:
        body["target_lang"] = target_lang
    rows = args.batch_size * args.beam_size
    runs: list[Run] = []
    serve_args = {
        mode: f"{flags} --max-batch-rows {rows} --max-waiting {max(256, *args.concurrency)} "
        f"--log-level warning {args.serve_args}"
        for mode, flags in mode_args.items()
    }
    if args.in_process:
        sources = [translator.encode(t, target_lang) for t in work.texts]
        limits = {mode: engine_limits(args.model, serve_args[mode], max_new) for mode in modes}
        for clients, repeat in rounds(args):
            runs.append(offline_run(translator, work, options, target_lang, args, repeat, clients))
            for mode in modes:
                scheduler = Scheduler(translator.backend, limits[mode])
                run = drive_engine(scheduler, sources, work.kinds, options, clients)
                run.system, run.repeat, run.clients = f"engine-{mode}", repeat, clients
                runs.append(run)
                log.info("engine %s, %d clients: %.0f tok/s", mode, clients, run.tokens_per_second)
        return report(runs, args)
    with ExitStack() as stack:
        urls = {}
        for mode in modes:
            server = argparse.Namespace(
                host=None,
                model=args.model,
                variant=args.variant,
                threads=args.threads,
                serve_args=serve_args[mode],
                ready_timeout=900.0,
            )
            out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="attnserve-")))
            urls[mode] = stack.enter_context(served(server, out))[0]
        for clients, repeat in rounds(args):
            runs.append(offline_run(translator, work, options, target_lang, args, repeat, clients))
            for mode in modes:
                seconds, tokens, latency = asyncio.run(drive(urls[mode], work, body, clients))
                run = Run(f"http-{mode}", repeat, seconds, tokens, latency, clients=clients)
                runs.append(run)
                log.info("http %s, %d clients: %.0f tok/s", mode, clients, run.tokens_per_second)
    return report(runs, args)


def rounds(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(clients, repeat) in the order they run: every repeat of one level, then the next."""
    return [(clients, r) for clients in args.concurrency for r in range(args.repeats)]


def offline_run(
    translator: Any,
    work: Work,
    options: Any,
    target_lang: str | None,
    args: argparse.Namespace,
    repeat: int,
    clients: int,
) -> Run:
    started = time.perf_counter()
    done = translator.translate(
        work.texts,
        options,
        target_lang=target_lang,
        max_batch_size=args.batch_size,
        max_batch_rows=args.batch_size * args.beam_size,
    )
    seconds = time.perf_counter() - started
    run = Run("offline", repeat, seconds, sum(t.output_tokens for t in done), {}, clients=clients)
    log.info("offline (%d clients' round): %.0f tok/s", clients, run.tokens_per_second)
    return run


def engine_limits(model: Path, flags: str, max_new_tokens: int) -> Any:
    """The SchedulerLimits `attnserve serve --model MODEL FLAGS` would give its model."""
    from attnserve.service.launch import add_arguments, settings_from_args
    from attnserve.service.models import scheduler_limits

    parser = argparse.ArgumentParser(prog="attnserve serve", exit_on_error=False)
    add_arguments(parser)
    settings = settings_from_args(parser.parse_args(["--model", str(model), *shlex.split(flags)]))
    return scheduler_limits(settings, max_new_tokens)


def drive_engine(
    scheduler: Any,
    sources: Sequence[Sequence[int]],
    kinds: Sequence[str],
    options: Any,
    concurrency: int,
) -> Run:
    """A closed loop straight on a Scheduler: `concurrency` requests in flight, the next one
    submitted as soon as one ends (the engine thread's loop, without HTTP)."""
    from attnserve.engine.scheduler import Outcome, Request

    todo = iter(range(len(sources)))
    latencies: dict[str, list[float]] = {}
    tokens = steps = rows = 0

    def submit_next() -> None:
        i = next(todo, None)
        if i is not None:
            scheduler.submit(Request(str(i), list(sources[i]), options))

    started = time.perf_counter()
    for _ in range(concurrency):
        submit_next()
    while scheduler.has_work:
        events = scheduler.step()
        steps += 1
        rows += events.batch_rows
        for request in events.ended:
            if request.outcome is not Outcome.DONE:
                raise RuntimeError(f"request {request.id}: {request.outcome} {request.error}")
            tokens += request.output_tokens
            elapsed = (request.finished - request.arrived) * 1000
            latencies.setdefault(kinds[int(request.id)], []).append(elapsed)
            latencies.setdefault("all", []).append(elapsed)
            submit_next()
    seconds = time.perf_counter() - started
    detail = {"steps": float(steps), "rows_per_step": rows / max(steps, 1)}
    latency = {kind: percentiles(v) for kind, v in latencies.items()}
    return Run("engine", 0, seconds, tokens, latency, detail)


def report(runs: Sequence[Run], args: argparse.Namespace) -> int:
    from attnserve.loadtest.report import machine

    table = summary(runs)
    print(table)
    if args.output_dir is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        info = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
        lines = [json.dumps({**asdict(r), **info}) for r in runs]
        (args.output_dir / f"{args.name}.jsonl").write_text("\n".join(lines) + "\n")
        (args.output_dir / f"{args.name}.md").write_text(table + "\n")
        if len(args.concurrency) > 1:
            from attnserve.loadtest.plots import plot_bench_ladder

            title = (
                f"{args.model.name} {args.variant}, beam {args.beam_size}, "
                f"{'mixed short/long' if args.mixed else 'random'} sentences, "
                f"{'in process' if args.in_process else 'HTTP'}"
            )
            plot_bench_ladder(ladder_series(runs), args.output_dir / f"{args.name}.png", title)
    return 0


def mode_serve_args(mode: str) -> tuple[str, str]:
    """A --modes entry -> (label, `attnserve serve` flags): a batching mode, or LABEL=FLAGS."""
    if mode in MODES:
        return mode, f"--batching {mode}"
    label, eq, flags = mode.partition("=")
    if not eq or not label.strip() or not flags.strip():
        raise ValueError(
            f"--modes: {mode!r}; give continuous, request, static or LABEL=SERVE FLAGS"
        )
    return label.strip(), flags.strip()


def summary(runs: Sequence[Run]) -> str:
    """A markdown table: median tokens/s per system, its ratio to offline (of the same client
    level), latencies; a `clients` column first when the runs are a ladder of levels."""
    levels = list(dict.fromkeys(r.clients for r in runs))
    ladder = len(levels) > 1
    head = "| system | tokens/s (median) | vs offline | runs | latency p50 / p99 ms (last run) |"
    lines = ["| clients " + head if ladder else head, "|---" * (6 if ladder else 5) + "|"]
    for level in levels:
        at = [r for r in runs if r.clients == level]
        systems = list(dict.fromkeys(r.system for r in at))
        median = {s: median_tokens_per_second(at, s) for s in systems}
        for s in systems:
            mine = [r for r in at if r.system == s]
            latency = "; ".join(
                f"{kind} {p['p50']:.0f} / {p['p99']:.0f}" for kind, p in mine[-1].latency_ms.items()
            )
            if mine[-1].detail:
                detail = mine[-1].detail
                latency += f"; {detail['steps']:.0f} steps of {detail['rows_per_step']:.0f} rows"
            each = ", ".join(f"{r.tokens_per_second:.0f}" for r in mine)
            ratio = median[s] / median["offline"] if "offline" in median else float("nan")
            row = f"| {s} | {median[s]:.0f} | {ratio:.2f}x | {each} | {latency or '-'} |"
            lines.append(f"| {level} {row}" if ladder else row)
    return "\n".join(lines)


def median_tokens_per_second(runs: Sequence[Run], system: str) -> float:
    return statistics.median(r.tokens_per_second for r in runs if r.system == system)


def ladder_series(runs: Sequence[Run]) -> dict[str, dict[str, list[float]]]:
    """Per system, over the client levels (ascending): median tokens/s and median p99 latency
    (of the short requests on a mixed load, else of all), for the ladder plot."""
    levels = sorted({r.clients for r in runs})
    series: dict[str, dict[str, list[float]]] = {}
    for system in dict.fromkeys(r.system for r in runs):
        tokens, p99 = [], []
        for level in levels:
            mine = [r for r in runs if r.system == system and r.clients == level]
            tokens.append(median_tokens_per_second(mine, system) if mine else float("nan"))
            tails = [
                (r.latency_ms.get("short") or r.latency_ms.get("all") or {}).get("p99")
                for r in mine
            ]
            known = [float(t) for t in tails if t is not None]
            p99.append(statistics.median(known) if known else float("nan"))
        series[system] = {"clients": [float(v) for v in levels], "tokens": tokens, "p99": p99}
    return series
