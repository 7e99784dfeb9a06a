"""EngineLoop streaming: a reader that starts late gets every token; cancel drops the queue."""

from __future__ import annotations

import asyncio

import pytest

from attnserve.engine.engine_loop import EngineLoop
from attnserve.engine.options import DecodingOptions
from attnserve.engine.scheduler import Outcome, Request, Scheduler, StepEvents
from tests.engine.fakes import TableBackend

EOS, A = 0, 2


def three_tokens(src: tuple[int, ...], prefix: tuple[int, ...]) -> list[float]:
    return [1.0, 0, 0, 0] if len(prefix) >= 3 else [0.1, 0, 0.9, 0]


def streaming_request(request_id: str) -> Request:
    return Request(request_id, [A, EOS], DecodingOptions(max_new_tokens=8), stream=True)


def test_tokens_read_after_the_request_ended_are_all_there() -> None:
    """The service starts reading a stream after its route returned: the model may be done."""
    loop = EngineLoop(Scheduler(TableBackend(three_tokens, 4)))
    loop.start()

    async def main() -> list[int]:
        request = streaming_request("late")
        done = await loop.submit(request)  # ended before anyone reads its tokens
        assert done.outcome is Outcome.DONE
        return [t async for chunk in loop.tokens(request) for t in chunk]

    try:
        assert asyncio.run(asyncio.wait_for(main(), 10)) == [A, A, A]
    finally:
        loop.stop(timeout=5)


def test_cancel_drops_an_unread_stream() -> None:
    loop = EngineLoop(Scheduler(TableBackend(three_tokens, 4)))
    loop.start()

    async def main() -> None:
        request = streaming_request("gone")
        await loop.submit(request)
        loop.cancel(request.id)  # the client left before reading: nothing is kept for it
        assert [chunk async for chunk in loop.tokens(request)] == []

    try:
        asyncio.run(asyncio.wait_for(main(), 10))
    finally:
        loop.stop(timeout=5)
    assert loop.idle


def test_a_request_id_in_flight_is_refused() -> None:
    """Waiters and cancellations are keyed by id: a second request with it would take over
    the first one's answer (the service makes its ids unique)."""
    loop = EngineLoop(Scheduler(TableBackend(three_tokens, 4)))  # not started: nothing ends

    async def main() -> None:
        loop.submit(streaming_request("same"))
        with pytest.raises(ValueError, match="already in flight"):
            loop.submit(streaming_request("same"))

    asyncio.run(main())


class FailingScheduler(Scheduler):
    """A scheduler whose step raises (a bug) while `broken` is set."""

    broken = True

    def step(self):  # type: ignore[no-untyped-def]
        if self.broken:
            self._admit(StepEvents(), self.clock())  # hold requests, then fail
            raise RuntimeError("scheduler bug")
        return super().step()


def test_a_scheduler_that_raises_fails_its_requests_and_the_loop_goes_on() -> None:
    scheduler = FailingScheduler(TableBackend(three_tokens, 4))
    loop = EngineLoop(scheduler)
    loop.start()

    async def main() -> None:
        first = await asyncio.gather(*(loop.submit(streaming_request(f"r{i}")) for i in range(3)))
        assert [r.outcome for r in first] == [Outcome.FAILED] * 3  # answered, not left hanging
        assert all(str(r.error) == "scheduler bug" for r in first)
        scheduler.broken = False
        after = await loop.submit(streaming_request("after"))
        assert after.outcome is Outcome.DONE and after.output_tokens == 4

    try:
        asyncio.run(asyncio.wait_for(main(), 10))
    finally:
        loop.stop(timeout=5)
    assert loop.idle and not scheduler.cohorts
