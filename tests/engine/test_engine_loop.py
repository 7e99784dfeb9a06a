"""EngineLoop streaming: a reader that starts late gets every token; cancel drops the queue."""

from __future__ import annotations

import asyncio

from attnserve.engine.engine_loop import EngineLoop
from attnserve.engine.options import DecodingOptions
from attnserve.engine.scheduler import Outcome, Request, Scheduler
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
