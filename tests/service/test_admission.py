"""Admission and failures: overload, deadlines, disconnects, one failing request, readiness,
the API key and CORS. Decoding is slowed down on purpose (SlowBackend) so that requests overlap.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from attnserve.engine import scheduler as scheduler_module
from attnserve.engine.backend import FloatArray, IntArray, ModelSpec
from attnserve.engine.options import DecodingOptions
from attnserve.engine.search import GreedySearch, Search, make_search
from attnserve.service.models import default_backend_factory
from attnserve.service.settings import Settings
from tests.service.helpers import (
    LiveServer,
    make_settings,
    metric_value,
    slow_factory,
    wait_for_metric,
)

KA = {"text": "ka", "target_lang": "de"}  # a short request the tiny model serves
STEP_DELAY = 0.05  # seconds per decoder step
LONG = 60  # tokens: a 3 s request (the model's limit is 64)
ROWS, WAITING = 4, 4


def long_request(tokens: int, **extra: Any) -> dict[str, Any]:
    """A greedy request that decodes exactly `tokens` steps (tokens * STEP_DELAY seconds)."""
    body = {"text": "kamaru tesino", "target_lang": "de", "min_new_tokens": tokens}
    return {**body, "max_new_tokens": tokens, **extra}


@pytest.fixture(scope="module")
def slow(model_dir: Path) -> Iterator[LiveServer]:
    settings = make_settings(model_dir, variant="fp32", max_batch_rows=ROWS, max_waiting=WAITING)
    with LiveServer(settings, backend_factory=slow_factory(STEP_DELAY)) as server:
        yield server


def running(server: LiveServer) -> float:
    name = server.service.registry.default.name
    return wait_for_metric(server, "attnserve_requests_running", 0.0, timeout=2.0, model=name)


def outcomes(server: LiveServer, outcome: str) -> float:
    name = server.service.registry.default.name
    text = server.metrics()
    return metric_value(text, "attnserve_decoding_requests_total", model=name, outcome=outcome)


def test_overload_answers_200_or_429_then_serves_normally(slow: LiveServer) -> None:
    rejected_before = metric_value(slow.metrics(), "attnserve_rejected_total", reason="queue_full")
    n = 4 * (ROWS + WAITING)
    with ThreadPoolExecutor(n) as pool:
        responses = list(
            pool.map(
                lambda _: httpx.post(slow.url + "/v1/generate", json=long_request(5), timeout=60),
                range(n),
            )
        )
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 429}, statuses
    assert statuses.count(200) >= ROWS
    for response in responses:
        if response.status_code == 429:
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["type"] == "overloaded"
    rejected = metric_value(slow.metrics(), "attnserve_rejected_total", reason="queue_full")
    assert rejected - rejected_before == statuses.count(429)
    after = httpx.post(slow.url + "/v1/generate", json=long_request(2), timeout=60)
    assert after.status_code == 200
    assert running(slow) == 0.0


def test_more_texts_than_the_queue_holds_is_422_not_429(slow: LiveServer) -> None:
    """A request that could never be queued must not be told to retry forever."""
    response = httpx.post(
        slow.url + "/v1/translate", json={"text": ["ka"] * (WAITING + 1)}, timeout=30
    )
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == "text"
    assert f"at most {WAITING}" in response.json()["error"]["message"]


def test_deadline_gives_504_and_frees_the_rows(slow: LiveServer) -> None:
    before = outcomes(slow, "deadline_exceeded")
    started = time.monotonic()
    response = httpx.post(
        slow.url + "/v1/generate", json=long_request(LONG, timeout_ms=200), timeout=60
    )
    assert response.status_code == 504
    assert response.json()["error"]["param"] == "timeout_ms"
    assert time.monotonic() - started < 1.5  # the request alone takes 3 s
    assert running(slow) == 0.0
    assert outcomes(slow, "deadline_exceeded") == before + 1


def test_deadline_while_streaming_ends_with_an_error_event(slow: LiveServer) -> None:
    body = long_request(LONG, timeout_ms=200, stream=True)
    response = httpx.post(slow.url + "/v1/generate", json=body, timeout=60)
    assert response.status_code == 200
    events = [b for b in response.text.split("\n\n") if b]
    assert events[-1] == "data: [DONE]"
    assert '"type": "deadline_exceeded"' in events[-2]
    assert running(slow) == 0.0


def test_client_disconnect_frees_the_rows(slow: LiveServer) -> None:
    before = outcomes(slow, "cancelled")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow.url + "/v1/generate", json=long_request(LONG), timeout=0.3)
    disconnected = time.monotonic()
    assert running(slow) == 0.0
    assert time.monotonic() - disconnected < 1.5  # the request alone takes 3 s
    assert outcomes(slow, "cancelled") == before + 1


def test_streaming_client_disconnect_frees_the_rows(slow: LiveServer) -> None:
    before = outcomes(slow, "cancelled")
    body = long_request(LONG, stream=True)
    with httpx.stream("POST", slow.url + "/v1/generate", json=body, timeout=30) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line)
        assert first.startswith("data: {")
    disconnected = time.monotonic()
    assert running(slow) == 0.0
    assert time.monotonic() - disconnected < 1.5
    assert outcomes(slow, "cancelled") == before + 1


class ExplodingSearch(GreedySearch):
    def step(self, log_probs: FloatArray) -> IntArray:
        if self.steps == 3:
            raise RuntimeError("boom: injected search failure")
        return super().step(log_probs)


def test_a_failing_request_fails_alone(
    slow: LiveServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One request's search raises mid-batch: it gets a 500 with its id, the others finish."""

    def make(options: DecodingOptions, spec: ModelSpec, **kwargs: Any) -> Search:
        if options.seed == 13:
            return ExplodingSearch(options, spec, **kwargs)
        return make_search(options, spec, **kwargs)

    monkeypatch.setattr(scheduler_module, "make_search", make)
    solo = httpx.post(slow.url + "/v1/generate", json=long_request(8), timeout=60).json()
    bodies = [long_request(8, seed=13 if i == 1 else None) for i in range(4)]
    with caplog.at_level(logging.ERROR), ThreadPoolExecutor(4) as pool:
        responses = list(
            pool.map(lambda b: httpx.post(slow.url + "/v1/generate", json=b, timeout=60), bodies)
        )
    assert [r.status_code for r in responses] == [200, 500, 200, 200]
    failed = responses[1]
    request_id = failed.headers["x-request-id"]
    assert failed.json()["error"]["request_id"] == request_id
    assert request_id in failed.json()["error"]["message"]
    assert any(request_id in r.getMessage() for r in caplog.records)
    for ok in (responses[0], responses[2], responses[3]):
        assert ok.json()["translations"] == solo["translations"]
    after = httpx.post(slow.url + "/v1/generate", json=long_request(2), timeout=60)
    assert after.status_code == 200


def test_readiness_while_loading(model_dir: Path) -> None:
    release = threading.Event()

    def blocked(directory: Path, settings: Settings) -> Any:
        release.wait(30)
        return default_backend_factory(directory, settings)

    server = LiveServer(make_settings(model_dir), backend_factory=blocked, wait_ready=False)
    with server:
        assert httpx.get(server.url + "/healthz").status_code == 200
        ready = httpx.get(server.url + "/readyz")
        assert ready.status_code == 503 and ready.json()["status"] == "loading"
        early = httpx.post(server.url + "/v1/translate", json=KA)
        assert early.status_code == 503 and early.json()["error"]["type"] == "unavailable"
        release.set()
        server.wait_ready()
        assert httpx.get(server.url + "/readyz").status_code == 200
        assert httpx.post(server.url + "/v1/translate", json=KA).status_code == 200


def test_api_key(model_dir: Path) -> None:
    # Non-ASCII, ending in "à" (UTF-8 C3 A0: str.strip() would eat the A0).
    with LiveServer(make_settings(model_dir, api_key="s3cret-à")) as server:
        url = server.url
        missing = httpx.get(url + "/v1/models")
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"] == "Bearer"
        assert missing.json()["error"]["type"] == "unauthorized"
        wrong = {"Authorization": "Bearer s3cret-not"}
        assert httpx.post(url + "/v1/translate", json=KA, headers=wrong).status_code == 401
        right = {"Authorization": "Bearer s3cret-à".encode()}  # UTF-8, as curl sends it
        assert httpx.get(url + "/v1/models", headers=right).status_code == 200
        # latin-1, as Python's http.client, urllib and requests send a str header
        as_latin1 = {"Authorization": "Bearer s3cret-à".encode("latin-1")}
        assert httpx.get(url + "/v1/models", headers=as_latin1).status_code == 200
        assert httpx.post(url + "/v1/translate", json=KA, headers=right).status_code == 200
        for open_path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
            assert httpx.get(url + open_path).status_code == 200, open_path
        assert (
            metric_value(server.metrics(), "attnserve_rejected_total", reason="unauthorized") == 2
        )


def test_cors_only_when_configured(model_dir: Path, live: LiveServer) -> None:
    preflight = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    plain = httpx.options(live.url + "/v1/translate", headers=preflight)
    assert "access-control-allow-origin" not in plain.headers
    settings = make_settings(model_dir, cors_origins="https://app.example")
    with LiveServer(settings) as server:
        allowed = httpx.options(server.url + "/v1/translate", headers=preflight)
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(
            server.url + "/v1/translate", headers={**preflight, "Origin": "https://evil.example"}
        )
        assert "access-control-allow-origin" not in other.headers


def test_rows_are_never_left_behind(slow: LiveServer) -> None:
    """After everything above, nothing waits or runs and the engine holds no rows."""
    model = slow.service.registry.default
    assert running(slow) == 0.0
    assert model.engine.scheduler.num_rows == 0 and not model.engine.scheduler.waiting
    assert np.isfinite(
        metric_value(slow.metrics(), "attnserve_decode_step_seconds_sum", model=model.name)
    )


def test_a_request_that_could_never_fit_the_batch_gets_422(model_dir: Path) -> None:
    """Rows x (source + max_new_tokens) over max_batch_tokens: refused before queueing, with
    the parameter to lower, and counted."""
    with LiveServer(make_settings(model_dir, max_batch_tokens=200)) as server:
        body = {**KA, "beam_size": 4, "max_new_tokens": 60}  # 4 x (3 + 60) > 200
        refused = httpx.post(server.url + "/v1/translate", json=body, timeout=30)
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"]["param"] == "max_new_tokens"
        assert "too large" in refused.json()["error"]["message"]
        fits = {**body, "max_new_tokens": 20}  # 4 x (3 + 20) <= 200
        assert httpx.post(server.url + "/v1/translate", json=fits, timeout=30).status_code == 200
        metrics = server.metrics()
        assert metric_value(metrics, "attnserve_rejected_total", reason="request_too_large") == 1
