"""Search algorithms for one request: greedy, sampling, beam.

A `Search` owns `num_rows` rows of a running batch. Each step it receives its rows' log-probs
(R, V), chooses tokens, and returns the parent row of every row it keeps for the next step
(beam reordering; an empty array once it is done). It never sees a runtime, a tensor or the
other requests, so one batch can mix greedy, sampling and beam requests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from attnserve.engine.backend import FloatArray, IntArray, ModelSpec
from attnserve.engine.options import DecodingOptions
from attnserve.engine.processors import LogProbProcessor, softmax, top_k_mask, top_p_mask

EMPTY = np.zeros(0, dtype=np.int64)
# top_indices() filters with the maxima of chunks of this many values before sorting the rest.
CHUNK = 512


def top_indices(values: FloatArray, n: int, rank: IntArray | None = None) -> IntArray:
    """Indices of the n largest of a flat (N,) array, best first. Ties go to the lower index,
    or, with `rank` (R,) for values that are R rows of N / R, to the lower (rank[row], column):
    the order the rows would have if they were sorted by rank.

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
            ties = survivors if rank is None else _ranked(survivors, rank, size)
            order = np.lexsort((ties, -values[survivors]))  # value desc, then tie order
            return survivors[order[:n]]
    if rank is None:
        return np.argsort(-values, kind="stable")[:n]
    everything = np.arange(size)
    return np.lexsort((_ranked(everything, rank, size), -values))[:n]


def _ranked(indices: IntArray, rank: IntArray, size: int) -> IntArray:
    """Flat indices of R rows renumbered as if the rows were in rank order."""
    width = size // rank.shape[0]
    rows, columns = np.divmod(indices, width)
    return rank[rows] * width + columns


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
class Hypothesis:
    """A finished output: generated tokens (without EOS) and its scores."""

    tokens: tuple[int, ...]
    score: float  # log_prob / (length incl. EOS) ** length_penalty
    log_prob: float  # sum of the (processed) log-probs of the chosen tokens
    ended_with_eos: bool


def normalized(log_prob: float, length: int, length_penalty: float) -> float:
    return float(log_prob / (length**length_penalty))


class Search(ABC):
    """Decoding state of one request."""

    def __init__(self, options: DecodingOptions, spec: ModelSpec) -> None:
        self.options = options
        self.spec = spec
        self.process = LogProbProcessor(options, spec)
        self.num_rows = 1
        self.last_tokens: IntArray = np.array([spec.start_id], dtype=np.int64)
        self.done = False
        self.steps = 0
        self.error: Exception | None = None  # set when decoding this request failed

    @abstractmethod
    def step(self, log_probs: FloatArray) -> IntArray:
        """Consume log-probs (num_rows, V); return parent rows (R',) for the next step."""

    @abstractmethod
    def hypotheses(self) -> list[Hypothesis]:
        """The n-best list, best first (at most num_hypotheses)."""

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

    def __init__(self, options: DecodingOptions, spec: ModelSpec) -> None:
        super().__init__(options, spec)
        self.tokens: list[int] = []
        self.log_prob = 0.0
        self.ended_with_eos = False

    def choose(self, log_probs: FloatArray) -> int:
        """log_probs (V,) -> token id"""
        return int(np.argmax(log_probs))

    def step(self, log_probs: FloatArray) -> IntArray:
        row = self.process(log_probs, [self.tokens])[0]
        token = self.choose(row)
        self.log_prob += float(row[token])
        self.steps += 1
        if token == self.spec.eos_id:
            self.ended_with_eos = True
            return self._finish()
        self.tokens.append(token)
        if self.steps >= self.options.max_new_tokens:
            return self._finish()
        self.last_tokens = np.array([token], dtype=np.int64)
        return np.zeros(1, dtype=np.int64)

    def hypotheses(self) -> list[Hypothesis]:
        score = normalized(self.log_prob, max(self.steps, 1), self.options.length_penalty)
        return [Hypothesis(tuple(self.tokens), score, self.log_prob, self.ended_with_eos)]


class SamplingSearch(GreedySearch):
    """Random sampling with temperature, top-k and top-p, reproducible per request seed."""

    def __init__(self, options: DecodingOptions, spec: ModelSpec) -> None:
        super().__init__(options, spec)
        self.rng = np.random.default_rng(options.seed)

    def choose(self, log_probs: FloatArray) -> int:
        opts = self.options
        # In float64: log-probs over a tiny temperature overflow float32 (1e-40 made every
        # probability NaN and sampled the last token id). Below float64's range too: greedy.
        with np.errstate(over="ignore"):
            logits = log_probs.astype(np.float64) / opts.temperature
        if not np.isfinite(logits.max()):
            return int(np.argmax(log_probs))
        logits = top_p_mask(top_k_mask(logits, opts.top_k), opts.top_p)
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

    def __init__(self, options: DecodingOptions, spec: ModelSpec) -> None:
        super().__init__(options, spec)
        self.k = options.beam_size
        self.sequences: list[list[int]] = [[]]
        self.scores = np.zeros(1, dtype=np.float32)  # running sums of log-probs (R,)
        self.rank = np.zeros(1, dtype=np.int64)  # (R,) each row's place in score order
        self.finished: list[Hypothesis] = []  # best first, at most k
        self.improvable = True

    def step(self, log_probs: FloatArray) -> IntArray:
        opts, k, vocab, eos = self.options, self.k, log_probs.shape[1], self.spec.eos_id
        processed = self.process(log_probs, self.sequences)
        candidates = (processed + self.scores[:, None]).ravel()  # (R*V,)
        top = top_indices(candidates, 2 * k, self.rank)  # the 2k best continuations, best first
        # A handful of candidates: plain Python from here on (numpy calls cost more).
        scores = candidates[top].tolist()
        parents, tokens = [], []
        for index in top.tolist():
            parent, token = divmod(index, vocab)
            parents.append(parent)
            tokens.append(token)
        self.steps += 1
        at_limit = self.steps >= opts.max_new_tokens
        ends = [at_limit or token == eos for token in tokens]

        if self.improvable and not (opts.early_stopping is True and len(self.finished) >= k):
            for rank in range(min(k, len(tokens))):
                if ends[rank]:
                    ended = tokens[rank] == eos
                    seq = self.sequences[parents[rank]] + ([] if ended else [tokens[rank]])
                    score = normalized(scores[rank], self.steps, opts.length_penalty)
                    self._add(Hypothesis(tuple(seq), score, scores[rank], ended))

        keep = [rank for rank in range(len(tokens)) if not ends[rank]][:k]
        if at_limit or not keep:
            return self._finish()
        order = stay_in_place([parents[rank] for rank in keep])  # row j <- keep[order[j]]
        self.rank = np.array(order, dtype=np.int64)
        keep = [keep[j] for j in order]
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


def make_search(options: DecodingOptions, spec: ModelSpec) -> Search:
    """The search for these options (validated by the caller)."""
    if options.beam_size > 1:
        return BeamSearch(options, spec)
    if options.sampling:
        return SamplingSearch(options, spec)
    return GreedySearch(options, spec)
