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
from attnserve.engine.processors import logsumexp
from attnserve.engine.search import TokenLogprob, top_indices

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
    there, best first (ties to the lower id).

    Log-probs are the logits less each row's log-sum-exp (log_softmax's float32 arithmetic),
    without writing the (T, V) log-probs; ranks and the best tokens compare logits, which
    order a row as its log-probs do; the best tokens are found with `top_indices` (a
    threshold from chunk maxima; an argpartition of every row is far slower: BENCHMARKS)."""
    count = logits.shape[0]
    if count == 0:
        return []
    rows = np.arange(count)
    tokens = np.asarray(targets, dtype=np.int64)
    norm = logsumexp(logits)[:, 0]  # (T,) float32
    chosen = logits[rows, tokens]  # (T,)
    logprobs = (chosen - norm).astype(np.float32)
    ranks = np.count_nonzero(logits > chosen[:, None], axis=1) + 1
    out = []
    for i in range(count):
        best: tuple[tuple[int, float], ...] = ()
        if top > 0:
            ids = top_indices(logits[i], top)
            values = (logits[i, ids] - norm[i]).astype(np.float32)
            best = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        out.append(TokenLogprob(int(tokens[i]), float(logprobs[i]), best, int(ranks[i])))
    return out
