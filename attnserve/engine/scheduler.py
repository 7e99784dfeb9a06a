"""Continuous (iteration-level) batching: requests join and leave the running batch every step.

The scheduler is plain Python with no threads or HTTP: `submit`, `cancel` and `step` are called
by one engine thread (engine/engine_loop.py), and tests drive it directly with fake backends.
Each `step()` is schedule -> execute -> update:

- schedule: expire deadlines, apply cancellations, admit waiting requests in queue order while
  the batch stays within `max_batch_rows` rows and `max_batch_tokens` tokens (no request skips
  the head of the queue, so none starves; the queue takes requests round-robin across their
  groups, the sentences of one document: engine/waiting.py), and encode all admitted requests
  together (in length buckets, RunningBatch.encode); a request that asks for its prompt's
  scores (prompt logprobs, engine/scoring.py) is admitted alone and prefilled alone, so they
  are what it gets alone;
- execute: one decoder step for every running row (RunningBatch.step of every cohort);
- update: report new tokens (for streaming) and finished, failed or expired requests.

Joining has a price on this backend design: a backend's dense cache is as wide as its oldest
row (left-padded), so a row that joins a batch `age` steps old reads `age` columns of padding at
every step, and on a CPU a step costs in proportion to rows x columns. A batch that always
admits never ends, and every row in it pays for the oldest. So a running batch takes new
requests only while it is young: while their rows x its age (steps since it started, the
padding they get if its first rows still run) is at most `max_join_padding`. Then it is closed
to joins, even after its first rows left, so that batches turn over: an age counted from the
oldest row still running would keep a batch open for as long as requests keep arriving.
Requests that may not join start a new running batch ("cohort", stepped beside the others with
a decoder call of its own) while there are fewer than `max_cohorts`, or wait for one to finish.
Requests still leave at every step. The measurements behind these rules: docs/BENCHMARKS.md.

Two baselines for comparison (`batching`, docs/BENCHMARKS.md): "request" starts a batch only when
the last one has finished, but still answers a request, and drops its rows, when it ends;
"static" is request-level batching as a server around a `generate()` call does it: the rows of
finished requests go on being decoded (as padding) and every request of the batch is answered
when its last one ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from attnserve.engine.backend import Backend, IntArray, left_padded, pad_batch
from attnserve.engine.batch import RunningBatch
from attnserve.engine.constraints import Constraint
from attnserve.engine.options import DecodingOptions
from attnserve.engine.prefix_cache import Prefix, PrefixCache
from attnserve.engine.scoring import score_positions, score_tokens
from attnserve.engine.search import (
    GreedySearch,
    Hypothesis,
    Search,
    Stopper,
    TokenLogprob,
    make_search,
)
from attnserve.engine.waiting import FairQueue

log = logging.getLogger(__name__)


class Outcome(Enum):
    DONE = "done"
    DEADLINE = "deadline_exceeded"
    CANCELLED = "cancelled"
    FAILED = "failed"


class QueueFull(Exception):
    """The waiting queue is at its limit (the service answers 429)."""


class RequestTooLarge(ValueError):
    """A request that could never fit the batch limits, even alone."""


@dataclass(eq=False)
class Request:
    """One decoding request (one source sentence, or a language model's prompt) and what
    happened to it. A language model's request holds its prompt but the last token in `source`
    (what is prefilled), that token in `start` (the first decoder input) and the whole prompt
    in `prefix` (what the processors see); `lm_request` builds one."""

    id: str
    source: list[int]
    options: DecodingOptions
    deadline: float | None = None  # monotonic seconds
    stream: bool = False
    group: str | None = None  # requests of one API request (a document's sentences)
    start: int | None = None
    prefix: Sequence[int] = ()
    stopper: Stopper | None = None
    constraint: Constraint | None = None  # a grammar the output follows (structured outputs)
    # Language models: prompts reuse cached prefixes of the same salt only (tenants apart).
    cache_salt: str | None = None
    # Filled in by the scheduler.
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    arrived: float = 0.0
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    outcome: Outcome | None = None
    hypotheses: list[Hypothesis] = field(default_factory=list)
    error: Exception | None = None
    search: Search | None = None
    streamed: int = 0  # tokens already reported as StepEvent.new_tokens
    # With options.prompt_logprobs: one per prompt token once prefilled (None for the first,
    # which nothing precedes).
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def rows(self) -> int:
        """Rows this request occupies at most (a beam request owns beam_size rows)."""
        return self.options.rows

    @property
    def output_tokens(self) -> int:
        if not self.hypotheses:
            return 0
        best = self.hypotheses[0]
        return len(best.tokens) + int(best.ended_with_eos)


def lm_request(
    request_id: str,
    prompt: Sequence[int],
    options: DecodingOptions,
    *,
    deadline: float | None = None,
    stream: bool = False,
    stopper: Stopper | None = None,
    constraint: Constraint | None = None,
    cache_salt: str | None = None,
) -> Request:
    """A language model's request for a (non-empty) prompt."""
    if not prompt:
        raise ValueError("a prompt needs at least one token")
    return Request(
        id=request_id,
        source=list(prompt[:-1]),
        options=options,
        deadline=deadline,
        stream=stream,
        start=int(prompt[-1]),
        prefix=list(prompt),
        stopper=stopper,
        constraint=constraint,
        cache_salt=cache_salt,
    )


@dataclass
class StepEvents:
    """What one step produced: new tokens of streaming requests and requests that ended."""

    new_tokens: list[tuple[Request, list[int]]] = field(default_factory=list)
    ended: list[Request] = field(default_factory=list)
    batch_rows: int = 0
    step_seconds: float = 0.0
    admitted: int = 0


BATCHING = ("continuous", "request", "static")


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch_rows: int = 128  # decoder rows (beam requests count beam_size)
    max_batch_tokens: int = 32768  # rows * (source + target positions) held in the batch
    max_waiting: int = 256  # requests queued before submit() raises QueueFull
    max_new_tokens: int = 256  # used for the token budget of an admitted request
    # While more requests wait than fit, admit only once they bring this many rows (or the
    # batch is empty, or `max_join_steps` steps passed since the last admission): one encoder
    # pass and one cache copy per group rather than per finished request. 0: admit every step.
    join_rows: int = 16
    max_join_steps: int = 16
    # "continuous": requests join the running batch at every step; "request": request-level
    # batching, a new batch starts only when the running one has finished; "static": the same,
    # and a batch answers all its requests when it ends (both for comparison, module doc).
    batching: str = "continuous"
    # Continuous batching: requests join the youngest running batch (cohort) if that pads
    # them by at most this many rows x columns; else they start a new cohort while there are
    # fewer than `max_cohorts`, else wait (module doc).
    max_join_padding: int = 64
    max_cohorts: int = 1
    # Language models: prompts longer than this many tokens are prefilled a chunk per step,
    # between the decoding steps of the running batch, which a long prompt would otherwise
    # stall for the whole prefill. 0: whole prompts at admission.
    prefill_chunk: int = 512

    def __post_init__(self) -> None:
        if self.batching not in BATCHING:
            raise ValueError(f"batching must be one of {', '.join(BATCHING)}")
        if self.max_cohorts < 1 or self.max_join_padding < 0:
            raise ValueError("max_cohorts must be >= 1 and max_join_padding >= 0")
        if self.prefill_chunk < 0:
            raise ValueError("prefill_chunk must be >= 0")


@dataclass(eq=False)
class _Prefill:
    """Admitted language-model requests whose prompts are prefilled a chunk per step."""

    requests: list[Request]
    searches: list[Search]
    ids: IntArray  # (B, S) left-padded prompts (but their last tokens)
    mask: IntArray  # (B, S) 1 = a real token
    done: int  # columns of ids prefilled so far
    state: Any
    # A request whose prompt is scored (alone): its tokens' scores so far.
    scores: list[TokenLogprob] | None = None
    # With a prefix cache: each request's lookup (the prompt's blocks), to fill it when done.
    prefixes: list[Prefix] | None = None

    @property
    def rows(self) -> int:
        return sum(r.rows for r in self.requests)


class Scheduler:
    """Owns the waiting queue and the running batches (cohorts) of one model."""

    def __init__(
        self,
        backend: Backend[Any],
        limits: SchedulerLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.backend = backend
        self.limits = limits or SchedulerLimits()
        # Language models whose backend can read its cache out and back: prompt reuse.
        reuses = getattr(backend, "reuses_prefixes", False) and backend.spec.decoder_only
        self.prefix_cache = prefix_cache if reuses else None
        self.clock = clock
        self.cohorts: list[RunningBatch[Any]] = []  # oldest first; each holds rows
        self.prefilling: _Prefill | None = None  # long prompts on their way into a cohort
        self.waiting: FairQueue[Request] = FairQueue()
        self.running: dict[int, Request] = {}  # id(search) -> request
        self._cancelled: set[str] = set()
        self._since_admit = 0  # steps since requests last joined
        self._held: list[tuple[Request, list[Hypothesis]]] = []  # static: done, answered later
        # Every request queued and not ended yet (in arrival order), and the events of the step
        # in progress: what `fail_all` must answer if a step raises halfway.
        self._live: dict[int, Request] = {}
        self._stepping: StepEvents | None = None

    # -- intake ----------------------------------------------------------------------------

    def budget(self, request: Request) -> int:
        """Tokens the request may hold in the batch: its rows times source + target positions."""
        new_tokens = min(request.options.max_new_tokens, self.limits.max_new_tokens)
        return request.rows * (len(request.source) + new_tokens)

    def check(self, request: Request) -> None:
        """RequestTooLarge if the request could never fit the batch, even alone."""
        if request.rows > self.limits.max_batch_rows:
            raise RequestTooLarge(f"beam_size {request.rows} exceeds {self.limits.max_batch_rows}")
        if self.budget(request) > self.limits.max_batch_tokens:
            raise RequestTooLarge("source plus max_new_tokens exceeds the batch token budget")

    def submit(self, request: Request) -> None:
        """Queue a request (FIFO); QueueFull when the queue is at its limit."""
        self.check(request)
        if len(self.waiting) >= self.limits.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests waiting")
        self.enqueue(request)

    def enqueue(self, request: Request) -> None:
        """Append a checked request to the waiting queue (limits enforced by the caller)."""
        request.arrived = self.clock()
        self.waiting.append(request)
        self._live[id(request)] = request

    def cancel(self, request_id: str) -> None:
        """Drop a request at the next step (client disconnected)."""
        self._cancelled.add(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_rows(self) -> int:
        prefill = self.prefilling.rows if self.prefilling is not None else 0
        return sum(c.num_rows for c in self.cohorts) + prefill

    def _tokens_in_batch(self) -> int:
        return sum(self.budget(r) for r in self.running.values())

    def kv_usage(self) -> float:
        """The share (0-1) of `max_batch_tokens` that admitted requests hold: the cache room
        admission counts with (rows x (prompt + max new tokens)), what a load-aware router
        reads as KV-cache utilisation."""
        return min(self._tokens_in_batch() / self.limits.max_batch_tokens, 1.0)

    # -- the step --------------------------------------------------------------------------

    def step(self) -> StepEvents:
        """schedule -> execute -> update; returns what happened."""
        events = StepEvents()
        self._stepping = events
        started = self.clock()
        self._expire_and_cancel(events, started)
        events.admitted = self._admit(events, started)
        self._advance_prefill(events)
        if self.running:
            events.batch_rows = self.num_rows
            finished = self._each_cohort(RunningBatch.step, events)
            now = self.clock()
            for search in finished:
                ended = self.running.get(id(search))
                if ended is None:
                    continue
                self._report_tokens(ended, events, now)
                if search.error is not None:
                    self._end(ended, Outcome.FAILED, events, error=search.error)
                elif self.limits.batching == "static":
                    self._held.append((ended, search.hypotheses()))  # still in `running`
                else:
                    self._end(ended, Outcome.DONE, events, hypotheses=search.hypotheses())
            for running in self.running.values():
                self._report_tokens(running, events, now)
        self._release_held(events)
        events.step_seconds = self.clock() - started
        self._stepping = None
        return events

    def fail_all(self, error: Exception) -> StepEvents:
        """End every waiting and running request as failed and drop the running batches: the
        engine loop's way out when `step` itself raised (a bug), so that no request hangs on a
        scheduler that fails at every step and the next requests start from a clean state."""
        events = StepEvents()
        if self._stepping is not None:  # requests the failed step ended are answered as such
            events.ended.extend(self._stepping.ended)
            self._stepping = None
        requests = list(self._live.values())  # waiting, admitted halfway, running or held
        self.waiting.clear()
        self.running.clear()
        self.cohorts = []
        self.prefilling = None
        self._held = []
        self._cancelled = set()
        for request in requests:
            if request.outcome is None:
                self._end(request, Outcome.FAILED, events, error=error)
        self._live.clear()
        return events

    def _release_held(self, events: StepEvents) -> None:
        """Static batching: answer the finished requests once no row of theirs decodes."""
        if not self._held or any(len(c) for c in self.cohorts):
            return
        held, self._held = self._held, []
        for request, hypotheses in held:
            if request.outcome is None:  # not cancelled or expired while it waited
                self._end(request, Outcome.DONE, events, hypotheses=hypotheses)

    def _each_cohort(
        self,
        action: Callable[[RunningBatch[Any]], list[Search] | None],
        events: StepEvents,
        spared: frozenset[int] = frozenset(),
    ) -> list[Search]:
        """`action` on every cohort (its results joined); then only the cohorts with rows stay.
        When the backend fails inside it (a step, or a copy that compacts or joins rows), the
        cohort's requests of before, finished ones included and `spared` ids excepted, fail and
        the cohort is dropped: no request is left running with no batch to finish it."""
        results: list[Search] = []
        kept: list[RunningBatch[Any]] = []
        for cohort in self.cohorts:
            members = cohort.searches
            try:
                results += action(cohort) or []
            except Exception as exc:  # the runtime failed: fail this cohort, keep serving
                failed = [self.running[id(s)] for s in members if id(s) in self.running]
                failed = [r for r in failed if id(r.search) not in spared]
                log.exception("a running batch failed; failing its %d requests", len(failed))
                for request in failed:
                    self._end(request, Outcome.FAILED, events, error=exc)
                continue
            if len(cohort):
                kept.append(cohort)
        self.cohorts = kept
        return results

    def _expire_and_cancel(self, events: StepEvents, now: float) -> None:
        cancelled, self._cancelled = self._cancelled, set()

        def outcome(r: Request) -> Outcome | None:
            if r.id in cancelled:
                return Outcome.CANCELLED
            if r.deadline is not None and now >= r.deadline:
                return Outcome.DEADLINE
            return None

        for request in [r for r in self.waiting if outcome(r)]:
            self.waiting.remove(request)
            self._end(request, outcome(request) or Outcome.CANCELLED, events)
        doomed = [r for r in self.running.values() if outcome(r)]
        if doomed:
            searches = [r.search for r in doomed if r.search is not None]
            leaving = frozenset(id(s) for s in searches)
            self._drop_from_prefill(leaving, events)
            self._each_cohort(lambda c: c.remove(searches), events, spared=leaving)
            for request in doomed:
                self._end(request, outcome(request) or Outcome.CANCELLED, events)

    def _fitting(self) -> int:
        """How many requests at the head of the queue fit the batch now (FIFO: none skips)."""
        rows, tokens = self.num_rows, self._tokens_in_batch()
        n = 0
        for request in self.waiting:
            rows += request.rows
            tokens += self.budget(request)
            if rows > self.limits.max_batch_rows or tokens > self.limits.max_batch_tokens:
                break
            n += 1
        return n

    def _should_admit(self, n: int) -> bool:
        if n == 0 or self.prefilling is not None:  # FIFO: the next wait for the prefill
            return False
        if not self.running:
            return True
        if self.limits.batching != "continuous":
            return False
        if n == len(self.waiting) or _scored(self.waiting[0]):
            return True  # everything waiting fits (or a prefill of its own): no reason to wait
        rows = sum(self.waiting[i].rows for i in range(n))
        return rows >= self.limits.join_rows or self._since_admit >= self.limits.max_join_steps

    def _admit(self, events: StepEvents, now: float) -> int:
        """Move waiting requests (FIFO) into the batch while they fit; one `encode` for all."""
        self._since_admit += 1
        n = self._alone(self._fitting())
        if not self._should_admit(n):
            return 0
        rows = sum(self.waiting[i].rows for i in range(n))
        scored = _scored(self.waiting[0])
        chunked = scored or self._chunked([self.waiting[i] for i in range(n)])
        cohort = None if chunked else self._cohort_to_join(rows)
        if cohort is None and not chunked:
            return 0
        self._since_admit = 0
        admitted = [self.waiting.popleft() for _ in range(n)]
        admitted.sort(key=lambda r: len(r.source))  # encoded in length buckets, no reordering
        try:
            searches = [
                make_search(
                    r.options,
                    self.backend.spec,
                    start=r.start,
                    prefix=r.prefix,
                    stopper=r.stopper,
                    constraint=r.constraint,
                )
                for r in admitted
            ]
            if scored and not getattr(self.backend, "scores_prompts", False):
                raise ValueError("this model's backend cannot score prompts (prompt_logprobs)")
            prefixes = self._look_up(admitted, reuse=not scored)
            hit = prefixes is not None and any(p.tokens for p in prefixes)
            if hit and cohort is None and not scored and not self._chunked_rest(admitted):
                cohort = self._cohort_to_join(rows)  # the rest of a long prompt fits a call
            if cohort is None or (hit and self._chunked_rest(admitted)):
                # long prompts, or a prompt to score: a chunk per step
                self.prefilling = self._prefill(admitted, searches, prefixes, hit, scored)
                self._register(admitted, searches, now)
                return len(admitted)
            if hit:
                assert prefixes is not None
                state = self._resume(admitted, prefixes)
            else:
                state = cohort.encode([r.source for r in admitted])
            self._fill_cache(admitted, prefixes, state)
        except Exception as exc:
            log.exception("encoder failed for %d requests", len(admitted))
            for request in admitted:
                self._end(request, Outcome.FAILED, events, error=exc)
            return 0
        try:
            cohort.join(searches, state)  # a backend concatenation (copy) that can fail
        except Exception as exc:
            log.exception("joining %d requests to a running batch failed", len(admitted))
            for request in admitted:
                self._end(request, Outcome.FAILED, events, error=exc)
            return 0
        self._register(admitted, searches, now)
        if cohort not in self.cohorts:
            self.cohorts.append(cohort)
        return len(admitted)

    def _register(
        self, admitted: Sequence[Request], searches: Sequence[Search], now: float
    ) -> None:
        for request, search in zip(admitted, searches, strict=True):
            request.search = search
            request.admitted = now
            self.running[id(search)] = request

    def _alone(self, n: int) -> int:
        """Of the `n` requests at the head of the queue that fit, how many to admit together:
        a request whose prompt is scored is prefilled alone (its scores are then what it gets
        alone, whatever else runs), so the requests before it go first, then it."""
        for i in range(n):
            if _scored(self.waiting[i]):
                return i or 1
        return n

    # -- prompt reuse (engine/prefix_cache.py) ----------------------------------------------

    def _look_up(self, requests: Sequence[Request], reuse: bool) -> list[Prefix] | None:
        """Each request's cached prefix, its `cached_tokens` set (None without a cache; none
        reused unless `reuse`: a scored prompt computes every position)."""
        cache = self.prefix_cache
        if cache is None:
            return None
        if not reuse:
            return [Prefix(0, [], cache.digests(r.source, r.cache_salt)) for r in requests]
        prefixes = [cache.lookup(r.source, r.cache_salt) for r in requests]
        for request, prefix in zip(requests, prefixes, strict=True):
            request.cached_tokens = prefix.tokens
        return prefixes

    def _rest(
        self, requests: Sequence[Request], prefixes: Sequence[Prefix] | None
    ) -> tuple[IntArray, IntArray]:
        """The prompts' tokens after their cached prefixes: left-padded (B, S) ids and mask."""
        skip = [0] * len(requests) if prefixes is None else [p.tokens for p in prefixes]
        rest = [r.source[n:] for r, n in zip(requests, skip, strict=True)]
        pad = self.backend.spec.pad_id
        return left_padded(*pad_batch(rest, pad), pad)

    def _chunked_rest(self, requests: Sequence[Request]) -> bool:
        """Whether the prompts' uncached rest is prefilled a chunk per step."""
        chunk = self.limits.prefill_chunk
        return chunk > 0 and max(len(r.source) - r.cached_tokens for r in requests) > chunk

    def _prefill(
        self,
        requests: list[Request],
        searches: list[Search],
        prefixes: list[Prefix] | None,
        hit: bool,
        scored: bool,
    ) -> _Prefill:
        """A prefill a chunk per step of the prompts (after their cached prefixes if `hit`)."""
        backend: Any = self.backend
        ids, mask = self._rest(requests, prefixes if hit else None)
        if hit:
            assert prefixes is not None
            state = backend.from_prefixes([p.blocks for p in prefixes])
        else:
            state = backend.empty(len(requests))
        used = mask.any(axis=0)
        start = int(used.argmax()) if used.any() else mask.shape[1]
        scores: list[TokenLogprob] | None = [] if scored else None
        return _Prefill(requests, searches, ids, mask, start, state, scores, prefixes)

    def _resume(self, requests: Sequence[Request], prefixes: Sequence[Prefix]) -> Any:
        """The state of prompts whose cached prefixes are read back and the rest prefilled."""
        backend: Any = self.backend
        state = backend.from_prefixes([p.blocks for p in prefixes])
        ids, mask = self._rest(requests, prefixes)
        used = mask.any(axis=0)
        if used.any():
            start = int(used.argmax())
            _, state = backend.extend(state, ids[:, start:], mask[:, start:])
        return state

    def _fill_cache(
        self, requests: Sequence[Request], prefixes: Sequence[Prefix] | None, state: Any
    ) -> None:
        """Copy the prefilled prompts' full blocks that the cache lacks into it (row i of
        `state` is request i's)."""
        cache = self.prefix_cache
        if cache is None or prefixes is None:
            return
        backend: Any = self.backend
        try:
            for row, prefix in enumerate(prefixes):

                def columns(start: int, end: int, row: int = row) -> Any:
                    return backend.prefix_columns(state, row, end, start)

                cache.insert(prefix, columns)
        except Exception:  # the requests go on without their prompts kept
            log.exception("keeping %d prompts in the prefix cache failed", len(prefixes))

    def _keep_answer(self, search: Search, state: Any, row: int) -> None:
        """Copy the full blocks of a leaving request's prompt and answer that the cache lacks
        into it, from its row of `state` (RunningBatch.on_leave): single-sequence searches
        (greedy, sampling) that finished or were cancelled; not beams, whose rows reorder, nor
        failures. The row holds the prompt but its last token, then a token a step: the
        prompt's last and every generated one but the last, which was never fed."""
        cache = self.prefix_cache
        request = self.running.get(id(search))
        if (
            cache is None
            or request is None
            or search.error is not None
            or not isinstance(search, GreedySearch)
        ):
            return
        fed = len(request.source) + search.steps
        if fed // cache.block <= len(request.source) // cache.block:
            return  # no block past the prompt's, which were kept at admission
        tokens = [*request.prefix, *search.tokens][:fed]
        backend: Any = self.backend
        try:
            sequence = Prefix(0, [], cache.digests(tokens, request.cache_salt))

            def columns(start: int, end: int) -> Any:
                return backend.prefix_columns(state, row, end, start)

            cache.insert(sequence, columns)
        except Exception:  # the request's answer is not kept; nothing else changes
            log.exception("keeping a finished request's answer in the prefix cache failed")

    def _chunked(self, requests: Sequence[Request]) -> bool:
        """Whether these requests' prompts are prefilled a chunk per step (language models
        whose backend can, when the longest prompt is over `prefill_chunk`)."""
        chunk = self.limits.prefill_chunk
        return (
            chunk > 0
            and self.backend.spec.decoder_only
            and hasattr(self.backend, "extend")
            and max(len(r.source) for r in requests) > chunk
        )

    def _advance_prefill(self, events: StepEvents) -> None:
        """Prefill the next chunk of the prefilling prompts; once done, they join a cohort
        (and decode their first token in this step)."""
        prefill = self.prefilling
        if prefill is None:
            return
        width = prefill.ids.shape[1]
        chunk = self.limits.prefill_chunk or width
        if prefill.scores is not None:  # every position's logits: a chunk they fit
            chunk = score_tokens(self.backend.spec.vocab_size, chunk)
        end = min(prefill.done + chunk, width)
        try:
            if end > prefill.done:
                ids = prefill.ids[:, prefill.done : end]
                mask = prefill.mask[:, prefill.done : end]
                extend = self.backend.extend  # type: ignore[attr-defined]
                # each row's whole prompt (its last token comes in the first step): the
                # chunks get that length's rotary frequencies, however the prompt is cut
                prompts = np.array([len(r.source) + 1 for r in prefill.requests])
                if prefill.scores is None:
                    _, prefill.state = extend(prefill.state, ids, mask, prompt_lengths=prompts)
                else:  # one request, no padding: column c holds prompt token c
                    logits, prefill.state = extend(
                        prefill.state, ids, mask, all_positions=True, prompt_lengths=prompts
                    )
                    (request,) = prefill.requests
                    targets = request.prefix[prefill.done + 1 : end + 1]
                    top = request.options.prompt_logprobs or 0
                    prefill.scores += score_positions(logits[0], targets, top)
        except Exception as exc:
            log.exception("prefill failed for %d requests", len(prefill.requests))
            self.prefilling = None
            for request in prefill.requests:
                self._end(request, Outcome.FAILED, events, error=exc)
            return
        prefill.done = end
        if end < width:
            return
        if prefill.scores is not None:
            prefill.requests[0].prompt_logprobs = [None, *prefill.scores]
        self.prefilling = None
        cohort = self._cohort_to_join(prefill.rows, new_anyway=True)
        assert cohort is not None
        try:
            self._fill_cache(prefill.requests, prefill.prefixes, prefill.state)
            cohort.join(prefill.searches, prefill.state)
        except Exception as exc:
            log.exception("joining %d prefilled requests failed", len(prefill.requests))
            for request in prefill.requests:
                self._end(request, Outcome.FAILED, events, error=exc)
            return
        if cohort not in self.cohorts:
            self.cohorts.append(cohort)

    def _drop_from_prefill(self, leaving: frozenset[int], events: StepEvents) -> None:
        """Remove the rows of requests that left (cancelled, expired) from the prefill."""
        prefill = self.prefilling
        if prefill is None:
            return
        keep = [i for i, s in enumerate(prefill.searches) if id(s) not in leaving]
        if len(keep) == len(prefill.searches):
            return
        if not keep:
            self.prefilling = None
            return
        rows = np.asarray(keep, dtype=np.int64)
        try:
            prefill.state = self.backend.select(prefill.state, rows)
        except Exception as exc:
            log.exception("dropping rows from a prefill failed")
            self.prefilling = None
            for i in keep:
                self._end(prefill.requests[i], Outcome.FAILED, events, error=exc)
            return
        prefill.requests = [prefill.requests[i] for i in keep]
        prefill.searches = [prefill.searches[i] for i in keep]
        prefill.ids, prefill.mask = prefill.ids[rows], prefill.mask[rows]
        if prefill.prefixes is not None:  # row i's blocks are request i's
            prefill.prefixes = [prefill.prefixes[i] for i in keep]

    def _cohort_to_join(self, rows: int, new_anyway: bool = False) -> RunningBatch[Any] | None:
        """Where `rows` rows of new requests go: the youngest cohort if their rows x its age
        (steps) is within `max_join_padding`; else a new cohort while there is room for one
        (or `new_anyway`: prefilled requests hold their state already); else nowhere (None:
        they wait). All of them or none: a prefix that fits would keep joining a batch that
        should be left to finish."""
        young = min(self.cohorts, key=lambda c: c.steps, default=None)
        if young is not None and rows * young.steps <= self.limits.max_join_padding:
            return young
        if len(self.cohorts) < self.limits.max_cohorts or new_anyway:
            # static: finished rows decode on, as padding
            dead = 1.0 if self.limits.batching == "static" else None
            cohort: RunningBatch[Any] = RunningBatch(self.backend, dead_fraction=dead)
            if self.prefix_cache is not None:
                cohort.on_leave = self._keep_answer
            return cohort
        return None

    def _report_tokens(self, request: Request, events: StepEvents, now: float) -> None:
        """New tokens since the last report (greedy and sampling searches only)."""
        search = request.search
        if not isinstance(search, GreedySearch):
            if request.first_token is None and search is not None and search.steps > 0:
                request.first_token = now
            return
        if request.first_token is None and search.steps > 0:
            request.first_token = now
        if request.stream and len(search.tokens) > request.streamed:
            events.new_tokens.append((request, search.tokens[request.streamed :]))
            request.streamed = len(search.tokens)

    def _end(
        self,
        request: Request,
        outcome: Outcome,
        events: StepEvents,
        *,
        hypotheses: Sequence[Hypothesis] = (),
        error: Exception | None = None,
    ) -> None:
        if request.search is not None:
            self.running.pop(id(request.search), None)
        self._live.pop(id(request), None)
        request.outcome = outcome
        request.hypotheses = list(hypotheses)
        request.error = error
        request.finished = self.clock()
        events.ended.append(request)


def _scored(request: Request) -> bool:
    """Whether the request asks for its prompt's scores (prompt logprobs)."""
    return request.options.prompt_logprobs is not None
