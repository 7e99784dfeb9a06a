"""`attnserve loadtest` (`make loadtest`): a locust ladder against a server, with a report.

Starts `attnserve serve --model DIR` on a free port (or targets `--host URL`), then for each user
count of `--users` runs locust headless for `--stage-seconds` (a fresh locust process per stage,
so every stage's statistics are its own), scraping `/metrics` before and after. Writes
`--out/<UTC timestamp>/`: locust's CSVs and log per stage (`u004_stats.csv`, ...), the
locustfile's record (`u004_record.json`), the scrapes, `server.log`, `summary.json`,
`summary.md` and the plots. Exits 1 when a stage had a failure other than 429, or the server's
`attnserve_requests_total` disagrees with what locust sent.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from attnserve.defaults import is_default_lm
from attnserve.loadtest.traffic import (
    DEFAULT_BEAMS,
    DEFAULT_WEIGHTS,
    TrafficConfig,
    parse_mapping,
)

log = logging.getLogger(__name__)

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
STOP_GRACE_SECONDS = 5.0


def _traffic(args: argparse.Namespace) -> TrafficConfig:
    return TrafficConfig(
        weights=parse_mapping(args.weights, DEFAULT_WEIGHTS),
        beams=parse_mapping(args.beams, DEFAULT_BEAMS),
        batch_size=args.batch_size,
        deadline_ms=args.deadline_ms,
        max_new_tokens=args.max_new_tokens,
        sentences=args.sentences,
        max_chars=args.max_chars,
        wait_seconds=args.wait_seconds,
        seed=args.seed,
        mix=args.mix,
        allow_empty=args.allow_empty,
    )


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET with the API key of ATTNSERVE_API_KEY, as the locust users send it."""
    key = os.environ.get("ATTNSERVE_API_KEY")
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tail(path: Path, lines: int = 20) -> str:
    text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    return "\n".join(text.splitlines()[-lines:])


@contextmanager
def served(args: argparse.Namespace, out: Path) -> Iterator[tuple[str, list[str] | None]]:
    """The base URL to test (and the server command when this process started it)."""
    if args.host is not None:
        url = args.host.rstrip("/")
        try:
            status = _get(url + "/readyz")[0]
        except OSError as exc:
            raise RuntimeError(f"{url} does not answer: {exc}") from exc
        if status != 200:
            raise RuntimeError(f"{url}/readyz answers {status}: the server is not ready")
        yield url, None
        return
    port = free_port()
    command = [sys.executable, "-m", "attnserve.cli", "serve", "--model", str(args.model)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--variant", args.variant]
    if args.threads is not None:
        command += ["--threads", str(args.threads)]
    command += shlex.split(args.serve_args)
    url = f"http://127.0.0.1:{port}"
    log_path = out / "server.log"
    log.info("starting %s (log: %s)", shlex.join(command), log_path)
    with open(log_path, "wb") as server_log:
        process = subprocess.Popen(command, stdout=server_log, stderr=subprocess.STDOUT)
        try:
            wait_ready(url, process, args.ready_timeout, log_path)
            yield url, command
        finally:
            stop_server(process)


def wait_ready(
    url: str,
    process: subprocess.Popen[bytes],
    timeout: float,
    log_path: Path,
    path: str = "/readyz",
) -> None:
    """Until GET url+path answers 200; RuntimeError (with the log's tail) if the server exits
    or `timeout` passes."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}):\n{_tail(log_path)}")
        try:
            if _get(url + path, timeout=2.0)[0] == 200:
                return
        except OSError:
            pass  # not listening yet
        time.sleep(0.5)
    raise RuntimeError(f"the server was not ready in {timeout:.0f} s:\n{_tail(log_path)}")


def stop_server(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the server drains), then SIGKILL if it does not exit."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run_locust(url: str, users: int, seconds: float, config: TrafficConfig, prefix: Path) -> Path:
    """One headless locust run; returns the path of its record (JSON)."""
    record = prefix.with_name(prefix.name + "_record.json")
    config = replace(config, record=record)
    stop_timeout = config.client_timeout + STOP_GRACE_SECONDS
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless"]
    command += ["-u", str(users), "-r", str(users), "-t", f"{seconds:g}s", "--host", url]
    command += ["--csv", str(prefix), "--csv-full-history", "--only-summary"]
    command += ["--stop-timeout", f"{stop_timeout:g}", "--exit-code-on-error", "0"]
    log_path = prefix.with_name(prefix.name + "_locust.log")
    env = {**os.environ, **config.to_env()}
    with open(log_path, "wb") as locust_log:
        code = subprocess.call(command, env=env, stdout=locust_log, stderr=subprocess.STDOUT)
    if code != 0 or not record.is_file():
        raise RuntimeError(f"locust failed (exit {code}):\n{_tail(log_path)}")
    return record


def _write(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")


def _meta(args: argparse.Namespace, url: str, command: list[str] | None) -> dict[str, Any]:
    import importlib.metadata

    from attnserve.loadtest.report import machine

    models = json.loads(_get(url + "/v1/models")[1]).get("data", [])
    default = next((m for m in models if m.get("default")), models[0] if models else {})
    title = args.title or (
        f"{default.get('id')} ({default.get('backend')} {default.get('variant') or ''}, "
        f"{default.get('provider')}), {args.stage_seconds:g} s per stage"
    )
    versions: dict[str, str | None] = {}
    for package in ("attnserve", "locust", "onnxruntime"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    traffic = _traffic(args)
    return {
        "title": title,
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "url": url,
        "server_command": shlex.join(command) if command else None,
        "stage_seconds": args.stage_seconds,
        "traffic": {k: str(v) for k, v in traffic.to_env().items()},
        "models": models,
        "machine": machine(),
        "versions": versions,
    }


def cmd_loadtest(args: argparse.Namespace) -> int:
    from attnserve.loadtest.plots import write_plots
    from attnserve.loadtest.report import write_summary

    ladder = [int(u) for u in args.users.split(",") if u.strip()]
    if not ladder or min(ladder) < 1:
        raise ValueError("--users: a comma-separated list of positive user counts")
    for model in [] if args.host is not None else str(args.model).split(","):
        # the default language model's directory is made by the server's first start
        if not (Path(model) / "config.json").is_file() and not is_default_lm(model):
            raise FileNotFoundError(
                f"model directory {model} does not exist or has no config.json; pass --model "
                "DIR[,DIR...] (make loadtest LOADTEST_MODEL=DIR) or --host URL of a running server"
            )
    out: Path = args.out / datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=False)
    try:
        stages, meta = _run_ladder(args, ladder, _traffic(args), out)
    except (RuntimeError, OSError) as exc:  # the server or locust failed: logs say why
        log.error("%s", exc)
        if not any(out.iterdir()):
            out.rmdir()
        return 1
    written = write_summary(out, stages, meta)
    written += write_plots(stages, out, meta["title"])
    for path in written:
        log.info("wrote %s", path)
    verdict = json.loads((out / "summary.json").read_text())["verdict"]
    sys.stdout.write(json.dumps({"results": str(out), **verdict}) + "\n")
    ok = verdict["unexpected_failures"] == 0 and verdict["counters_match"] is not False
    if not ok:
        log.error("failures other than 429, or counters that disagree: see %s", out)
    return 0 if ok else 1


def _run_ladder(
    args: argparse.Namespace, ladder: list[int], config: TrafficConfig, out: Path
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every stage's summary, and what was tested."""
    from attnserve.loadtest.counters import scrape, settle
    from attnserve.loadtest.report import load_stage
    from attnserve.loadtest.sentences import held_out_sentences, write_tsv
    from attnserve.loadtest.traffic import Record

    stages = []
    with served(args, out) as (url, command):
        meta = _meta(args, url, command)
        if config.sentences is None:
            # Read the test books once, not in every stage's locust (whose clock runs meanwhile).
            tsv = write_tsv(held_out_sentences(), out / "sentences.tsv")
            config = replace(config, sentences=tsv)
        for users in ladder:
            prefix = out / f"u{users:03d}"
            log.info("stage: %d users for %g s", users, args.stage_seconds)
            before = scrape(url)
            record = run_locust(url, users, args.stage_seconds, config, prefix)
            check, after = settle(before, Record.load(record).responses, lambda: scrape(url))
            _write(prefix.with_name(prefix.name + "_metrics_before.txt"), before)
            _write(prefix.with_name(prefix.name + "_metrics_after.txt"), after)
            stage = load_stage(prefix, users, check)
            stages.append(stage)
            _log_stage(stage)
    return stages, meta


def _log_stage(stage: dict[str, Any]) -> None:
    latency = stage["latency_ms"]
    log.info(
        "%d users: %.1f successful req/s, %.0f tokens/s, p50 %s ms, p95 %s ms, p99 %s ms, "
        "errors %s, counters %s",
        stage["users"],
        stage["ok_requests_per_s"],
        stage["target_tokens_per_s"],
        latency["p50"],
        latency["p95"],
        latency["p99"],
        stage["errors_by_status"] or "none",
        "equal" if stage["counters"]["match"] else "DIFFER",
    )
