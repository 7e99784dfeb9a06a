"""Teacher-forced scores of a language model's prompt (prompt logprobs): each prompt token's
log-prob under the model given the tokens before it, its rank, and the most likely tokens there.

The scheduler scores a prompt when it prefills it (engine/scheduler.py): the backend's `extend`
returns the logits of every position of a chunk (`all_positions`), and `score_positions` turns
them into one `TokenLogprob` per token. Like the generated tokens' logprobs (search.py), these
are the model's own distribution: log_softmax of the logits, before any processor or
temperature.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from attnserve.engine.backend import FloatArray
from attnserve.engine.processors import log_softmax
from attnserve.engine.search import TokenLogprob

# Logits a scoring call may return at once: a chunk of a prompt that is scored holds
# (tokens, V) float32 logits and their log-softmax on the host, so its length is bounded by
# the vocabulary (SmolLM2's 49,152 tokens: 341 positions a call).
SCORE_BYTES = 64 * 2**20


def score_tokens(vocab_size: int, limit: int = 0) -> int:
    """Prompt tokens per scoring call: SCORE_BYTES of logits, at most `limit` (0: no limit)."""
    tokens = max(1, SCORE_BYTES // (4 * max(vocab_size, 1)))
    return min(tokens, limit) if limit > 0 else tokens


def score_positions(logits: FloatArray, targets: Sequence[int], top: int) -> list[TokenLogprob]:
    """logits (T, V) of T positions and the token that follows each (T,) -> each token's
    log-prob, rank (1 + the tokens more likely than it) and the `top` most likely tokens
    there, best first (ties to the lower id)."""
    if logits.shape[0] == 0:
        return []
    log_probs = log_softmax(logits)  # (T, V) float32
    rows = np.arange(log_probs.shape[0])
    chosen = log_probs[rows, np.asarray(targets, dtype=np.int64)]  # (T,)
    ranks = (log_probs > chosen[:, None]).sum(axis=1) + 1
    best: list[tuple[tuple[int, float], ...]] = [()] * len(rows)
    if top > 0:
        k = min(top, log_probs.shape[1])
        ids = np.argpartition(-log_probs, k - 1, axis=1)[:, :k]  # (T, k), unordered
        values = np.take_along_axis(log_probs, ids, axis=1)
        order = np.lexsort((ids, -values), axis=1)  # value descending, then the lower id
        ids = np.take_along_axis(ids, order, axis=1)
        values = np.take_along_axis(values, order, axis=1)
        best = [
            tuple(zip(row_ids.tolist(), row_values.tolist(), strict=True))
            for row_ids, row_values in zip(ids, values, strict=True)
        ]
    return [
        TokenLogprob(int(token), float(lp), best[i], int(rank))
        for i, (token, lp, rank) in enumerate(
            zip(targets, chosen.tolist(), ranks.tolist(), strict=True)
        )
    ]
