"""What the routes and middleware share: settings, metrics, models and the process lifecycle."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Literal

from fastapi import Depends, Request

from attnserve.service.metrics import Metrics
from attnserve.service.models import ModelRegistry
from attnserve.service.settings import Settings

Phase = Literal["loading", "ready", "draining", "failed"]


@dataclass
class Lifecycle:
    """loading -> ready -> draining (SIGTERM or shutdown); loading -> failed."""

    phase: Phase = "loading"
    detail: str | None = None
    in_flight: int = 0  # API requests being served (streams until their last event)
    # Called when loading fails, so the server exits instead of answering 503 forever.
    on_fatal: Callable[[], None] | None = None

    @property
    def ready(self) -> bool:
        return self.phase == "ready"

    def start_draining(self) -> None:
        if self.phase != "failed":
            self.phase = "draining"

    def fail(self, detail: str) -> None:
        self.phase, self.detail = "failed", detail
        if self.on_fatal is not None:
            self.on_fatal()


@dataclass
class ServiceState:
    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    registry: ModelRegistry = field(default_factory=ModelRegistry)
    lifecycle: Lifecycle = field(default_factory=Lifecycle)


async def get_service(request: Request) -> ServiceState:
    """(async: FastAPI would run a plain function on its thread pool, a thread hop per request)"""
    state: ServiceState = request.app.state.service
    return state


Service = Annotated[ServiceState, Depends(get_service)]
