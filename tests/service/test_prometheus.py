"""A real Prometheus server scrapes the service; PromQL sees exactly the requests we sent."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.service.helpers import LiveServer, free_port, make_settings

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


@pytest.mark.slow
@pytest.mark.skipif(
    PROMETHEUS is None,
    reason="no `prometheus` binary: install the Debian package `prometheus` "
    "(`make test` does it when run as root)",
)
def test_prometheus_counts_the_requests_sent(model_dir: Path, tmp_path: Path) -> None:
    assert PROMETHEUS is not None
    with LiveServer(make_settings(model_dir)) as server:
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
            for i in range(REQUESTS):
                body = {"text": f"kamaru tesino {i}", "target_lang": "de", "beam_size": 1}
                response = httpx.post(server.url + "/v1/translate", json=body, timeout=30)
                assert response.status_code == 200
            promql = 'sum(attnserve_requests_total{route="/v1/translate",status="200"})'
            assert wait_for_value(prometheus_url, promql, REQUESTS) == REQUESTS
            tokens = query(prometheus_url, "sum(attnserve_output_tokens_total)")
            assert float(tokens[0]["value"][1]) > 0
        finally:
            process.terminate()
            process.wait(timeout=30)
