"""Texts as documents: each text of a translation request (plain or HTML) cut into sentences,
every sentence of every text decoded as its own engine request (so a long document fills a batch
and shares it with other requests), and the answers put back together in the source's layout.

A text's answer is defined from its sentences' (docs/ARCHITECTURE.md, "Documents"):
- `text`: the source with every sentence replaced by the best translation of it;
- `score`: the mean of its sentences' scores (each log-prob / length**length_penalty);
- `hypotheses[k]`: every sentence's k-th hypothesis (its best where it has fewer), score the mean;
- `sentences`: per sentence its source, translation, score and n-best, when a text has several
  and scores or an n-best list were asked for;
- `finish_reason`: "length" if any sentence ran into max_new_tokens.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from starlette.concurrency import run_in_threadpool

from attnserve.engine.scheduler import Request
from attnserve.model.languages import same_language
from attnserve.service.decoding import (
    _check_source_language,
    _model_source,
    _score,
    check_languages,
    deadline_seconds,
    decoding_options,
    finish_reason,
    new_requests,
    submit_all,
    text_name,
    texts_of,
    tokenize,
)
from attnserve.service.errors import ApiError
from attnserve.service.logs import request_id_var
from attnserve.service.models import ServedModel
from attnserve.service.schemas import (
    DetectedLanguage,
    GenerateRequest,
    Hypothesis,
    SentenceResult,
    TranslateRequest,
    Translation,
)
from attnserve.service.state import ServiceState
from attnserve.text.detect import Detection, detector_for
from attnserve.text.document import Document, UnitTooLong, split_document, whole
from attnserve.text.markup import Block, HtmlError, parse_html, render_block
from attnserve.text.segment import default_segmenter

log = logging.getLogger(__name__)

AUTO = "auto"
# Documents this long (characters, all texts of a request) are split on a worker thread.
INLINE_CHARS = 8192


@dataclass
class Part:
    """A run of units of one text: a plain document, or one block of an HTML text."""

    document: Document
    block: Block | None = None
    first: int = 0  # index of its first unit in Plan.units
    inline: dict[int, int] = field(default_factory=dict)  # block element -> unit index


@dataclass
class TextPlan:
    """One text of the request: its parts (HTML: verbatim markup between), language, target."""

    text: str
    prefix: str  # a target-language token typed at the start, given to every unit
    pieces: list[str | Part]
    detected: Detection | None = None
    unchanged: bool = False  # the detected language is the target: the text is the answer

    @property
    def parts(self) -> list[Part]:
        return [p for p in self.pieces if isinstance(p, Part)]


@dataclass
class Plan:
    """Every text's plan and the flat list of units to decode (with each unit's text index)."""

    texts: list[TextPlan]
    units: list[str]
    owners: list[int]
    source_langs: list[str | None]  # per unit: a detected source language, else None


def source_languages(model: ServedModel) -> list[str] | None:
    """The languages a translation model translates from (None: it does not say)."""
    tokenizer = model.tokenizer
    if tokenizer.multilingual_source:
        return list(tokenizer.languages)
    declared = tokenizer.source_lang
    if declared and declared not in ("mul", "multi"):
        return [declared]
    if tokenizer.layout != "hf" and tokenizer.target_languages:
        return list(tokenizer.target_languages)  # one model for every direction (ende-small)
    return None


def target_languages(model: ServedModel) -> list[str]:
    tokenizer = model.tokenizer
    if tokenizer.target_languages:
        return list(tokenizer.target_languages)
    return [tokenizer.target_lang] if tokenizer.target_lang else []


def detect(text: str, model: ServedModel, param: str = "source_lang") -> Detection:
    """The language of `text` among those the model translates from; 400 when it is none."""
    languages = source_languages(model)
    result = detector_for(languages).detect(text)
    if result is None:
        raise ApiError(
            400,
            f"could not detect the language of the text (model {model.name} translates from "
            f"{', '.join(languages or ['any language'])})",
            param=param,
        )
    if languages is not None and not any(same_language(result.language, x) for x in languages):
        raise ApiError(
            400,
            f"the text is in {result.language!r} (confidence {result.confidence:.2f}); model "
            f"{model.name} translates from {', '.join(languages)}",
            param=param,
        )
    return result


def plan_texts(
    body: TranslateRequest,
    texts: Sequence[str],
    model: ServedModel,
    service: ServiceState,
    target: str | None,
) -> Plan:
    """Detect, split and fit every text; ApiError for what cannot be translated."""
    fmt: Literal["text", "html"] = body.format
    split = body.split_sentences
    limit = model.max_input_tokens
    soft = service.settings.sentence_tokens
    segmenter = default_segmenter()
    auto = body.source_lang is not None and body.source_lang.lower() == AUTO
    model_source = None if auto else _check_source_language(body, model)
    model_language = body.source_lang if not auto else None
    model_language = model_language or model.tokenizer.source_lang
    plans: list[TextPlan] = []
    units: list[str] = []
    owners: list[int] = []
    source_langs: list[str | None] = []
    for i, text in enumerate(texts):
        where = text_name(body, i)
        prefix, rest = model.tokenizer.split_typed_target(text)
        detected = None
        source = None
        if auto:
            visible = _visible_text(rest, fmt, where)
            detected = detect(visible, model)
            source = detected.language
        tagged_target = target or (model.tokenizer.typed_target(text) if prefix else None)
        plan = TextPlan(text, prefix, [], detected)
        plans.append(plan)
        if (
            detected is not None
            and tagged_target
            and same_language(detected.language, tagged_target)
        ):
            plan.unchanged = True
            continue

        encoding_source = model_source
        if source is not None and model.tokenizer.multilingual_source:
            encoding_source = _model_source(model, source)

        def fits(unit: str, _prefix: str = prefix, _source: str | None = encoding_source) -> bool:
            return len(model.encode(_prefix + unit, target, _source)) <= limit

        def prefer(unit: str, _prefix: str = prefix, _source: str | None = encoding_source) -> bool:
            return len(model.encode(_prefix + unit, target, _source)) <= soft

        def document(plain: str, _source: str | None = source) -> Document:
            if not split:
                return whole(plain)
            language = _source or model_language
            return split_document(plain, segmenter, language, fits, prefer if soft else None)

        try:
            if fmt == "html":
                for piece in parse_html(rest):
                    if isinstance(piece, str):
                        plan.pieces.append(piece)
                        continue
                    part = Part(document(piece.plain), piece)
                    plan.pieces.append(part)
            else:
                plan.pieces.append(Part(document(rest)))
        except HtmlError as exc:
            raise ApiError(422, f"{where} is not well-formed HTML: {exc}", param="text") from exc
        except UnitTooLong as exc:
            raise ApiError(422, f"{where}: {exc}", param="text") from exc
        for part in plan.parts:
            part.first = len(units)
            for unit in part.document.units:
                units.append(prefix + unit)
                owners.append(i)
                source_langs.append(source)
            if part.block is not None:
                for k, element in enumerate(part.block.elements):
                    inner = part.block.plain[element.a : element.b].strip()
                    if inner and not element.keep and _inside_sentence(element, part.document):
                        part.inline[k] = len(units)
                        units.append(prefix + inner)
                        owners.append(i)
                        source_langs.append(source)
        if not any(p.document.spans for p in plan.parts):
            what = "only markup" if fmt == "html" else "only whitespace"
            raise ApiError(422, f"{where} has no text to translate ({what})", param="text")
    cap = min(service.settings.max_sentences_per_request, service.settings.max_waiting)
    if len(units) > cap:
        raise ApiError(
            422,
            f"text: {len(units)} sentences to translate; at most {cap} per request "
            "(send the document in parts)",
            param="text",
        )
    return Plan(plans, units, owners, source_langs)


def _inside_sentence(element: object, document: Document) -> bool:
    a, b = element.a, element.b  # type: ignore[attr-defined]
    return any(x <= a and b <= y and (a, b) != (x, y) for x, y in document.spans)


def _visible_text(text: str, fmt: str, where: str) -> str:
    if fmt != "html":
        return text
    try:
        blocks = [p.plain for p in parse_html(text) if isinstance(p, Block)]
    except HtmlError as exc:
        raise ApiError(422, f"{where} is not well-formed HTML: {exc}", param="text") from exc
    return " ".join(blocks)


async def plan(
    body: TranslateRequest,
    texts: Sequence[str],
    model: ServedModel,
    service: ServiceState,
    target: str | None,
) -> Plan:
    """`plan_texts`, on a worker thread when the texts are long (segmenting, detecting and
    fitting tokenize: milliseconds a kilobyte)."""
    if sum(len(t) for t in texts) > INLINE_CHARS:
        return await run_in_threadpool(plan_texts, body, texts, model, service, target)
    return plan_texts(body, texts, model, service, target)


def assemble(
    model: ServedModel,
    plan: Plan,
    results: Sequence[Request],
    *,
    return_scores: bool,
    token_ids: bool,
) -> list[Translation]:
    """One Translation per text from its units' finished requests."""
    decode = model.tokenizer.decode
    out: list[Translation] = []
    for text in plan.texts:
        detected = (
            DetectedLanguage(language=text.detected.language, confidence=text.detected.confidence)
            if text.detected is not None
            else None
        )
        if text.unchanged:
            out.append(
                Translation(
                    text=text.text, output_tokens=0, finish_reason="stop",
                    detected_language=detected, token_ids=[] if token_ids else None,
                )
            )  # fmt: skip
            continue
        requests: list[Request] = []
        rendered: list[str] = []
        nbest: list[list[str]] = []
        scores: list[list[float]] = []
        sentences: list[SentenceResult] = []
        for piece in text.pieces:
            if isinstance(piece, str):
                rendered.append(piece)
                continue
            n = len(piece.document.spans)
            done = list(results[piece.first : piece.first + n])
            requests.extend(done)
            best = [decode(r.hypotheses[0].tokens) if r.hypotheses else "" for r in done]
            for source, r in zip(piece.document.units, done, strict=True):
                hyps = [(decode(h.tokens), h.score) for h in r.hypotheses] or [("", float("-inf"))]
                nbest.append([h for h, _ in hyps])
                scores.append([s for _, s in hyps])
                sentences.append(
                    SentenceResult(
                        source=source, text=hyps[0][0], score=_score(hyps[0][1]),
                        hypotheses=[Hypothesis(text=h, score=_score(s)) for h, s in hyps]
                        if r.options.num_hypotheses > 1 else None,
                    )
                )  # fmt: skip
            if piece.block is None:
                rendered.append(piece.document.join(best))
            else:
                inline = {
                    k: decode(results[u].hypotheses[0].tokens) if results[u].hypotheses else ""
                    for k, u in piece.inline.items()
                }
                requests.extend(results[u] for u in piece.inline.values())
                rendered.append(render_block(piece.block, piece.document.spans, best, inline))
        first = requests[0]
        count = first.options.num_hypotheses
        hypotheses = None
        if count > 1:
            hypotheses = [
                Hypothesis(
                    text=_join_kth(text, nbest, k),
                    score=_mean([s[min(k, len(s) - 1)] for s in scores]),
                )
                for k in range(count)
            ]
        ids = [t for r in requests if r.hypotheses for t in r.hypotheses[0].tokens]
        many = len(sentences) > 1 and (return_scores or count > 1)
        out.append(
            Translation(
                text="".join(rendered),
                score=_mean([s[0] for s in scores]) if return_scores else None,
                hypotheses=hypotheses,
                output_tokens=sum(r.output_tokens for r in requests),
                finish_reason=(
                    "length" if any(finish_reason(r) == "length" for r in requests) else "stop"
                ),
                token_ids=ids if token_ids else None,
                detected_language=detected,
                sentences=sentences if many else None,
            )
        )
    return out


def _join_kth(text: TextPlan, nbest: list[list[str]], k: int) -> str:
    """The text with every sentence's k-th hypothesis (plain text; HTML keeps the best)."""
    parts: list[str] = []
    at = 0
    for piece in text.pieces:
        if isinstance(piece, str):
            parts.append(piece)
            continue
        n = len(piece.document.spans)
        chosen = [h[min(k, len(h) - 1)] for h in nbest[at : at + n]]
        at += n
        if piece.block is None:
            parts.append(piece.document.join(chosen))
        else:
            parts.append(render_block(piece.block, piece.document.spans, chosen, {}))
    return "".join(parts)


def _mean(values: Sequence[float]) -> float | None:
    finite = [v for v in values if v == v and abs(v) != float("inf")]
    if len(finite) != len(values) or not values:
        return None
    return sum(finite) / len(finite)


@dataclass
class TranslationRun:
    """A translation request in flight: its plan, and its units' engine requests."""

    model: ServedModel
    plan: Plan
    requests: list[Request]
    futures: list[asyncio.Future[Request]]
    timeout: float
    request_id: str

    def cancel(self) -> None:
        for request in self.requests:
            self.model.engine.cancel(request.id)


async def start_translation(
    body: TranslateRequest, service: ServiceState, model: ServedModel
) -> TranslationRun:
    """Validate, plan, tokenize and queue every unit of a translation request."""
    texts = texts_of(body, service)
    options = decoding_options(body, model, service)
    timeout = deadline_seconds(body, service)
    stream = isinstance(body, GenerateRequest) and body.stream
    if stream and body.format == "html":
        raise ApiError(422, "stream needs format text", param="stream")
    target = check_languages(body, texts, model)
    planned = await plan(body, texts, model, service, target)
    auto = body.source_lang is not None and body.source_lang.lower() == AUTO
    sources, options = await tokenize(
        body, planned.units, model, options, target, planned.source_langs if auto else None
    )
    request_id = request_id_var.get() or "request"
    requests = new_requests(request_id, sources, options, timeout, stream=stream)
    futures = submit_all(service, model, requests)
    return TranslationRun(model, planned, requests, futures, timeout, request_id)
