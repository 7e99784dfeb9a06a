"""EngineLoop: runs a Scheduler on a dedicated thread and hands results back to asyncio.

The event loop never waits on the model: `submit` only appends to a lock-protected intake list
(and raises QueueFull at once when the waiting queue is full); the engine thread moves intake
into the scheduler, steps it while there is work, and resolves each request's future (and
streaming queue) with `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from attnserve.engine.memory import MemoryTrimmer
from attnserve.engine.scheduler import QueueFull, Request, Scheduler, StepEvents

log = logging.getLogger(__name__)

StepObserver = Callable[[StepEvents, "EngineLoop"], None]


@dataclass
class _Waiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Request]
    tokens: asyncio.Queue[list[int] | None] | None  # streaming requests only


class EngineLoop:
    """One model's scheduler on its own thread."""

    def __init__(
        self,
        scheduler: Scheduler,
        observer: StepObserver | None = None,
        trimmer: MemoryTrimmer | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.observer = observer
        # gives freed heap memory back after steps (shared by the models of a server)
        self.trimmer = trimmer
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._intake: list[Request] = []
        self._cancels: list[str] = []
        self._waiters: dict[str, _Waiter] = {}
        # Token queues of streaming requests, from submit() until tokens() takes them: a reader
        # that starts after the request ended (a fast model) still gets every token.
        self._streams: dict[str, asyncio.Queue[list[int] | None]] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Read by metrics and /readyz without the lock (ints are updated atomically).
        self.waiting = 0
        self.running = 0
        self.kv_usage = 0.0  # Scheduler.kv_usage after the last step

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="attnserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the current step (callers drain first if they want in-flight work done)."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._intake and not self.scheduler.has_work

    # -- requests (called on the event loop) -----------------------------------------------

    def submit(self, request: Request) -> asyncio.Future[Request]:
        """Queue a request; the future resolves when it ends. QueueFull when saturated."""
        self.scheduler.check(request)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop, loop.create_future(), asyncio.Queue() if request.stream else None)
        with self._lock:
            if request.id in self._waiters:  # its waiter and cancellations would be another's
                raise ValueError(f"request id {request.id!r} is already in flight")
            if len(self._intake) + len(self.scheduler.waiting) >= self.scheduler.limits.max_waiting:
                raise QueueFull("waiting queue is full")
            self._intake.append(request)
            self._waiters[request.id] = waiter
            if waiter.tokens is not None:
                self._streams[request.id] = waiter.tokens
            self.waiting += 1
            self._wake.notify()
        return waiter.future

    async def tokens(self, request: Request) -> AsyncIterator[list[int]]:
        """New token ids of a streaming request as they are decoded (one reader)."""
        with self._lock:
            queue = self._streams.pop(request.id, None)
        if queue is None:
            return
        while (chunk := await queue.get()) is not None:
            yield chunk

    def cancel(self, request_id: str) -> None:
        """Free the request's rows at the next step (client gone, or its deadline passed)."""
        with self._lock:
            self._streams.pop(request_id, None)
            self._cancels.append(request_id)
            self._wake.notify()

    # -- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        trimmed = True  # memory given back since the last step
        while True:
            with self._lock:
                while not (self._intake or self._cancels or self.scheduler.has_work):
                    if self._stopping:
                        return
                    if not trimmed and self.trimmer is not None:
                        self.trimmer.maybe_trim(force=True)  # going idle
                    trimmed = True
                    self._wake.wait()
                trimmed = False
                if self._stopping and not self.scheduler.has_work and not self._intake:
                    return
                intake, self._intake = self._intake, []
                cancels, self._cancels = self._cancels, []
                for request in intake:
                    self.scheduler.enqueue(request)  # limits were checked in submit()
                for request_id in cancels:
                    self.scheduler.cancel(request_id)
            try:
                events = self.scheduler.step()
            except Exception as exc:  # the scheduler guards model errors; this is a bug
                # Retrying would spin on the same failure with every request hanging until its
                # deadline: fail what the scheduler holds instead, and serve the next requests.
                log.exception("scheduler step failed; failing the requests it holds")
                try:
                    events = self.scheduler.fail_all(exc)
                except Exception:
                    log.exception("failing the scheduler's requests failed too")
                    continue
            self.waiting = len(self.scheduler.waiting)
            self.running = len(self.scheduler.running)
            self.kv_usage = self.scheduler.kv_usage()
            self._deliver(events)
            if self.trimmer is not None:
                self.trimmer.maybe_trim()
            if self.observer is not None:
                try:
                    self.observer(events, self)
                except Exception:
                    log.exception("step observer failed")

    def _deliver(self, events: StepEvents) -> None:
        for request, tokens in events.new_tokens:
            waiter = self._waiters.get(request.id)
            if waiter is not None and waiter.tokens is not None:
                waiter.loop.call_soon_threadsafe(waiter.tokens.put_nowait, list(tokens))
        for request in events.ended:
            with self._lock:
                waiter = self._waiters.pop(request.id, None)
            if waiter is None:
                continue
            if waiter.tokens is not None:
                waiter.loop.call_soon_threadsafe(waiter.tokens.put_nowait, None)
            waiter.loop.call_soon_threadsafe(_resolve, waiter.future, request)


def _resolve(future: asyncio.Future[Request], request: Request) -> None:
    if not future.done():
        future.set_result(request)
