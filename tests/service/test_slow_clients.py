"""Slow and idle clients against a real server process: headers trickled a byte at a time, 500
connections left with part of their headers, a body that never comes, connections past the cap.
Each is answered (408, 503) and closed within its deadline while /healthz stays fast.

The bounds are generous for a loaded 2-core machine; the measured figures are printed (-s)."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.service.helpers import free_port, metric_value
from tests.service.test_drain import REPO, wait_ready

HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 2.0
HALF_OPEN = 500
PARTIAL = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Ag"


@contextmanager
def server(model_dir: Path, log: Path, **env: object) -> Iterator[tuple[str, int]]:
    """`python -m tests.service.slow_server` with ATTNSERVE_* from `env`: (url, pid)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    variables = {f"ATTNSERVE_{k.upper()}": str(v) for k, v in env.items()}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.service.slow_server", str(model_dir), str(port), "0"],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO), **variables},
        )
    try:
        wait_ready(url, process, log)
        yield url, process.pid
    finally:
        process.terminate()
        process.wait(60)


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def healthz_seconds(url: str) -> float:
    started = time.monotonic()
    assert httpx.get(url + "/healthz", timeout=30).status_code == 200
    return time.monotonic() - started


def error_type(answer: bytes) -> str:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower(), head
    return str(json.loads(body)["error"]["type"])


@pytest.fixture(scope="module")
def guarded(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    log = tmp_path_factory.mktemp("slow-clients") / "server.log"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4 * HALF_OPEN:  # the test's own sockets (the server is another process)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4 * HALF_OPEN), hard))
    with server(
        model_dir,
        log,
        header_timeout_seconds=HEADER_TIMEOUT,
        body_timeout_seconds=BODY_TIMEOUT,
    ) as running:
        yield running


@pytest.mark.slow
def test_trickled_headers_get_408_within_the_deadline(guarded: tuple[str, int]) -> None:
    url, _ = guarded
    request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: trickle\r\n\r\n"
    with connect(url) as sock:
        started = time.monotonic()
        answer = b""
        for byte in request:  # 4 bytes a second: the headers would take 16 s
            try:
                sock.sendall(bytes([byte]))
            except OSError:  # closed under us
                break
            sock.settimeout(0.25)
            try:
                answer = sock.recv(65536)
            except TimeoutError:
                continue
            sock.settimeout(30)
            answer += read_all(sock)
            break
        seconds = time.monotonic() - started
    print(f"trickled headers answered after {seconds:.2f} s")
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert error_type(answer) == "request_timeout"
    assert HEADER_TIMEOUT - 0.1 <= seconds <= HEADER_TIMEOUT + 5


@pytest.mark.slow
def test_half_open_connections_are_closed_and_healthz_stays_fast(
    guarded: tuple[str, int],
) -> None:
    url, pid = guarded
    before = metric_value(
        httpx.get(url + "/metrics").text,
        "attnserve_connections_closed_total",
        reason="header_timeout",
    )
    files_before = open_files(pid)
    idle = connect(url)  # a connection that never sends a byte
    sockets = []
    started = time.monotonic()
    for _ in range(HALF_OPEN):
        sock = connect(url)
        sock.sendall(PARTIAL)
        sockets.append(sock)
    opened = time.monotonic() - started
    time.sleep(0.2)
    files_open = open_files(pid)
    gauge = metric_value(httpx.get(url + "/metrics").text, "attnserve_connections_open")
    probes = [healthz_seconds(url) for _ in range(5)]
    answers = []
    for sock in sockets:
        answers.append(read_all(sock))
        sock.close()
    all_closed = time.monotonic() - started
    assert read_all(idle) == b""  # closed without an answer: it asked nothing
    idle.close()
    time.sleep(0.2)
    files_after = open_files(pid)
    closed = metric_value(
        httpx.get(url + "/metrics").text,
        "attnserve_connections_closed_total",
        reason="header_timeout",
    )
    print(
        f"{HALF_OPEN} half-open connections opened in {opened:.2f} s; server open files "
        f"{files_before} -> {files_open} -> {files_after}; /healthz meanwhile "
        f"{min(probes) * 1000:.0f}-{max(probes) * 1000:.0f} ms; all answered 408 and closed "
        f"{all_closed:.2f} s after the first opened"
    )
    assert files_open >= files_before + HALF_OPEN and gauge >= HALF_OPEN
    assert max(probes) < 2.0
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers), {a[:20] for a in answers}
    assert all_closed <= opened + HEADER_TIMEOUT + 10
    assert files_after <= files_before + 5
    assert closed - before >= HALF_OPEN + 1


@pytest.mark.slow
def test_a_body_that_never_comes_gets_408(guarded: tuple[str, int]) -> None:
    url, _ = guarded
    with connect(url) as sock:
        started = time.monotonic()
        sock.sendall(
            b"POST /v1/translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"text": '
        )
        answer = read_all(sock)
        seconds = time.monotonic() - started
    print(f"a missing body answered after {seconds:.2f} s")
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert error_type(answer) == "request_timeout"
    assert BODY_TIMEOUT - 0.1 <= seconds <= BODY_TIMEOUT + 5
    metrics = httpx.get(url + "/metrics").text
    assert metric_value(metrics, "attnserve_connections_closed_total", reason="body_timeout") >= 1
    assert (
        metric_value(metrics, "attnserve_requests_total", route="/v1/translate", status="408") >= 1
    )


@pytest.mark.slow
def test_connections_past_the_cap_get_503(model_dir: Path, tmp_path: Path) -> None:
    cap = 20
    with server(
        model_dir, tmp_path / "server.log", max_connections=cap, header_timeout_seconds=3
    ) as (
        url,
        _,
    ):
        held = [connect(url) for _ in range(cap)]
        for sock in held:
            sock.sendall(PARTIAL)
        time.sleep(0.2)
        with connect(url) as extra:
            extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = read_all(extra)
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert b"retry-after: 1" in answer.lower() and error_type(answer) == "unavailable"
        for sock in held:  # the header deadline frees the places
            read_all(sock)
            sock.close()
        time.sleep(0.2)
        assert httpx.get(url + "/healthz", timeout=10).status_code == 200
        metrics = httpx.get(url + "/metrics").text
        assert (
            metric_value(metrics, "attnserve_connections_closed_total", reason="connection_limit")
            >= 1
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "request_bytes",
    [b"NOT HTTP AT ALL\r\n\r\n", b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20_000],
    ids=["garbage", "headers over 16 KiB"],
)
def test_a_request_that_is_not_http_gets_a_json_400(
    guarded: tuple[str, int], request_bytes: bytes
) -> None:
    url, _ = guarded
    with connect(url) as sock:
        sock.sendall(request_bytes)
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert error_type(answer) == "invalid_request"


@pytest.mark.slow
def test_a_websocket_upgrade_is_plain_http_and_leaves_no_count(guarded: tuple[str, int]) -> None:
    """No WebSocket routes: an Upgrade is answered as HTTP (no protocol takes the socket over),
    so the connection gauge and the header deadline stay the guard's."""
    url, _ = guarded
    upgrade = (
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\n"
        b"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    for _ in range(3):
        with connect(url) as sock:
            sock.sendall(upgrade)
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200"), answer  # /healthz, not 101
    time.sleep(0.3)
    metrics = httpx.get(url + "/metrics").text
    assert metric_value(metrics, "attnserve_connections_open") <= 1  # this scrape's own
