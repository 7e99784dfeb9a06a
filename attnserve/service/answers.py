"""A translation request's answers, put together from its sentences' finished requests.

A text's answer is defined from its sentences' (docs/ARCHITECTURE.md, "Documents"):
- `text`: the source with every sentence replaced by the best translation of it (HTML: the
  inline tags around the matching words; a sentence inside a kept element as sent);
- `score`: the mean of its sentences' scores (each log-prob / length**length_penalty);
- `hypotheses[k]`: every sentence's k-th hypothesis (its best where it has fewer), score the mean;
- `sentences`: per sentence its source, translation, score and n-best, when a text has several
  and scores or an n-best list were asked for;
- `finish_reason`: "length" if any sentence ran into max_new_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.concurrency import run_in_threadpool

from attnserve.engine.scheduler import Request
from attnserve.service.decoding import _score, finish_reason
from attnserve.service.documents import Part, Plan, TextPlan
from attnserve.service.models import ServedModel
from attnserve.service.schemas import DetectedLanguage, Hypothesis, SentenceResult, Translation
from attnserve.text.markup import render_block

# Answers with more units than this are put together on a worker thread (rendering HTML and
# decoding hundreds of sentences would hold up the event loop).
INLINE_UNITS = 32


def _nbest(model: ServedModel, request: Request | None, source: str) -> list[tuple[str, float]]:
    """A unit's hypotheses (text, score); a unit kept as sent has itself, unscored."""
    if request is None:
        return [(source, float("nan"))]
    decode = model.tokenizer.decode
    return [(decode(h.tokens), h.score) for h in request.hypotheses] or [("", float("-inf"))]


def _render(part: Part, chosen: list[str], inline: dict[int, str]) -> str:
    if part.block is None:
        return part.document.join(chosen)
    return render_block(part.block, part.document.spans, chosen, inline)


def _answer(
    model: ServedModel,
    text: TextPlan,
    results: Sequence[Request],
    return_scores: bool,
    token_ids: bool,
) -> Translation:
    detected = None
    if text.detected is not None:
        detected = DetectedLanguage(
            language=text.detected.language, confidence=text.detected.confidence
        )
    if text.unchanged:
        return Translation(
            text=text.text, output_tokens=0, finish_reason="stop",
            detected_language=detected, token_ids=[] if token_ids else None,
        )  # fmt: skip
    requests: list[Request] = []
    sentences: list[SentenceResult] = []
    scored: list[list[float]] = []
    parts: list[tuple[Part, list[list[str]], dict[int, str]]] = []
    count = 1
    for part in text.parts:
        done = [results[j] if j is not None else None for j in part.indices]
        requests.extend(r for r in done if r is not None)
        nbests = [_nbest(model, r, u) for r, u in zip(done, part.document.units, strict=True)]
        inline = {k: _nbest(model, results[j], "")[0][0] for k, j in part.inline.items()}
        requests.extend(results[j] for j in part.inline.values())
        parts.append((part, [[h for h, _ in hyps] for hyps in nbests], inline))
        for r, source, hyps in zip(done, part.document.units, nbests, strict=True):
            if r is None:
                continue
            count = r.options.num_hypotheses
            scored.append([s for _, s in hyps])
            sentences.append(
                SentenceResult(
                    source=source, text=hyps[0][0], score=_score(hyps[0][1]),
                    hypotheses=[Hypothesis(text=h, score=_score(s)) for h, s in hyps]
                    if count > 1 else None,
                )
            )  # fmt: skip

    def joined(k: int) -> str:
        out: list[str] = []
        rendered = iter(parts)
        for piece in text.pieces:
            if isinstance(piece, str):
                out.append(piece)
                continue
            part, texts, inline = next(rendered)
            out.append(_render(part, [h[min(k, len(h) - 1)] for h in texts], inline))
        return "".join(out)

    hypotheses = None
    if count > 1:
        hypotheses = [
            Hypothesis(text=joined(k), score=_mean([s[min(k, len(s) - 1)] for s in scored]))
            for k in range(count)
        ]
    ids = [t for r in requests if r.hypotheses for t in r.hypotheses[0].tokens]
    return Translation(
        text=joined(0),
        score=_mean([s[0] for s in scored]) if return_scores else None,
        hypotheses=hypotheses,
        output_tokens=sum(r.output_tokens for r in requests),
        finish_reason="length" if any(finish_reason(r) == "length" for r in requests) else "stop",
        token_ids=ids if token_ids else None,
        detected_language=detected,
        sentences=sentences if len(sentences) > 1 and (return_scores or count > 1) else None,
    )


def assemble(
    model: ServedModel,
    plan: Plan,
    results: Sequence[Request],
    *,
    return_scores: bool,
    token_ids: bool,
) -> list[Translation]:
    """One Translation per text from its units' finished requests."""
    return [_answer(model, t, results, return_scores, token_ids) for t in plan.texts]


async def answers(
    model: ServedModel,
    plan: Plan,
    results: Sequence[Request],
    *,
    return_scores: bool = False,
    token_ids: bool = False,
) -> list[Translation]:
    """`assemble`, on a worker thread for a large plan."""
    if len(plan.units) > INLINE_UNITS:
        return await run_in_threadpool(
            lambda: assemble(model, plan, results, return_scores=return_scores, token_ids=token_ids)
        )
    return assemble(model, plan, results, return_scores=return_scores, token_ids=token_ids)


def _mean(values: Sequence[float]) -> float | None:
    finite = [v for v in values if v == v and abs(v) != float("inf")]
    if len(finite) != len(values) or not values:
        return None
    return sum(finite) / len(finite)
