"""The continuous-batching scheduler, driven step by step with a hand-written backend."""

from __future__ import annotations

import asyncio

import pytest

from attnserve.engine.engine_loop import EngineLoop
from attnserve.engine.options import DecodingOptions
from attnserve.engine.scheduler import (
    Outcome,
    QueueFull,
    Request,
    RequestTooLarge,
    Scheduler,
    SchedulerLimits,
)
from attnserve.engine.translator import decode_batch
from tests.engine.fakes import TableBackend

V = 6
EOS, A, B = 0, 2, 3
BOOM = 99  # a source starting with this token makes the backend's table fail for it


def by_source(src: tuple[int, ...], prefix: tuple[int, ...]) -> list[float]:
    """The source's first token says how many tokens to generate (A...A then EOS)."""
    if src and src[0] == BOOM:
        raise RuntimeError("bad row")
    if len(prefix) >= src[0]:
        return [1.0, 0, 0, 0, 0, 0]
    return [0.05, 0, 0.6, 0.35, 0, 0]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(
    limits: SchedulerLimits | None = None, table=by_source
) -> tuple[Scheduler, TableBackend, Clock]:
    backend = TableBackend(table, V)
    clock = Clock()
    return Scheduler(backend, limits or SchedulerLimits(max_new_tokens=16), clock), backend, clock


def request(rid: str, length: int, **options: object) -> Request:
    return Request(rid, [length, EOS], DecodingOptions(max_new_tokens=16).replace(**options))


def run_until_idle(s: Scheduler, clock: Clock | None = None) -> list[list[str]]:
    """Step until no work is left; returns the ids that ended at each step."""
    ended = []
    while s.has_work:
        assert len(ended) < 1000, "the scheduler never ran out of work"
        ended.append([r.id for r in s.step().ended])
        if clock:
            clock.now += 1.0
    return ended


def test_short_requests_leave_and_waiting_ones_join_mid_batch() -> None:
    s, backend, _ = make(SchedulerLimits(max_batch_rows=2, max_new_tokens=16))
    reqs = [request("long", 5), request("short", 1), request("late", 2)]
    for r in reqs:
        s.submit(r)
    ended = run_until_idle(s)
    # "short" ends at step 2 (one token + EOS); "late" joins at step 3 while "long" runs on.
    assert ended[1] == ["short"]
    assert backend.step_rows == [2, 2, 2, 2, 2, 1]  # "late" ran steps 3-5 beside "long"
    assert [r.outcome for r in reqs] == [Outcome.DONE] * 3
    assert [r.hypotheses[0].tokens for r in reqs] == [(A,) * 5, (A,), (A, A)]
    assert reqs[2].admitted == 0.0 and reqs[2].arrived == 0.0


def test_results_equal_offline_decoding() -> None:
    s, _, _ = make()
    opts = [
        DecodingOptions(max_new_tokens=16),
        DecodingOptions(beam_size=3, num_hypotheses=2, max_new_tokens=16),
        DecodingOptions(sampling=True, seed=4, max_new_tokens=16),
    ]
    reqs = [Request(str(i), [3 + i, EOS], o) for i, o in enumerate(opts)]
    for r in reqs:
        s.submit(r)
    run_until_idle(s)
    offline = decode_batch(TableBackend(by_source, V), [r.source for r in reqs], opts)
    assert [[h.tokens for h in r.hypotheses] for r in reqs] == [
        [h.tokens for h in hyps] for hyps in offline
    ]


def test_beam_requests_own_beam_size_rows() -> None:
    s, backend, _ = make(SchedulerLimits(max_batch_rows=4, max_new_tokens=16))
    s.submit(request("beam", 3, beam_size=4))
    s.submit(request("greedy", 1))
    ended = run_until_idle(s)
    # The greedy request waits: the beam request may grow to 4 rows, the whole budget.
    assert ended[3] == ["beam"]
    assert backend.step_rows[:4] == [1, 4, 4, 4]
    assert ended[-1] == ["greedy"]


def test_token_budget_limits_admission() -> None:
    limits = SchedulerLimits(max_batch_rows=64, max_batch_tokens=40, max_new_tokens=16)
    s, _backend, _ = make(limits)
    for i in range(3):  # each budgets 1 row * (2 source + 16 new) = 18 tokens
        s.submit(request(str(i), 1))
    s.step()
    assert len(s.running) == 2 and len(s.waiting) == 1
    with pytest.raises(RequestTooLarge):
        s.submit(Request("huge", [1] * 30 + [EOS], DecodingOptions(max_new_tokens=16)))
    with pytest.raises(RequestTooLarge):
        s.submit(request("wide", 1, beam_size=65))


def test_fifo_admission_never_skips_the_head() -> None:
    s, _, _ = make(SchedulerLimits(max_batch_rows=4, max_new_tokens=16))
    s.submit(request("a", 6, beam_size=2))
    s.submit(request("b", 6, beam_size=4))  # does not fit next to "a"
    s.submit(request("c", 1))  # would fit, but must not overtake "b"
    s.step()
    assert [r.id for r in s.running.values()] == ["a"]
    assert [r.id for r in s.waiting] == ["b", "c"]
    order = [rid for step in run_until_idle(s) for rid in step]
    assert order.index("b") < order.index("c")


def test_queue_limit_raises_queue_full() -> None:
    s, _, _ = make(SchedulerLimits(max_waiting=2, max_new_tokens=16))
    s.submit(request("1", 1))
    s.submit(request("2", 1))
    with pytest.raises(QueueFull):
        s.submit(request("3", 1))


def test_deadline_expires_running_and_waiting_requests() -> None:
    s, backend, clock = make(SchedulerLimits(max_batch_rows=1, max_new_tokens=16))
    slow = request("slow", 10)
    slow.deadline = 3.0
    queued = request("queued", 1)
    queued.deadline = 2.0
    s.submit(slow)
    s.submit(queued)
    ended = run_until_idle(s, clock)
    assert slow.outcome is Outcome.DEADLINE and queued.outcome is Outcome.DEADLINE
    assert ended[2] == ["queued"] and ended[3] == ["slow"]
    assert s.num_rows == 0 and not s.running
    assert backend.step_rows == [1, 1, 1]  # the expired request stopped using the batch


def test_cancel_frees_rows_at_the_next_step() -> None:
    s, _backend, _ = make()
    s.submit(request("keep", 4))
    s.submit(request("gone", 8, beam_size=2))
    s.step()
    s.step()
    assert s.num_rows == 3
    s.cancel("gone")
    events = s.step()
    assert [r.id for r in events.ended] == ["gone"]
    assert events.ended[0].outcome is Outcome.CANCELLED
    assert s.num_rows == 1
    run_until_idle(s)
    assert s.num_rows == 0


def test_runtime_failure_fails_the_running_batch_and_serving_goes_on() -> None:
    def table(src, prefix):
        if src[0] == BOOM and prefix:
            raise RuntimeError("bad row")
        return by_source((min(src[0], 3),), prefix)

    s, _, _ = make(table=table)
    ok, bad = request("ok", 3), Request("bad", [BOOM, EOS], DecodingOptions(max_new_tokens=16))
    s.submit(ok)
    s.submit(bad)
    run_until_idle(s)
    # The runtime fails the whole step: the requests in it fail, the scheduler goes on.
    assert bad.outcome is Outcome.FAILED and isinstance(bad.error, RuntimeError)
    assert ok.outcome is Outcome.FAILED
    after = request("after", 2)
    s.submit(after)
    run_until_idle(s)
    assert after.outcome is Outcome.DONE and after.hypotheses[0].tokens == (A, A)
    assert s.running == {} and not s.waiting and s.num_rows == 0


def test_search_error_isolated_to_its_request() -> None:
    s, _, _ = make()
    good, bad = request("good", 3), request("bad", 3, beam_size=2)
    s.submit(good)
    s.submit(bad)
    s.step()
    assert bad.search is not None

    def explode(log_probs):
        raise ValueError("search bug")

    bad.search.step = explode  # type: ignore[method-assign]
    run_until_idle(s)
    assert bad.outcome is Outcome.FAILED and isinstance(bad.error, ValueError)
    assert good.outcome is Outcome.DONE and good.hypotheses[0].tokens == (A, A, A)


def test_streaming_reports_each_new_token_once() -> None:
    s, _, _ = make()
    r = request("s", 4)
    r.stream = True
    s.submit(r)
    chunks = []
    while s.has_work:
        chunks += [tokens for req, tokens in s.step().new_tokens if req is r]
    assert [t for chunk in chunks for t in chunk] == list(r.hypotheses[0].tokens)
    assert all(len(c) == 1 for c in chunks)


def test_engine_loop_runs_requests_on_its_thread() -> None:
    s, _, _ = make(SchedulerLimits(max_waiting=8, max_new_tokens=16))
    seen_steps = []
    loop = EngineLoop(s, observer=lambda events, _: seen_steps.append(events.batch_rows))
    loop.start()

    async def main() -> list[Request]:
        streaming = request("stream", 3)
        streaming.stream = True
        futures = [loop.submit(request(str(i), i + 1)) for i in range(4)]
        stream_future = loop.submit(streaming)
        tokens = [t async for chunk in loop.tokens(streaming) for t in chunk]
        done = await asyncio.gather(*futures, stream_future)
        assert tokens == list(streaming.hypotheses[0].tokens)
        return list(done)

    try:
        done = asyncio.run(asyncio.wait_for(main(), 10))
    finally:
        loop.stop(timeout=5)
    assert [r.hypotheses[0].tokens for r in done[:4]] == [(A,) * (i + 1) for i in range(4)]
    assert max(seen_steps) >= 4 and loop.idle


def test_engine_loop_rejects_when_queue_is_full() -> None:
    s, _, _ = make(SchedulerLimits(max_waiting=2, max_new_tokens=16))
    loop = EngineLoop(s)  # not started: nothing drains the intake

    async def main() -> None:
        loop.submit(request("1", 1))
        loop.submit(request("2", 1))
        with pytest.raises(QueueFull):
            loop.submit(request("3", 1))

    asyncio.run(main())


def test_saturated_queue_joins_in_groups() -> None:
    """With more waiting than fits, requests join once `join_rows` rows are free: one encoder
    pass for the group, not one per finished request."""
    limits = SchedulerLimits(max_batch_rows=4, max_new_tokens=16, join_rows=2, max_join_steps=99)
    s, backend, _ = make(limits)
    for rid, length in [("a", 1), ("b", 2), ("c", 6), ("d", 6), ("e", 1), ("f", 1), ("g", 1)]:
        s.submit(request(rid, length))
    admitted = []
    while s.has_work:
        events = s.step()
        admitted.append(events.admitted)
    # "a" ends at step 2 and "b" at step 3: "e" and "f" join together at step 4, not one each.
    assert admitted[:5] == [4, 0, 0, 2, 0]
    assert backend.step_rows[:4] == [4, 4, 3, 4]


def test_saturated_queue_waits_at_most_max_join_steps() -> None:
    limits = SchedulerLimits(max_batch_rows=2, max_new_tokens=16, join_rows=2, max_join_steps=1)
    s, _, _ = make(limits)
    for rid, length in [("a", 1), ("b", 8), ("c", 1), ("d", 1)]:
        s.submit(request(rid, length))
    admitted = [s.step().admitted for _ in range(4)]
    assert admitted == [2, 0, 1, 0]  # "c" joins as soon as "a" leaves: waiting is bounded


def test_request_level_batching_waits_for_the_whole_batch() -> None:
    limits = SchedulerLimits(max_batch_rows=2, max_new_tokens=16, batching="request")
    s, backend, _ = make(limits)
    for rid, length in [("short", 1), ("long", 5), ("next", 1)]:
        s.submit(request(rid, length))
    ended = run_until_idle(s)
    # "next" may not take the row "short" freed; it starts after "long" ends.
    assert ended[5] == ["long"] and ended[-1] == ["next"]
    assert backend.step_rows == [2, 2, 1, 1, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="batching"):
        SchedulerLimits(batching="iteration")


def test_static_batching_answers_a_batch_when_it_ends_and_decodes_finished_rows_on() -> None:
    """A server around generate(): "short" is done at step 2 but answered with "long" at step
    6, its row decoded as padding until then; the outputs are those of request-level batching."""
    ended, rows, outputs = {}, {}, {}
    for batching in ("static", "request"):
        limits = SchedulerLimits(max_batch_rows=2, max_new_tokens=16, batching=batching)
        s, backend, _ = make(limits)
        reqs = [request("short", 1), request("long", 5), request("next", 1)]
        for r in reqs:
            s.submit(r)
        ended[batching] = run_until_idle(s)
        assert all(r.outcome is Outcome.DONE for r in reqs)
        rows[batching], outputs[batching] = backend.step_rows, [r.hypotheses for r in reqs]
    assert ended["request"] == [[], ["short"], [], [], [], ["long"], [], ["next"]]
    assert ended["static"] == [[], [], [], [], [], ["short", "long"], [], ["next"]]
    assert rows["request"] == [2, 2, 1, 1, 1, 1, 1, 1]
    assert rows["static"] == [2, 2, 2, 2, 2, 2, 1, 1]
    assert outputs["static"] == outputs["request"]


def test_static_batching_a_finished_request_cancelled_before_its_batch_ends() -> None:
    s, _, _ = make(SchedulerLimits(max_batch_rows=2, max_new_tokens=16, batching="static"))
    short, long = request("short", 1), request("long", 4)
    s.submit(short)
    s.submit(long)
    s.step()
    s.step()  # "short" is done, held for the batch
    assert short.outcome is None
    s.cancel("short")  # its client went away meanwhile
    assert [r.id for r in s.step().ended] == ["short"] and short.outcome is Outcome.CANCELLED
    ended = run_until_idle(s)
    assert ended[-1] == ["long"] and long.outcome is Outcome.DONE
    assert not s.running and not s.cohorts


def cohort_scenario(padding: int) -> tuple[list[int], list[int], list[Request]]:
    """Cohort X = a, b, c (3 rows, all the batch has); "a" ends at step 2 and "d" may not
    join X (2 steps old) with no padding allowed, so it starts cohort Y at step 3; "c" ends at
    step 4 and frees a row for "e" at step 5, when Y is 2 steps old."""
    limits = SchedulerLimits(
        max_batch_rows=3, max_new_tokens=16, join_rows=1, max_cohorts=2, max_join_padding=padding
    )
    s, backend, _ = make(limits)
    reqs = [request("a", 1), request("b", 8), request("c", 3), request("d", 8), request("e", 1)]
    for r in reqs:
        s.submit(r)
    admitted = []
    while s.has_work:
        admitted.append(s.step().admitted)
    assert all(r.outcome is Outcome.DONE for r in reqs)
    return admitted, backend.step_rows, reqs


def test_request_waits_for_a_cohort_rather_than_padding_beyond_the_limit() -> None:
    """Both cohorts are older than the padding limit allows and no third may start: the free
    row stays free and "e" starts a new cohort once "b" ends cohort X (step 9)."""
    admitted, step_rows, reqs = cohort_scenario(padding=1)
    assert admitted[:10] == [3, 0, 1, 0, 0, 0, 0, 0, 0, 1]
    assert step_rows[:4] == [3, 3, 2, 1]  # step 3: X (b, c), then Y (d): a call each
    assert step_rows[4:8] == [2, 1, 1, 1]  # "c" ends at step 4; step 5: X (b), Y (d)
    assert reqs[4].admitted is not None and reqs[3].admitted is not None


def test_request_joins_the_youngest_cohort_within_the_padding_limit() -> None:
    """With 2 rows x columns of padding allowed, "d" joins X at step 3 (1 row x 2 steps), but
    "e" at step 5 would get 4 columns of padding there: it starts cohort Y instead."""
    admitted, step_rows, _ = cohort_scenario(padding=2)
    assert admitted[:5] == [3, 0, 1, 0, 1]
    assert step_rows[:6] == [3, 3, 3, 3, 2, 1]  # step 5: X (b, d), then Y (e)


def test_runtime_failure_fails_its_cohort_alone() -> None:
    def table(src, prefix):
        if src[0] == BOOM and prefix:
            raise RuntimeError("bad row")
        return by_source(src, prefix)

    limits = SchedulerLimits(
        max_batch_rows=2, max_new_tokens=16, join_rows=1, max_cohorts=2, max_join_padding=0
    )
    s, _, _ = make(limits, table=table)
    ok, first = request("ok", 6), request("first", 1)
    bad = Request("bad", [BOOM, EOS], DecodingOptions(max_new_tokens=16))
    for r in (ok, first, bad, request("next", 1)):
        s.submit(r)
    run_until_idle(s)
    # "bad" started a cohort of its own at step 3 (the first one was 2 steps old); the runtime
    # failed there at its second step, and "ok" in the other cohort went on.
    assert bad.outcome is Outcome.FAILED and isinstance(bad.error, RuntimeError)
    assert ok.outcome is Outcome.DONE and ok.hypotheses[0].tokens == (A,) * 6
    assert s.num_rows == 0 and s.cohorts == []
    with pytest.raises(ValueError, match="max_cohorts"):
        SchedulerLimits(max_cohorts=0)


def step_until_idle(s: Scheduler) -> list[int]:
    """Step until no work is left; requests admitted at each step."""
    admitted = []
    while s.has_work:
        assert len(admitted) < 1000, "the scheduler never ran out of work"
        admitted.append(s.step().admitted)
    return admitted


def test_request_joins_the_youngest_cohort_not_the_oldest() -> None:
    """X = a, b, c from step 1; "d" starts Y at step 5 (X is 4 steps old, over the padding
    limit of 3); at step 7 "e" joins Y (2 steps old), which X (6) would not allow."""
    limits = SchedulerLimits(
        max_batch_rows=3, max_new_tokens=16, join_rows=1, max_cohorts=2, max_join_padding=3
    )
    s, backend, _ = make(limits)
    for rid, length in [("a", 3), ("b", 10), ("c", 5), ("d", 8), ("e", 1)]:
        s.submit(request(rid, length))
    admitted = step_until_idle(s)
    assert admitted[:7] == [3, 0, 0, 0, 1, 0, 1]
    assert backend.step_rows[4:10] == [2, 1, 2, 1, 1, 2]  # steps 5-7: X, Y each; Y = d, e


@pytest.mark.parametrize("how", ["deadline", "cancel"])
def test_cancel_and_deadline_reach_every_cohort(how: str) -> None:
    """ "c" runs in a second cohort from step 3 ("a" left X, 2 steps old, no padding allowed);
    its deadline passes / it is cancelled before step 5: from step 5 only X (b) steps."""
    limits = SchedulerLimits(
        max_batch_rows=2, max_new_tokens=16, join_rows=1, max_cohorts=2, max_join_padding=0
    )
    s, backend, clock = make(limits)
    c = request("c", 9)
    if how == "deadline":
        c.deadline = 4.0  # step k runs at clock k - 1
    for r in [request("a", 1), request("b", 9), c]:
        s.submit(r)
    ended = []
    while s.has_work:
        if how == "cancel" and len(ended) == 4:
            s.cancel("c")
        ended.append([r.id for r in s.step().ended])
        clock.now += 1.0
    assert ended[4] == ["c"]
    assert c.outcome is (Outcome.DEADLINE if how == "deadline" else Outcome.CANCELLED)
    assert backend.step_rows == [2, 2] + [1, 1] * 2 + [1] * 6  # steps 3-4: X, Y; then X
    assert s.num_rows == 0 and s.cohorts == []


def test_padding_counts_every_admitted_row() -> None:
    """Two 1-row requests wait while a batch 2 steps old has room for both: 1 row x 2 columns
    would be within a padding limit of 2, but 2 rows x 2 are not, and they go together or not
    at all: both start once the batch (one cohort) has finished."""
    limits = SchedulerLimits(max_batch_rows=4, max_new_tokens=16, join_rows=1, max_join_padding=2)
    s, _, _ = make(limits)
    reqs = [request("a", 1), request("a2", 1), request("b", 6), request("c", 6)]
    reqs += [request("e", 1), request("f", 1)]
    for r in reqs:
        s.submit(r)
    admitted = step_until_idle(s)
    assert admitted == [4, 0, 0, 0, 0, 0, 0, 2, 0]  # "e", "f" start once b and c end at step 7
    assert all(r.outcome is Outcome.DONE for r in reqs)


class Failing(TableBackend):
    """A backend whose `method` (select: compaction; concat: a join) raises while `broken`."""

    broken = True

    def __init__(self, method: str) -> None:
        super().__init__(by_source, V)
        self.method = method

    def select(self, state: list, rows):
        self._maybe_fail("select")
        return super().select(state, rows)

    def concat(self, states):
        self._maybe_fail("concat")
        return super().concat(states)

    def _maybe_fail(self, method: str) -> None:
        if self.broken and method == self.method:
            raise RuntimeError(f"no memory for the cache ({method})")


def test_failed_compaction_fails_the_cohort_and_nothing_is_left_running() -> None:
    backend = Failing("select")
    s = Scheduler(backend, SchedulerLimits(max_new_tokens=16), Clock())
    short, long = request("short", 1), request("long", 6)
    s.submit(short)
    s.submit(long)
    run_until_idle(s)
    # "short" finished at step 2 and compacting it away failed: both requests of that cohort
    # fail (the finished one included), none is left in `running` to spin the engine.
    assert short.outcome is Outcome.FAILED and long.outcome is Outcome.FAILED
    assert s.running == {} and s.cohorts == [] and not s.has_work
    backend.broken = False
    after = request("after", 2)
    s.submit(after)
    run_until_idle(s)
    assert after.outcome is Outcome.DONE


def test_failed_join_fails_the_joiners_alone() -> None:
    backend = Failing("concat")
    s = Scheduler(backend, SchedulerLimits(max_new_tokens=16), Clock())
    long = request("long", 5)
    s.submit(long)
    s.step()
    late = request("late", 2)
    s.submit(late)  # joins the running batch (1 row x 1 step of padding): concat fails
    events = s.step()
    assert [r.id for r in events.ended] == ["late"] and late.outcome is Outcome.FAILED
    run_until_idle(s)
    assert long.outcome is Outcome.DONE and long.hypotheses[0].tokens == (A,) * 5
    assert s.running == {} and s.cohorts == []


def test_failed_compaction_on_cancel_fails_its_cohort_and_nothing_hangs() -> None:
    backend = Failing("select")
    s = Scheduler(backend, SchedulerLimits(max_new_tokens=16), Clock())
    gone, other = request("gone", 6), request("other", 6)
    s.submit(gone)
    s.submit(other)
    s.step()
    s.cancel("gone")  # its row is half the batch: compaction, whose select raises
    events = s.step()
    assert {r.id: r.outcome for r in events.ended} == {
        "gone": Outcome.CANCELLED,
        "other": Outcome.FAILED,
    }
    assert s.running == {} and s.cohorts == [] and not s.has_work


def test_fail_all_answers_every_request_a_failed_step_held_or_had_ended() -> None:
    """A step that raises halfway (a bug) may already have ended requests (here a cancelled
    one) and taken others off the queue: `fail_all` answers all of them, once."""
    s, _, _ = make(SchedulerLimits(max_batch_rows=1, max_new_tokens=16))
    reqs = [request("r1", 5), request("r2", 5), request("r3", 5)]
    for r in reqs:
        s.submit(r)
    s.step()  # r1 runs; r2 and r3 wait
    s.cancel("r2")

    def broken_admission(events: object, now: float) -> int:
        s.waiting.popleft()  # r3 taken off the queue, never admitted
        raise RuntimeError("admission bug")

    s._admit = broken_admission  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="admission bug"):
        s.step()
    events = s.fail_all(RuntimeError("admission bug"))
    assert [(r.id, r.outcome) for r in events.ended] == [
        ("r2", Outcome.CANCELLED),  # ended by the failed step itself
        ("r1", Outcome.FAILED),
        ("r3", Outcome.FAILED),
    ]
    assert not s.has_work and not s.cohorts
    assert s.fail_all(RuntimeError("again")).ended == []  # nothing is answered twice


def test_a_request_behind_a_long_document_waits_one_round_not_the_document() -> None:
    s, _, _ = make(SchedulerLimits(max_batch_rows=2, max_new_tokens=16))
    document = [
        Request(f"doc/{i}", [3, EOS], DecodingOptions(max_new_tokens=16), group="doc")
        for i in range(8)
    ]
    for r in document:
        s.submit(r)
    s.submit(request("other", 1))
    ended = run_until_idle(s)
    order = [rid for step in ended for rid in step]
    # the document's first two sentences run first; "other" takes the next free row
    assert order.index("other") < order.index("doc/3")
    assert all(r.outcome is Outcome.DONE for r in document)
