"""Search algorithms for one request: greedy, sampling, beam.

A `Search` owns `num_rows` rows of a running batch. Each step it receives its rows' log-probs
(R, V), chooses tokens, and returns the parent row of every row it keeps for the next step
(beam reordering; an empty array once it is done). It never sees a runtime, a tensor or the
other requests, so one batch can mix greedy, sampling and beam requests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from attnserve.engine.backend import Candidates, FloatArray, IntArray, ModelSpec
from attnserve.engine.constraints import Constraint
from attnserve.engine.options import DecodingOptions
from attnserve.engine.processors import (
    NEG_INF,
    LogProbProcessor,
    log_softmax,
    logsumexp,
    min_p_mask,
    softmax,
    top_k_mask,
    top_p_mask,
)

# Says whether the generated tokens end with a stop string (the caller decodes text).
Stopper = Callable[[Sequence[int]], bool]

EMPTY = np.zeros(0, dtype=np.int64)
# top_indices() filters with the maxima of chunks of this many values before sorting the rest.
CHUNK = 512


def top_indices(
    values: FloatArray, n: int, rank: IntArray | None = None, own: FloatArray | None = None
) -> IntArray:
    """Indices of the n largest of a flat (N,) array, best first. Ties go to the lower index,
    or, with `rank` (R,) for values that are R rows of N / R, to the lower (rank[row], column):
    the order the rows would have if they were sorted by rank. `own` (N,): what each value was
    before its row's beam score was added; equal sums of a row go to the larger own value
    first (float32 rounding can make distinct log-probs equal once a score is added: the row's
    order stays that of its log-probs, which is what its best tokens alone give).

    A full sort or argpartition of beam search's R*V candidates is a costly pass over every
    value, when only 2k of them are wanted; instead, the n-th largest of the chunk maxima is a
    threshold that at least n values reach (each maximum is a value), so only the few values
    above it are sorted. Cheap vectorised passes
    (max, >=, nonzero) do the rest. NaN or too many -inf fall back to the full sort.
    """
    size = values.shape[0]
    n = min(n, size)
    chunks = size // CHUNK
    if chunks >= max(n, 4):
        maxima = values[: chunks * CHUNK].reshape(chunks, CHUNK).max(axis=1)  # (chunks,)
        threshold = np.partition(maxima, chunks - n)[chunks - n]
        survivors = np.flatnonzero(values >= threshold)
        if survivors.size >= n:
            order = np.lexsort(_tie_keys(survivors, values, rank, own))
            return survivors[order[:n]]
    if rank is None and own is None:
        return np.argsort(-values, kind="stable")[:n]
    return np.lexsort(_tie_keys(np.arange(size), values, rank, own))[:n]


def _tie_keys(
    indices: IntArray, values: FloatArray, rank: IntArray | None, own: FloatArray | None
) -> tuple[npt.NDArray[Any], ...]:
    """np.lexsort keys (the last one first) of `top_indices`' order for `indices`: value
    descending, then the row's rank, then the own value descending, then the column."""
    rows, columns = (
        (None, indices) if rank is None else np.divmod(indices, values.shape[0] // rank.shape[0])
    )
    keys: list[npt.NDArray[Any]] = [columns]
    if own is not None:
        keys.append(-own[indices])
    if rank is not None:
        keys.append(rank[rows])
    keys.append(-values[indices])
    return tuple(keys)


def stay_in_place(parents: Sequence[int]) -> list[int]:
    """An order of the kept beams in which as many as possible sit in their parent's row.

    Beam i of `parents` (rank order) continues row parents[i]. The rows of the running batch
    hold the beams' caches, and a backend copies the rows whose parent differs (beam
    reordering), so putting a child of row j back in row j spares that copy. Position j takes
    the best-ranked unplaced beam whose parent is j; the other beams fill the positions left, in
    rank order. Returns `order`: position j holds beam order[j].
    """
    n = len(parents)
    order = [-1] * n
    placed = [False] * n
    for beam, parent in enumerate(parents):
        if parent < n and order[parent] < 0:
            order[parent] = beam
            placed[beam] = True
    rest = iter([beam for beam in range(n) if not placed[beam]])
    return [beam if beam >= 0 else next(rest) for beam in order]


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-prob under the model (before penalties and temperature) and the
    `top` most likely tokens of that step, best first; `rank`: 1 + the tokens more likely
    than it (prompt tokens' scores carry it, engine/scoring.py)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass(frozen=True)
class Hypothesis:
    """A finished output: generated tokens (without EOS) and its scores."""

    tokens: tuple[int, ...]
    score: float  # log_prob / (length incl. EOS) ** length_penalty
    log_prob: float  # sum of the (processed) log-probs of the chosen tokens
    ended_with_eos: bool  # ended with a stop token (EOS, or the model's end of turn)
    stopped: bool = False  # ended with a stop string (tokens include the one completing it)
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, when asked for
    # The stop token's (EOS, end of turn) when the output ended with one and logprobs were
    # asked for: generated, though not in `tokens` (OpenAI's routes list it, as vLLM does).
    stop_logprob: TokenLogprob | None = None

    @property
    def finish_reason(self) -> str:
        """ "stop" (stop token or string) or "length" (max_new_tokens or the context)."""
        return "stop" if self.ended_with_eos or self.stopped else "length"


def token_logprob(log_probs: FloatArray, token: int, top: int) -> TokenLogprob:
    """The chosen token's log-prob in a (V,) row and the row's `top` best tokens."""
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        ids = top_indices(log_probs, top)
        best = tuple((int(i), float(log_probs[i])) for i in ids)
    return TokenLogprob(token, float(log_probs[token]), best)


def allowed(candidates: Candidates, banned: Sequence[int] | None) -> FloatArray:
    """The candidates' log-probs (R, K) with the banned tokens at -inf (a new array)."""
    values = candidates.log_probs.astype(np.float32, copy=True)
    for token in banned or ():  # a few ids: cheaper than np.isin
        values[candidates.ids == token] = NEG_INF
    return values


def normalized(log_prob: float, length: int, length_penalty: float) -> float:
    return float(log_prob / (length**length_penalty))


class Search(ABC):
    """Decoding state of one request."""

    def __init__(
        self,
        options: DecodingOptions,
        spec: ModelSpec,
        *,
        start: int | None = None,
        prefix: Sequence[int] = (),
        stopper: Stopper | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        """`start`: the first decoder input (default spec.start_id; a language model's is the
        last prompt token); `prefix`: the prompt tokens the processors see (decoder-only);
        `stopper`: a stop-string check over the generated tokens (greedy and sampling);
        `constraint`: a grammar the output must follow (engine/constraints.py), each row
        with its own matcher."""
        self.options = options
        self.grammar = None if constraint is None else constraint.rows()
        self.spec = spec
        self.stops = spec.stops
        self.process = LogProbProcessor(options, spec, prefix)
        self.stopper = stopper
        self.num_rows = 1
        first = spec.start_id if start is None else start
        self.last_tokens: IntArray = np.array([first], dtype=np.int64)
        self.done = False
        self.steps = 0
        self.error: Exception | None = None  # set when decoding this request failed

    @abstractmethod
    def step(self, log_probs: FloatArray) -> IntArray:
        """Consume log-probs (num_rows, V); return parent rows (R',) for the next step."""

    @abstractmethod
    def hypotheses(self) -> list[Hypothesis]:
        """The n-best list, best first (at most num_hypotheses)."""

    def wanted(self) -> int:
        """How many of each row's best tokens this step needs when the backend offers them
        instead of whole rows (`step_candidates`); 0: whole rows of log-probs."""
        return 0

    def prefetch(self) -> None:
        """Start what the next step needs besides the log-probs (a grammar's masks), before
        the decoder step runs."""
        if self.grammar is not None and not self.done:
            self.grammar.prefetch()

    def step_candidates(self, candidates: Candidates) -> IntArray:
        """`step` from each row's best tokens (at least `wanted()` of them): the same choice
        that `step` makes from the whole rows."""
        raise NotImplementedError(f"{type(self).__name__} reads whole rows of log-probs")

    def fail(self, error: Exception) -> None:
        """Stop with an error (the caller reports it to this request alone)."""
        self.error = error
        self._finish()

    def _finish(self) -> IntArray:
        self.done = True
        self.num_rows = 0
        self.last_tokens = EMPTY
        return EMPTY


class GreedySearch(Search):
    """The most likely token at every step."""

    def __init__(self, options: DecodingOptions, spec: ModelSpec, **kwargs: Any) -> None:
        super().__init__(options, spec, **kwargs)
        self.tokens: list[int] = []
        self.log_prob = 0.0
        self.ended_with_eos = False
        self.stopped = False
        self.logprobs: list[TokenLogprob] | None = None if options.logprobs is None else []
        self.stop_logprob: TokenLogprob | None = None

    def choose(self, log_probs: FloatArray) -> int:
        """log_probs (V,) (or logits) -> token id"""
        return int(np.argmax(log_probs))

    def step(self, log_probs: FloatArray) -> IntArray:
        """log_probs (1, V), or logits when the backend returns them."""
        logits = self.spec.returns_logits
        raw = None
        if self.logprobs is not None:  # the model's own distribution, before the processors
            raw = log_softmax(log_probs[0]) if logits else log_probs[0].copy()
        before = log_probs.copy() if self.grammar is not None else None  # processed in place
        processed = self.process(log_probs, [self.tokens])
        if self.grammar is not None:
            self.grammar.apply(processed, before)
        row = processed[0]
        token = self.choose(row)
        # the chosen token's log-prob, as log_softmax(row)[token] (the same float32 arithmetic)
        # without writing the whole row
        chosen = row[token] - logsumexp(row[None])[0, 0] if logits else row[token]
        return self._advance(token, float(chosen), raw)

    def wanted(self) -> int:
        # a subclass that chooses otherwise (sampling) reads whole rows
        if (
            self.logprobs is not None
            or self.grammar is not None
            or self.spec.returns_logits
            or type(self).choose is not GreedySearch.choose
        ):
            return 0
        banned = self.process.bans(len(self.tokens))
        return 0 if banned is None else 1 + len(banned)

    def step_candidates(self, candidates: Candidates) -> IntArray:
        values = allowed(candidates, self.process.bans(len(self.tokens)))[0]
        top = values.max()
        token = int(candidates.ids[0][values == top].min())  # the lowest id, as argmax of a row
        return self._advance(token, float(top), None)

    def _advance(self, token: int, log_prob: float, raw: FloatArray | None) -> IntArray:
        """Take `token` (its processed log-prob); `raw`: the row before processing, for the
        logprobs the request asked for."""
        self.log_prob += log_prob
        self.steps += 1
        logprob = None
        if raw is not None and self.logprobs is not None:
            logprob = token_logprob(raw, token, self.options.logprobs or 0)
        if token in self.stops:
            self.ended_with_eos = True
            self.stop_logprob = logprob
            return self._finish()
        self.tokens.append(token)
        if self.grammar is not None:
            self.grammar.advance([0], [token])
        if logprob is not None and self.logprobs is not None:
            self.logprobs.append(logprob)
        if self.stopper is not None and self.stopper(self.tokens):
            self.stopped = True
            return self._finish()
        if self.steps >= self.options.max_new_tokens:
            return self._finish()
        self.last_tokens = np.array([token], dtype=np.int64)
        return np.zeros(1, dtype=np.int64)

    def hypotheses(self) -> list[Hypothesis]:
        score = normalized(self.log_prob, max(self.steps, 1), self.options.length_penalty)
        logprobs = None if self.logprobs is None else tuple(self.logprobs)
        return [
            Hypothesis(
                tuple(self.tokens),
                score,
                self.log_prob,
                self.ended_with_eos,
                self.stopped,
                logprobs,
                self.stop_logprob,
            )
        ]


class SamplingSearch(GreedySearch):
    """Random sampling with temperature, top-k and top-p, reproducible per request seed."""

    def __init__(
        self,
        options: DecodingOptions,
        spec: ModelSpec,
        rng: np.random.Generator | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(options, spec, **kwargs)
        self.rng = rng if rng is not None else np.random.default_rng(options.seed)

    def choose(self, log_probs: FloatArray) -> int:
        opts = self.options
        # In float64: log-probs over a tiny temperature overflow float32 (1e-40 made every
        # probability NaN and sampled the last token id). Below float64's range too: greedy.
        with np.errstate(over="ignore"):
            logits = log_probs.astype(np.float64) / opts.temperature
        if not np.isfinite(logits.max()):
            return int(np.argmax(log_probs))
        # Hugging Face's order: temperature, top-k, top-p, min-p.
        logits = top_p_mask(top_k_mask(logits, opts.top_k), opts.top_p)
        logits = min_p_mask(logits, opts.min_p)
        cdf = np.cumsum(softmax(logits))
        token = int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"))
        return min(token, logits.shape[0] - 1)


class BeamSearch(Search):
    """Beam search with Hugging Face's candidate, finalisation and stopping rules.

    Each step takes the 2k best continuations of all beams; those among the top k that end
    (EOS, or the length limit) become hypotheses scored log_prob / length ** length_penalty, and
    the k best that do not end keep running. The first step runs one row (all beams are equal).
    Running beams are kept in the rows of their parents where they can (`stay_in_place`), not
    in score order, so that the backend moves few cache rows; `rank` remembers the score order,
    and candidate ties are broken in it, so every choice is the one beams in score order give.
    """

    def __init__(self, options: DecodingOptions, spec: ModelSpec, **kwargs: Any) -> None:
        super().__init__(options, spec, **kwargs)
        self.k = options.beam_size
        self.sequences: list[list[int]] = [[]]
        self.scores = np.zeros(1, dtype=np.float32)  # running sums of log-probs (R,)
        self.rank = np.zeros(1, dtype=np.int64)  # (R,) each row's place in score order
        self.finished: list[Hypothesis] = []  # best first, at most k
        self.improvable = True

    def step(self, log_probs: FloatArray) -> IntArray:
        k, vocab = self.k, log_probs.shape[1]
        if self.spec.returns_logits:  # beam search processes log-probs (as Hugging Face's)
            log_probs = log_softmax(log_probs)
        before = log_probs.copy() if self.grammar is not None else None  # processed in place
        processed = self.process(log_probs, self.sequences)
        if self.grammar is not None:
            self.grammar.apply(processed, before)
        candidates = (processed + self.scores[:, None]).ravel()  # (R*V,)
        # the 2k best continuations, best first
        top = top_indices(candidates, 2 * k, self.rank, processed.ravel())
        # A handful of candidates: plain Python from here on (numpy calls cost more).
        scores = candidates[top].tolist()
        parents, tokens = [], []
        for index in top.tolist():
            parent, token = divmod(index, vocab)
            parents.append(parent)
            tokens.append(token)
        return self._advance(parents, tokens, scores)

    def wanted(self) -> int:
        if self.spec.returns_logits or self.grammar is not None:
            return 0
        banned = self.process.bans(self.steps)
        return 0 if banned is None else 2 * self.k + len(banned)

    def step_candidates(self, candidates: Candidates) -> IntArray:
        """The 2k best of the rows' candidates, in `step`'s order (summed log-prob, row rank,
        own log-prob, token id). Within a row that order is the row's own (log-prob, then id:
        adding the score never reverses two log-probs), so each of the 2k best continuations
        of all rows is among its own row's 2k best allowed tokens, which the candidates hold."""
        own = allowed(candidates, self.process.bans(self.steps))
        values = own + self.scores[:, None]
        rows = np.repeat(np.arange(values.shape[0]), values.shape[1])
        flat, ids = values.ravel(), candidates.ids.ravel()
        top = np.lexsort((ids, -own.ravel(), self.rank[rows], -flat))[: 2 * self.k]
        return self._advance(rows[top].tolist(), ids[top].tolist(), flat[top].tolist())

    def _advance(self, parents: list[int], tokens: list[int], scores: list[float]) -> IntArray:
        """The step's 2k best continuations, best first: (parent row, token, summed log-prob)."""
        opts, k, stops = self.options, self.k, self.stops
        self.steps += 1
        at_limit = self.steps >= opts.max_new_tokens
        if self.grammar is not None:  # fewer than 2k tokens may be allowed: never keep -inf
            finite = [i for i, score in enumerate(scores) if score > -np.inf]
            parents, tokens = [parents[i] for i in finite], [tokens[i] for i in finite]
            scores = [scores[i] for i in finite]
        ends = [at_limit or token in stops for token in tokens]

        if self.improvable and not (opts.early_stopping is True and len(self.finished) >= k):
            for rank in range(min(k, len(tokens))):
                if ends[rank]:
                    ended = tokens[rank] in stops
                    seq = self.sequences[parents[rank]] + ([] if ended else [tokens[rank]])
                    score = normalized(scores[rank], self.steps, opts.length_penalty)
                    self._add(Hypothesis(tuple(seq), score, scores[rank], ended))

        keep = [rank for rank in range(len(tokens)) if not ends[rank]][:k]
        if at_limit or not keep:
            return self._finish()
        order = stay_in_place([parents[rank] for rank in keep])  # row j <- keep[order[j]]
        self.rank = np.array(order, dtype=np.int64)
        keep = [keep[j] for j in order]
        if self.grammar is not None:
            self.grammar.advance([parents[r] for r in keep], [tokens[r] for r in keep])
        self.sequences = [self.sequences[parents[r]] + [tokens[r]] for r in keep]
        self.scores = np.array([scores[r] for r in keep], dtype=np.float32)
        self.last_tokens = np.array([tokens[r] for r in keep], dtype=np.int64)
        self.num_rows = len(keep)
        self.improvable = self._can_improve()
        if not self.improvable or (opts.early_stopping is True and len(self.finished) >= k):
            return self._finish()
        return np.array([parents[r] for r in keep], dtype=np.int64)

    def _add(self, hyp: Hypothesis) -> None:
        self.finished.append(hyp)
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.k :]

    def _can_improve(self) -> bool:
        """Could the best running beam still beat the worst kept hypothesis? (HF's heuristic)"""
        if len(self.finished) < self.k:
            return True
        opts = self.options
        if opts.early_stopping == "never" and opts.length_penalty > 0:
            best_length = opts.max_new_tokens
        else:
            best_length = self.steps
        best = float(self.scores[int(np.argmin(self.rank))])  # the best running beam
        best_possible = normalized(best, best_length, opts.length_penalty)
        return best_possible > self.finished[-1].score

    def hypotheses(self) -> list[Hypothesis]:
        return self.finished[: self.options.num_hypotheses]


class ParallelSampling(Search):
    """`num_samples` independent samples of one prompt: the first step reads the prompt's one
    row and starts every sample from it (each draws its own first token); from then on each
    sample owns a row, which leaves the batch when the sample ends. Sample i draws from its
    own stream of the request's seed (`SeedSequence(seed).spawn`), so results are
    reproducible and do not depend on the batch."""

    def __init__(self, options: DecodingOptions, spec: ModelSpec, **kwargs: Any) -> None:
        super().__init__(options, spec, **kwargs)
        streams = np.random.SeedSequence(options.seed).spawn(options.num_samples)
        one = options.replace(num_samples=1)
        self.samples = [
            SamplingSearch(one, spec, rng=np.random.default_rng(s), **kwargs) for s in streams
        ]
        self.active = list(range(len(self.samples)))  # sample of each row

    def step(self, log_probs: FloatArray) -> IntArray:
        first = self.steps == 0
        self.steps += 1
        parents: list[int] = []
        active: list[int] = []
        for row, sample in enumerate(self.active if not first else range(len(self.samples))):
            source = 0 if first else row
            # each sample processes its own copy (the processors work in place)
            kept = self.samples[sample].step(log_probs[source : source + 1].copy())
            if kept.size:
                parents.append(source)
                active.append(sample)
        self.active = active
        if not active:
            return self._finish()
        self.num_rows = len(active)
        self.last_tokens = np.concatenate([self.samples[i].last_tokens for i in active])
        return np.array(parents, dtype=np.int64)

    def prefetch(self) -> None:
        for sample in self.samples:
            sample.prefetch()

    def fail(self, error: Exception) -> None:
        for sample in self.samples:
            if not sample.done:
                sample._finish()
        super().fail(error)

    def hypotheses(self) -> list[Hypothesis]:
        """One per sample, in sample order (not sorted: they are independent draws)."""
        return [sample.hypotheses()[0] for sample in self.samples]


def make_search(
    options: DecodingOptions,
    spec: ModelSpec,
    *,
    start: int | None = None,
    prefix: Sequence[int] = (),
    stopper: Stopper | None = None,
    constraint: Constraint | None = None,
) -> Search:
    """The search for these options (validated by the caller); see `Search` for the rest."""
    kind: type[Search] = GreedySearch
    if options.beam_size > 1:
        kind = BeamSearch
    elif options.sampling and options.num_samples > 1:
        kind = ParallelSampling
    elif options.sampling:
        kind = SamplingSearch
    return kind(options, spec, start=start, prefix=prefix, stopper=stopper, constraint=constraint)
