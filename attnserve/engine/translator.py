"""Offline translation: text in, text out, through any Backend, in length-sorted batches."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnserve.engine.backend import Backend
from attnserve.engine.batch import RunningBatch
from attnserve.engine.options import DecodingOptions
from attnserve.engine.search import Hypothesis, Search, make_search

if TYPE_CHECKING:
    from attnserve.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class Translation:
    """One translated text: the best hypothesis first, the n-best list when asked for."""

    text: str
    score: float
    output_tokens: int
    input_tokens: int
    hypotheses: list[tuple[str, float]] = field(default_factory=list)


def decode_batch(
    backend: Backend[Any],
    sources: Sequence[Sequence[int]],
    options: Sequence[DecodingOptions],
    searches: Sequence[Search] | None = None,
) -> list[list[Hypothesis]]:
    """Decode token-id sources together, one batch, rows leaving as they finish.

    `searches`: made by the caller (a language model's start from their prompt's last token);
    default: `make_search` of each options."""
    batch: RunningBatch[Any] = RunningBatch(backend)
    if searches is None:
        searches = [make_search(opt, backend.spec) for opt in options]
    batch.join(searches, batch.encode(sources))
    while len(batch):
        batch.step()
    return [s.hypotheses() for s in searches]


# Decoder rows of an offline batch (the service's default --max-batch-rows too). On a CPU,
# ONNX Runtime decodes fastest per token at 16-64 rows a step: beyond that, each row's share
# of the working set carried from step to step costs more (docs/BENCHMARKS.md, "Batch size").
MAX_BATCH_ROWS = 64


def length_sorted_batches(lengths: Sequence[int], max_batch_size: int) -> Iterator[list[int]]:
    """Indices grouped into batches of similar length (longest first), at most max_batch_size."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    for start in range(0, len(order), max_batch_size):
        yield order[start : start + max_batch_size]


class Translator:
    """Tokenize, batch by length, decode, detokenize; outputs come back in input order."""

    def __init__(
        self, backend: Backend[Any], tokenizer: Tokenizer, defaults: DecodingOptions | None = None
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        # The model's own generation settings (e.g. Marian's num_beams, renormalize_logits).
        self.defaults = defaults or DecodingOptions()

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        *,
        backend: str = "torch",
        threads: int | None = None,
        **kwargs: Any,
    ) -> Translator:
        from attnserve.engine.loading import load_backend
        from attnserve.model.checkpoint import load_tokenizer, read_metadata

        generation = read_metadata(model_dir).get("generation", {})
        runtime = load_backend(model_dir, backend, threads=threads, **kwargs)
        defaults = DecodingOptions.model_defaults(generation, runtime.spec.max_positions)
        return cls(runtime, load_tokenizer(model_dir), defaults)

    def encode(
        self,
        text: str,
        target_lang: str | None = None,
        source_lang: str | None = None,
        typed: bool = True,
    ) -> list[int]:
        """Source ids, truncated to the model's max positions (documented behaviour); `typed`:
        see Tokenizer.encode_source."""
        return self.tokenizer.encode_source(
            text,
            typed=typed,
            target_lang=target_lang,
            source_lang=source_lang,
            max_length=self.backend.spec.max_positions,
        )

    def translate(
        self,
        texts: Sequence[str],
        options: DecodingOptions | None = None,
        *,
        target_lang: str | None = None,
        source_lang: str | None = None,
        max_batch_size: int = 32,
        max_batch_rows: int = MAX_BATCH_ROWS,
        typed: bool = True,
    ) -> list[Translation]:
        """Translations in input order. A batch holds at most `max_batch_size` sentences and
        `max_batch_rows` decoder rows (sentences x beam size). `typed`: a language token at a
        text's start names its target (Tokenizer.encode_source)."""
        options = options or self.defaults
        options.validate(max_new_tokens_limit=self.backend.spec.max_positions)
        forced = self.tokenizer.forced_bos_id(target_lang)  # NLLB, M2M100, mBART-50
        if forced is not None:
            options = options.replace(forced_bos_id=forced)
        sources = [
            self.encode(t, target_lang, source_lang, typed) if t.strip() else [] for t in texts
        ]
        results: list[Translation | None] = [None] * len(texts)
        todo = [i for i, src in enumerate(sources) if src]
        for i in set(range(len(texts))) - set(todo):
            results[i] = Translation(text="", score=0.0, output_tokens=0, input_tokens=0)
        per_batch = max(1, min(max_batch_size, max_batch_rows // options.beam_size))
        for batch in length_sorted_batches([len(sources[i]) for i in todo], per_batch):
            indices = [todo[j] for j in batch]
            nbest = decode_batch(
                self.backend, [sources[i] for i in indices], [options] * len(indices)
            )
            for i, hyps in zip(indices, nbest, strict=True):
                results[i] = self._translation(hyps, len(sources[i]))
        return [r for r in results if r is not None]

    def _translation(self, hyps: list[Hypothesis], input_tokens: int) -> Translation:
        texts = [(self.tokenizer.decode(h.tokens), h.score) for h in hyps]
        best = hyps[0]
        return Translation(
            text=texts[0][0],
            score=best.score,
            output_tokens=len(best.tokens) + int(best.ended_with_eos),
            input_tokens=input_tokens,
            hypotheses=texts,
        )
