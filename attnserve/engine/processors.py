"""Log-prob processors: the rules that forbid or reweight tokens before a token is chosen.

They work in place on a (R, V) float32 array of one request's rows, given each row's generated
tokens so far. Order and formulas follow Hugging Face's processors, so outputs match generate().
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from attnserve.engine.backend import FloatArray, ModelSpec
from attnserve.engine.options import DecodingOptions

# The sampling masks keep their input's precision (sampling works in float64).
Floats = TypeVar("Floats", npt.NDArray[np.float32], npt.NDArray[np.float64])

NEG_INF = np.float32(-np.inf)


class LogProbProcessor:
    """Repetition penalty, no-repeat n-grams, presence and frequency penalties, banned tokens,
    min length, forced first token (BOS) and forced final EOS.

    `prefix`: the prompt of a decoder-only model, which the repetition penalty and the no-repeat
    n-gram rule see before the generated tokens (as Hugging Face's processors see input_ids);
    presence and frequency penalties count generated tokens only (OpenAI's definition).
    """

    def __init__(
        self, options: DecodingOptions, spec: ModelSpec, prefix: Sequence[int] = ()
    ) -> None:
        self.options = options
        self.eos_id = spec.eos_id
        self.stops = sorted(spec.stops)
        # Marian: the pad token is never generated, nor a distinct decoder start token.
        self.banned = list(spec.never_generated)
        self.prefix = list(prefix)

    def bans(self, generated: int) -> list[int] | None:
        """The tokens this step's processing forbids when forbidding is all it does (its result
        is the raw row with these at -inf), for a search that chooses among a row's best tokens
        instead of the whole row; None when a rule reweights tokens or renormalizes."""
        opts = self.options
        if (
            opts.repetition_penalty != 1.0
            or opts.no_repeat_ngram_size > 0
            or opts.presence_penalty
            or opts.frequency_penalty
            or opts.renormalize
            or (opts.forced_bos_id is not None and generated == 0)
            or (opts.forced_eos and generated == opts.max_new_tokens - 1)
        ):
            return None
        banned = list(self.banned)
        if generated < opts.min_new_tokens:
            banned += self.stops
        return banned

    def __call__(self, log_probs: FloatArray, histories: Sequence[Sequence[int]]) -> FloatArray:
        """log_probs (R, V), histories: R lists of generated tokens (equal lengths)."""
        opts = self.options
        seen = histories
        if self.prefix and (opts.repetition_penalty != 1.0 or opts.no_repeat_ngram_size > 0):
            seen = [[*self.prefix, *h] for h in histories]  # only when a rule reads it
        if opts.repetition_penalty != 1.0:
            for row, history in zip(log_probs, seen, strict=True):
                apply_repetition_penalty(row, history, opts.repetition_penalty)
        if opts.no_repeat_ngram_size > 0:
            for row, history in zip(log_probs, seen, strict=True):
                row[banned_ngram_tokens(history, opts.no_repeat_ngram_size)] = NEG_INF
        if opts.presence_penalty or opts.frequency_penalty:
            for row, history in zip(log_probs, histories, strict=True):
                apply_count_penalties(row, history, opts.presence_penalty, opts.frequency_penalty)
        if self.banned:
            log_probs[:, self.banned] = NEG_INF
        generated = len(histories[0])
        if generated < opts.min_new_tokens:
            log_probs[:, self.stops] = NEG_INF
        if opts.forced_bos_id is not None and generated == 0:
            log_probs[:] = NEG_INF  # as HF: the forced token alone remains, with log-prob 0
            log_probs[:, opts.forced_bos_id] = 0.0
        if opts.forced_eos and generated == opts.max_new_tokens - 1:
            log_probs[:] = NEG_INF  # as HF: EOS alone remains, with log-prob 0
            log_probs[:, self.eos_id] = 0.0
        if opts.renormalize:
            log_probs -= logsumexp(log_probs)
        return log_probs


def apply_repetition_penalty(row: FloatArray, history: Sequence[int], penalty: float) -> None:
    """CTRL's penalty (HF): scores of seen tokens are multiplied (if < 0) or divided by it."""
    if not history:
        return
    seen = np.unique(np.asarray(history, dtype=np.int64))
    scores = row[seen]
    with np.errstate(divide="ignore", over="ignore"):
        penalized = np.where(scores < 0, scores * penalty, scores / penalty)
    # a penalty near 0 (any value > 0 is allowed, as in Hugging Face) overflows float32:
    # keep the scores finite, so the log-softmax after it is not NaN
    limit = np.finfo(row.dtype).max / 4
    row[seen] = np.clip(penalized, -limit, limit)


def apply_count_penalties(
    row: FloatArray, history: Sequence[int], presence: float, frequency: float
) -> None:
    """OpenAI's penalties: score -= presence * (count > 0) + frequency * count, per token."""
    if not history:
        return
    tokens, counts = np.unique(np.asarray(history, dtype=np.int64), return_counts=True)
    row[tokens] -= (presence + frequency * counts).astype(row.dtype)


def banned_ngram_tokens(history: Sequence[int], n: int) -> list[int]:
    """Tokens that would repeat an n-gram already in `history`."""
    if len(history) + 1 < n:
        return []
    prefix = tuple(history[len(history) - n + 1 :]) if n > 1 else ()
    return [
        history[i + n - 1]
        for i in range(len(history) - n + 1)
        if tuple(history[i : i + n - 1]) == prefix
    ]


def top_k_mask(logits: Floats, k: int) -> Floats:
    """Keep the k highest logits of a (V,) row, -inf elsewhere (ties with the k-th kept).
    The result has the dtype of `logits` (sampling works in float64)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = np.partition(logits, -k)[-k]
    return np.where(logits < kth, NEG_INF, logits).astype(logits.dtype)


def min_p_mask(logits: Floats, min_p: float) -> Floats:
    """Keep tokens whose probability is at least min_p x the top token's (Hugging Face's
    MinPLogitsWarper, applied after temperature); the dtype of `logits` is kept."""
    if min_p <= 0.0:
        return logits
    threshold = np.max(logits) + np.log(min_p)  # p >= min_p * p_max in log space
    return np.where(logits < threshold, NEG_INF, logits).astype(logits.dtype)


def top_p_mask(logits: Floats, p: float) -> Floats:
    """Nucleus: keep the smallest set of highest-probability tokens whose mass reaches p (the
    most probable token always, however small p is). The dtype of `logits` is kept."""
    if p >= 1.0:
        return logits
    order = np.argsort(-logits, kind="stable")
    probs = softmax(logits[order]).astype(np.float64)
    # Keep a token if the mass before it is still below p.
    before = np.cumsum(probs) - probs
    keep = np.zeros(logits.shape[-1], dtype=bool)
    keep[order[before < p]] = True
    keep[order[0]] = True  # a p below float precision still keeps the top token
    return np.where(keep, logits, NEG_INF).astype(logits.dtype)


def log_softmax(x: FloatArray) -> FloatArray:
    """Row-wise log-softmax of (..., V) logits, float32 (a new array)."""
    return (x - logsumexp(x)).astype(np.float32, copy=False)


def logsumexp(x: FloatArray) -> FloatArray:
    """Row-wise log-sum-exp of (R, V) -> (R, 1); rows of all -inf give -inf."""
    top = np.max(x, axis=-1, keepdims=True)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return (np.log(np.exp(x - safe).sum(axis=-1, keepdims=True)) + safe).astype(np.float32)


def softmax(x: Floats) -> Floats:
    """Softmax of a (V,) row, in the dtype of `x`."""
    z = np.exp(x - np.max(x))
    return (z / z.sum()).astype(x.dtype)
