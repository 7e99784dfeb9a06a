"""A real Prometheus server scrapes the service; PromQL sees exactly the requests we sent."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.service.helpers import LiveServer, free_port, make_settings, slow_factory

PROMETHEUS = shutil.which("prometheus")
REQUESTS = 7


def query(url: str, promql: str) -> list[dict[str, Any]]:
    response = httpx.get(url + "/api/v1/query", params={"query": promql}, timeout=5)
    response.raise_for_status()
    result: list[dict[str, Any]] = response.json()["data"]["result"]
    return result


def wait_for_value(url: str, promql: str, expected: float, timeout: float = 30.0) -> float | None:
    """Poll the query until its single value equals `expected`; returns the last value."""
    end = time.monotonic() + timeout
    value = None
    while time.monotonic() < end:
        try:
            result = query(url, promql)
        except httpx.HTTPError:  # not listening yet, or 503 while its storage starts
            result = []
        if result:
            value = float(result[0]["value"][1])
            if value == expected:
                return value
        time.sleep(0.25)
    return value


@contextlib.contextmanager
def prometheus(server: LiveServer, tmp_path: Path) -> Iterator[str]:
    """A Prometheus server scraping `server` every second; yields its URL once it is up."""
    assert PROMETHEUS is not None
    target = server.url.removeprefix("http://")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: attnserve\n    scrape_interval: 1s\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
    )
    prometheus_url = f"http://127.0.0.1:{free_port()}"
    with (tmp_path / "prometheus.log").open("wb") as log:
        process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address={prometheus_url.removeprefix('http://')}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        assert wait_for_value(prometheus_url, 'up{job="attnserve"}', 1.0) == 1.0
        yield prometheus_url
    finally:
        process.terminate()
        process.wait(timeout=30)


NO_PROMETHEUS = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="no `prometheus` binary: install the Debian package `prometheus` "
    "(`make test` does it when run as root)",
)


@pytest.mark.slow
@NO_PROMETHEUS
def test_prometheus_counts_the_requests_sent(model_dir: Path, tmp_path: Path) -> None:
    with LiveServer(make_settings(model_dir)) as server, prometheus(server, tmp_path) as url:
        for i in range(REQUESTS):
            body = {"text": f"kamaru tesino {i}", "target_lang": "de", "beam_size": 1}
            response = httpx.post(server.url + "/v1/translate", json=body, timeout=30)
            assert response.status_code == 200
        promql = 'sum(attnserve_requests_total{route="/v1/translate",status="200"})'
        assert wait_for_value(url, promql, REQUESTS) == REQUESTS
        tokens = query(url, "sum(attnserve_output_tokens_total)")
        assert float(tokens[0]["value"][1]) > 0


@pytest.mark.slow
@NO_PROMETHEUS
def test_the_router_gauges_move_as_requests_queue_and_finish(
    model_dir: Path, tmp_path: Path
) -> None:
    """What a load-aware router reads (queued, running, KV-cache utilisation) rises while
    requests wait for a full batch (two rows, 0.1 s a step) and falls back to 0 after."""
    settings = make_settings(model_dir, max_batch_rows=2, join_rows=0)
    with (
        LiveServer(settings, backend_factory=slow_factory(0.1)) as server,
        prometheus(server, tmp_path) as url,
    ):
        body = {"text": "kamaru tesino", "target_lang": "de", "beam_size": 1,
                "max_new_tokens": 30, "min_new_tokens": 30}  # fmt: skip

        def send(_: int) -> int:
            return httpx.post(server.url + "/v1/generate", json=body, timeout=120).status_code

        with ThreadPoolExecutor(8) as pool:
            statuses = pool.map(send, range(8))
            for name, least in (
                ("attnserve_requests_waiting", 1.0),
                ("attnserve_requests_running", 2.0),
                ("attnserve_kv_cache_usage_perc", 1e-6),
            ):
                promql = f"max_over_time({name}[1m]) >= bool {least}"
                assert wait_for_value(url, promql, 1.0, timeout=60) == 1.0, name
            assert list(statuses) == [200] * 8
        for name in (
            "attnserve_requests_waiting",
            "attnserve_requests_running",
            "attnserve_kv_cache_usage_perc",
        ):
            assert wait_for_value(url, f"sum({name})", 0.0) == 0.0, name
