"""SIGTERM on a real server process: /readyz and new requests answer 503 at once, the requests
in flight finish, then the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.service.helpers import free_port, metric_value

KA = {"text": "ka", "target_lang": "de"}  # a short request the tiny model serves

REPO = Path(__file__).resolve().parents[2]
DELAY = 0.05  # seconds per decoder step
TOKENS = 60  # a 3 s request: long enough that the three overlap on a loaded machine


def wait_ready(
    url: str, process: subprocess.Popen[bytes], log: Path, timeout: float = 60.0
) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert process.poll() is None, f"the server exited during start-up:\n{log.read_text()}"
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError("server not ready")


def wait_running(url: str, n: int, timeout: float = 20.0) -> None:
    """Until the server's requests_running gauge reads n (the requests are decoding)."""
    end = time.monotonic() + timeout
    while metric_value(httpx.get(url + "/metrics").text, "attnserve_requests_running") != n:
        assert time.monotonic() < end, "the requests did not start"
        time.sleep(0.02)


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_exits(model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.service.slow_server",
                str(model_dir),
                str(port),
                str(DELAY),
            ],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    try:
        wait_ready(url, process, log_path)
        body = {"text": "kamaru tesino", "target_lang": "de", "max_new_tokens": TOKENS}
        body["min_new_tokens"] = TOKENS
        with ThreadPoolExecutor(3) as pool:
            in_flight = [
                pool.submit(httpx.post, url + "/v1/generate", json=body, timeout=30)
                for _ in range(3)
            ]
            wait_running(url, 3)
            process.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            ready = httpx.get(url + "/readyz", timeout=5)
            assert ready.status_code == 503 and ready.json()["status"] == "draining"
            refused = httpx.post(url + "/v1/translate", json=KA, timeout=5)
            assert refused.status_code == 503
            assert refused.json()["error"]["type"] == "unavailable"
            assert httpx.get(url + "/healthz", timeout=5).status_code == 200
            responses = [f.result() for f in in_flight]
        for response in responses:
            assert response.status_code == 200, response.text
            assert response.json()["translations"][0]["output_tokens"] == TOKENS
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    entries = [json.loads(line) for line in log_path.read_text().splitlines() if line]
    messages = [e["message"] for e in entries]
    assert any(m.startswith("draining: 3 requests in flight") for m in messages), messages
    assert "engines stopped" in messages
    served = {e["request_id"] for e in entries if e.get("route") == "/v1/generate"}
    assert {r.headers["x-request-id"] for r in responses} <= served
