"""Locust users for attnserve: the traffic shapes of `traffic.py`, weighted by environment.

    locust -f attnserve/loadtest/locustfile.py --host http://127.0.0.1:8000

Shapes (weights: ATTNSERVE_LOADTEST_WEIGHTS, default short=4,long=2,batch=1,stream=3,chat=2,
chat_stream=2; beams: ATTNSERVE_LOADTEST_BEAMS): a short test sentence at beam 1, a long one at
beam 4, a batch of ATTNSERVE_LOADTEST_BATCH_SIZE sentences in one request at beam 4, and a
/v1/generate stream with sampling (its time to first token is recorded) to the translation
model; and, when the server serves a language model, OpenAI chat completions to it, plain and
streamed (a question about a test sentence, sampled). With ATTNSERVE_LOADTEST_MIX=requests (default)
the MixedTraffic user draws every request's shape by the weights, so each user count sends the
same mix; with `users`, the classes ShortTranslation, LongTranslation, BatchTranslation and
StreamingGeneration, Chat and StreamingChat each keep one shape and locust splits the users
between them by weight (a class whose model the server does not serve draws another shape).
Sentences: the held-out test books in both languages (or ATTNSERVE_LOADTEST_SENTENCES, a TSV),
each request in a random direction the model serves. Every answer is checked (status, a
non-empty text per input, a complete stream); anything else is a locust failure named after
what went wrong (`HTTP 429 overloaded`, `stream error ...`). The other settings are in
`TrafficConfig`. This module imports locust, which patches the standard library with gevent:
never import it from attnserve itself.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
import urllib.error
import urllib.request
from typing import Any

import gevent
from locust import FastHttpUser, events, task
from locust.stats import CSV_STATS_INTERVAL_SEC

from attnserve.loadtest.sentences import load_pools
from attnserve.loadtest.traffic import (
    Record,
    StreamState,
    Traffic,
    TrafficConfig,
    chat_problem,
    chat_usage,
    directions_for,
    http_problem,
    json_problem,
    pick_models,
    route_of,
)

log = logging.getLogger("attnserve.loadtest")

CONFIG = TrafficConfig.from_env()
RECORD = Record()
HEADERS = {"Content-Type": "application/json"}
if os.environ.get("ATTNSERVE_API_KEY"):
    HEADERS["Authorization"] = "Bearer " + os.environ["ATTNSERVE_API_KEY"]
_traffic: list[Traffic] = []  # set once the served model is known (test_start)


def _served_models(host: str) -> list[dict[str, Any]]:
    """GET /v1/models (counted like every request)."""
    request = urllib.request.Request(host.rstrip("/") + "/v1/models", headers=HEADERS)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            RECORD.count("/v1/models", response.status)
            return list(json.load(response)["data"])
    except urllib.error.HTTPError as exc:
        RECORD.count("/v1/models", exc.code)
        raise


@events.test_start.add_listener
def _on_start(environment: Any, **_: Any) -> None:
    RECORD.started = time.time()
    pools = load_pools(CONFIG.sentences, CONFIG.max_chars)
    try:
        model, lm_model = pick_models(
            _served_models(environment.host), CONFIG.model, CONFIG.lm_model
        )
        directions = directions_for(model, list(pools)) if model is not None else []
        traffic = Traffic(CONFIG, pools, directions, lm_model=lm_model)
    except Exception:
        log.exception("cannot start the load test")
        environment.process_exit_code = 2
        environment.runner.quit()
        raise
    name = model["id"] if model is not None else None
    log.info("model %s, directions %s, language model %s", name, directions, lm_model)
    _traffic[:] = [traffic]


@events.request.add_listener
def _on_request(
    name: str, response_time: float, response: Any = None, exception: Any = None, **_: Any
) -> None:
    RECORD.count(route_of(name), getattr(response, "status_code", 0) or 0)
    if exception is None:
        RECORD.add_latency(name, response_time)


@events.test_stop.add_listener
def _on_stop(environment: Any, **_: Any) -> None:
    RECORD.ended = time.time()
    if CONFIG.record is not None:
        RECORD.save(CONFIG.record)
    # Locust rewrites its --csv files every second and not at exit: give its writer one more
    # turn now that every user has stopped, so the CSVs hold the final counts.
    gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.5)


class TrafficUser(FastHttpUser):
    """Sends its shape's requests back to back (plus ATTNSERVE_LOADTEST_WAIT_SECONDS), and
    after a 429 waits the Retry-After seconds, as a well-behaved client does."""

    abstract = True
    shape: str | None = None  # None: drawn per request by the weights
    network_timeout = CONFIG.client_timeout
    connection_timeout = 10.0
    _retry_after = 0.0

    def wait_time(self) -> float:
        backoff, self._retry_after = self._retry_after, 0.0
        return max(backoff, random.uniform(0, CONFIG.wait_seconds))

    @task
    def send(self) -> None:
        planned = _traffic[0].next(self.shape)
        start = time.perf_counter()
        with self.client.post(
            planned.route,
            json=planned.body,
            name=planned.name,
            headers=HEADERS,
            stream=planned.stream,
            catch_response=True,
        ) as response:
            problem: str | None
            if response.status_code != 200:
                problem = _error(response)
                if response.status_code == 429:
                    self._retry_after = _retry_after(response)
            elif planned.stream:
                problem = self._read_stream(response, start)
            elif planned.chat:
                problem = self._check_chat(response)
            else:
                problem = self._check_json(response, planned.texts)
            if problem is None:
                response.success()
            else:
                response.failure(problem)

    def _check_json(self, response: Any, texts: int) -> str | None:
        try:
            data = response.json()
        except ValueError:
            return "bad response: not JSON"
        problem = json_problem(data, texts, CONFIG.allow_empty)
        if problem is None:
            RECORD.add_usage(data["usage"], texts)
        return problem

    def _check_chat(self, response: Any) -> str | None:
        try:
            data = response.json()
        except ValueError:
            return "bad response: not JSON"
        problem = chat_problem(data, CONFIG.allow_empty)
        if problem is None:
            RECORD.add_usage(chat_usage(data["usage"]), 1)
        return problem

    def _read_stream(self, response: Any, start: float) -> str | None:
        state = StreamState()
        first: float | None = None
        try:
            for chunk in response.iter_content(chunk_size=1024, decode_content=False):
                if state.feed_bytes(chunk) and first is None:
                    first = time.perf_counter()
            state.close()
        except Exception as exc:  # the connection broke mid-stream, or not UTF-8
            state.error = f"stream broken: {type(exc).__name__}"
        # The request's time is the whole stream, not only its headers.
        response.request_meta["response_time"] = (time.perf_counter() - start) * 1000
        problem = state.problem(CONFIG.allow_empty)
        if problem is None:
            RECORD.add_usage(state.final["usage"] if state.final else {}, 1)
            if first is not None:
                RECORD.ttft_ms.append((first - start) * 1000)
        return problem


def _retry_after(response: Any) -> float:
    try:
        return float((response.headers or {}).get("retry-after", 1))
    except (TypeError, ValueError):
        return 1.0


def _error(response: Any) -> str:
    if not response.status_code:
        return f"no response: {type(getattr(response, 'error', None)).__name__}"
    try:
        text = response.text or ""
    except Exception:
        text = ""
    return http_problem(response.status_code, text)


def _user(name: str, shape: str | None) -> type[TrafficUser]:
    if shape is None:
        active, weight = CONFIG.mix == "requests", 1
    else:
        active, weight = CONFIG.mix == "users" and CONFIG.weights[shape] > 0, CONFIG.weights[shape]
    attributes = {"shape": shape, "weight": weight, "abstract": not active}
    return type(name, (TrafficUser,), attributes)


MixedTraffic = _user("MixedTraffic", None)
ShortTranslation = _user("ShortTranslation", "short")
LongTranslation = _user("LongTranslation", "long")
BatchTranslation = _user("BatchTranslation", "batch")
StreamingGeneration = _user("StreamingGeneration", "stream")
Chat = _user("Chat", "chat")
StreamingChat = _user("StreamingChat", "chat_stream")
