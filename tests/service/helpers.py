"""Test helpers: a real uvicorn server in a thread, a backend that is slow on purpose, metrics."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from attnserve.engine.backend import Backend, FloatArray, IntArray, ModelSpec
from attnserve.service.app import create_app
from attnserve.service.models import BackendFactory, default_backend_factory
from attnserve.service.server import DrainingServer, build_server
from attnserve.service.settings import Settings


def make_settings(model_dir: Path, **overrides: Any) -> Settings:
    """Settings for tests: one CPU thread, CPU provider, plain logs."""
    values: dict[str, Any] = {
        "models": [str(model_dir)],
        "threads": 1,
        "provider": "cpu",
        "log_json": False,
        "drain_seconds": 5.0,
    }
    values.update(overrides)
    return Settings(**values)


class SlowBackend:
    """Delegates to a real backend and sleeps `delay` seconds in every decoder step."""

    def __init__(self, inner: Backend[Any], delay: float) -> None:
        self.inner = inner
        self.delay = delay

    @property
    def spec(self) -> ModelSpec:
        return self.inner.spec

    def encode(self, src_ids: IntArray, src_lengths: IntArray) -> Any:
        return self.inner.encode(src_ids, src_lengths)

    def step(self, tokens: IntArray, state: Any) -> tuple[FloatArray, Any]:
        time.sleep(self.delay)
        return self.inner.step(tokens, state)

    def select(self, state: Any, rows: IntArray) -> Any:
        return self.inner.select(state, rows)

    def concat(self, states: Sequence[Any]) -> Any:
        return self.inner.concat(states)


def slow_factory(delay: float, only: str | None = None) -> BackendFactory:
    """Backends slowed by `delay` s a step (language models too: their stop ids pass through);
    `only`: just the model of that name."""

    def factory(directory: Path, settings: Settings, *stop_ids: Any) -> Backend[Any]:
        backend = default_backend_factory(directory, settings, *stop_ids)
        if only is not None and Settings.model_name(directory) != only:
            return backend
        return SlowBackend(backend, delay)

    return factory


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LiveServer:
    """create_app(settings) served by uvicorn on a free port, in a thread."""

    def __init__(
        self,
        settings: Settings,
        *,
        backend_factory: BackendFactory = default_backend_factory,
        wait_ready: bool = True,
    ) -> None:
        self.settings = settings
        self.app = create_app(settings, backend_factory=backend_factory)
        self.service = self.app.state.service
        self.server: DrainingServer = build_server(self.app, settings)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        self._wait(lambda: self.server.started, "start")
        if wait_ready:
            self.wait_ready()

    def _wait(self, condition: Any, what: str, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > end or not self.thread.is_alive():
                raise RuntimeError(f"server did not {what}")
            time.sleep(0.01)

    def wait_ready(self) -> None:
        self._wait(lambda: self.service.lifecycle.phase == "ready", "become ready")

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 30.0), **kwargs)

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10.0).text

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def __enter__(self) -> LiveServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text format (0.0 when absent)."""
    for line in text.splitlines():
        match = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return 0.0


def wait_for_metric(
    server: LiveServer, name: str, expected: float, timeout: float = 5.0, **labels: str
) -> float:
    """Poll /metrics until the sample equals `expected`; returns the last value seen."""
    end = time.monotonic() + timeout
    while True:
        value = metric_value(server.metrics(), name, **labels)
        if value == expected or time.monotonic() > end:
            return value
        time.sleep(0.02)
