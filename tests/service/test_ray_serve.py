"""`attnserve serve --replicas 2` on a real local Ray: both model kinds through Serve's HTTP
proxy, requests spread over the replicas, a replica killed under load, a clean shutdown.

One server for the module (Ray's start-up costs seconds): the command line runs in its own
process with its own Ray temporary directory and an environment marker, which every process
it starts inherits, so the test finds the replicas to kill and checks that none is left.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("ray.serve", reason="the ray extra: pip install 'attnserve[ray]'")

from attnserve.service.ray_serve import REPLICA_HEADER
from tests.service.helpers import free_port

pytestmark = pytest.mark.slow

MARKER_ENV = "ATTNSERVE_TEST_RAY_MARKER"
START_TIMEOUT_S = 300.0  # Ray, Serve and two replicas on a loaded two-core machine


def processes_with(marker: str) -> dict[int, str]:
    """pid -> command line of every process whose environment holds `marker`."""
    found: dict[int, str] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker.encode() in (proc / "environ").read_bytes():
                found[int(proc.name)] = (
                    (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                )
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


@dataclass
class RayServer:
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    marker: str

    def replica_pids(self) -> list[int]:
        found = processes_with(f"{MARKER_ENV}={self.marker}")
        return sorted(pid for pid, cmd in found.items() if cmd.startswith("ray::ServeReplica"))

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def ray_server(model_dir: Path, lm_model: Path) -> Iterator[RayServer]:
    # Short: Ray's Unix sockets live under it (a path of at most 107 bytes).
    tmp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        {
            MARKER_ENV: marker,
            "RAY_TMPDIR": str(tmp),
            "HOME": str(tmp),  # Ray writes its token under ~/.ray
            "RAY_USAGE_STATS_ENABLED": "0",
        }
    )
    port = free_port()
    models = f"{model_dir},{lm_model}"
    command = [
        sys.executable, "-m", "attnserve.cli", "serve", "--model", models, "--variant", "int8",
        "--provider", "cpu", "--replicas", "2", "--threads", "1", "--port", str(port),
        "--no-log-json", "--no-auto-export", "--drain-seconds", "5",
    ]  # fmt: skip
    log = tmp / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    server = RayServer(f"http://127.0.0.1:{port}", process, log, marker)
    try:
        end = time.monotonic() + START_TIMEOUT_S
        while "serving on" not in server.log_text():
            if process.poll() is not None or time.monotonic() > end:
                pytest.fail(f"the replicas did not start:\n{server.log_text()[-6000:]}")
            time.sleep(0.5)
        yield server
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
        for pid in processes_with(f"{MARKER_ENV}={marker}"):  # only processes this test started
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


def test_both_model_kinds_and_both_apis(
    ray_server: RayServer, model_dir: Path, lm_model: Path
) -> None:
    lm = lm_model.name
    with httpx.Client(base_url=ray_server.url, timeout=60) as http:
        translated = http.post(
            "/v1/translate", json={"text": ["Hello.", "Good day."], "target_lang": "de"}
        )
        assert translated.status_code == 200, translated.text
        assert len(translated.json()["translations"]) == 2
        generated = http.post(
            "/v1/generate", json={"model": lm, "text": "Hello", "max_new_tokens": 5}
        )
        assert generated.status_code == 200, generated.text
        assert generated.json()["translations"][0]["output_tokens"] > 0
        chat = http.post(
            "/v1/chat/completions",
            json={"model": lm, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5},
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["role"] == "assistant"
        for model in (lm, model_dir.name):  # a language model completes, a translation translates
            body: dict[str, Any] = {"model": model, "prompt": "Hello", "max_tokens": 5}
            if model == model_dir.name:
                body["target_lang"] = "de"
            completion = http.post("/v1/completions", json=body)
            assert completion.status_code == 200, completion.text
            assert completion.json()["object"] == "text_completion"
        body = {"model": lm, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
            assert stream.status_code == 200
            lines = [line for line in stream.iter_lines() if line.startswith("data:")]
        assert lines[-1] == "data: [DONE]"
        models = {m["id"]: m["kind"] for m in http.get("/v1/models").json()["data"]}
        assert models == {model_dir.name: "translation", lm: "generation"}


def test_requests_spread_over_both_replicas(ray_server: RayServer) -> None:
    async def send(count: int) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=ray_server.url, timeout=60) as http:
            body = {"text": "Hello there, my friend.", "target_lang": "de"}
            return list(
                await asyncio.gather(*(http.post("/v1/translate", json=body) for _ in range(count)))
            )

    answers = asyncio.run(send(24))
    assert {a.status_code for a in answers} == {200}
    assert len({a.headers[REPLICA_HEADER] for a in answers}) == 2
    # One X-Request-ID (Serve's proxy adds its own to the replica's), the client's when sent.
    answer = httpx.post(
        ray_server.url + "/v1/translate",
        json={"text": "Hi.", "target_lang": "de"},
        headers={"X-Request-ID": "mine-1"},
        timeout=60,
    )
    assert answer.headers.get_list("x-request-id") == ["mine-1"]
    # Each replica has its own metrics: /metrics answers from one of them.
    metrics = httpx.get(ray_server.url + "/metrics", timeout=30)
    assert metrics.status_code == 200 and "attnserve_requests_total" in metrics.text


@dataclass
class Outcome:
    sent: float  # seconds since the load started
    seconds: float
    status: int | str  # an HTTP status, or the transport error's name
    retry_after: str | None = None
    replica: str | None = None
    error_type: str | None = None


async def closed_loop(url: str, clients: int, seconds: float, lm: str) -> list[Outcome]:
    """`clients` clients each sending one request at a time (translations and streaming chats)."""
    outcomes: list[Outcome] = []
    start = time.perf_counter()
    text = "The weather is nice today and we are going to walk in the park. " * 2
    chat = {"model": lm, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}

    async def one(http: httpx.AsyncClient, index: int) -> None:
        sent = time.perf_counter()
        outcome = Outcome(sent - start, 0.0, 0)
        try:
            if index % 2:
                answer = await http.post("/v1/translate", json={"text": text, "target_lang": "de"})
            else:
                async with http.stream(
                    "POST", "/v1/chat/completions", json={**chat, "stream": True}
                ) as answer:
                    if answer.status_code != 200:
                        await answer.aread()
                    else:
                        lines = [line async for line in answer.aiter_lines() if line]
                        if lines[-1] != "data: [DONE]":
                            raise httpx.RemoteProtocolError("stream ended without [DONE]")
            outcome.status = answer.status_code
            outcome.retry_after = answer.headers.get("retry-after")
            outcome.replica = answer.headers.get(REPLICA_HEADER)
            if answer.status_code != 200:
                outcome.error_type = answer.json()["error"]["type"]
        except httpx.TransportError as exc:  # a stream cut when its replica died
            outcome.status = type(exc).__name__
        outcome.seconds = time.perf_counter() - sent
        outcomes.append(outcome)

    async def client(index: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            while time.perf_counter() - start < seconds:
                await one(http, index)

    await asyncio.gather(*(client(i) for i in range(clients)))
    return outcomes


def test_a_killed_replica(ray_server: RayServer, lm_model: Path) -> None:
    before = ray_server.replica_pids()
    assert len(before) == 2, before

    async def load_and_kill() -> tuple[list[Outcome], float]:
        load = asyncio.create_task(closed_loop(ray_server.url, 6, 8.0, lm_model.name))
        await asyncio.sleep(2.0)
        os.kill(before[0], signal.SIGKILL)
        killed = time.perf_counter()
        outcomes = await load
        return outcomes, killed

    started = time.perf_counter()
    outcomes, killed_at = asyncio.run(load_and_kill())
    killed = killed_at - started
    statuses = sorted({str(o.status) for o in outcomes})
    # In flight on the dead replica: a retryable 503 (or a stream cut after its 200 began).
    for o in outcomes:
        assert o.status in (200, 503, "RemoteProtocolError"), (o, statuses)
        if o.status == 503:
            assert (o.retry_after, o.error_type) == ("1", "unavailable"), o
        assert o.seconds < 30, o  # none hangs
    later = [o for o in outcomes if o.sent > killed + 1.0]
    assert later and all(o.status == 200 for o in later), statuses
    # Serve starts a replica in its place; both answer again.
    end = time.monotonic() + 120
    seen: set[str] = set()
    while len(seen) < 2 or len(ray_server.replica_pids()) < 2:
        assert time.monotonic() < end, ray_server.log_text()[-4000:]
        answer = httpx.post(
            ray_server.url + "/v1/translate", json={"text": "Hi.", "target_lang": "de"}, timeout=60
        )
        assert answer.status_code == 200
        seen.add(answer.headers[REPLICA_HEADER])
    assert set(ray_server.replica_pids()) - set(before)


def test_sigterm_stops_everything(ray_server: RayServer) -> None:
    """Last in the module: the server's SIGTERM stops Serve and Ray, leaving no process."""
    ray_server.process.send_signal(signal.SIGTERM)
    assert ray_server.process.wait(90) == 0, ray_server.log_text()[-4000:]
    assert "engines stopped" in ray_server.log_text()  # the replicas' lifespan shutdown ran
    end = time.monotonic() + 30
    while left := processes_with(f"{MARKER_ENV}={ray_server.marker}"):
        assert time.monotonic() < end, left
        time.sleep(0.5)
