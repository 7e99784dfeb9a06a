"""Texts as documents: each text of a translation request (plain or HTML) cut into sentences,
every sentence of every text decoded as its own engine request (so a long document fills a batch
and shares it with other requests); service/answers.py puts the answers back together.

A sentence is encoded as text only (`typed=False`): a target-language token typed at the start
of a text (`>>de<< ...`) names the target of all its sentences, and nothing inside a text, not
even a sentence that starts with `>>`, is read as one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from attnserve.engine.scheduler import Request
from attnserve.model.languages import same_language
from attnserve.service.decoding import (
    _check_source_language,
    _model_source,
    check_languages,
    deadline_seconds,
    decoding_options,
    new_requests,
    source_languages,
    submit_all,
    text_name,
    texts_of,
    tokenize,
)
from attnserve.service.errors import ApiError
from attnserve.service.logs import request_id_var
from attnserve.service.models import ServedModel
from attnserve.service.schemas import GenerateRequest, TranslateRequest
from attnserve.service.state import ServiceState
from attnserve.text.detect import Detection, detector_for
from attnserve.text.document import Document, TooManyUnits, UnitTooLong, split_document, whole
from attnserve.text.markup import Block, HtmlError, kept_units, parse_html
from attnserve.text.segment import default_segmenter

log = logging.getLogger(__name__)

AUTO = "auto"
# Documents this long (characters, all texts of a request) are planned on a worker thread.
INLINE_CHARS = 8192
# Detection reads a text's first characters: enough for a confident answer, and a bound.
DETECT_CHARS = 2000


@dataclass
class Part:
    """A run of units of one text: a plain document, or one block of an HTML text."""

    document: Document
    block: Block | None = None
    indices: list[int | None] = field(default_factory=list)  # span -> unit (None: kept as is)
    inline: dict[int, int] = field(default_factory=dict)  # block element -> unit


@dataclass
class TextPlan:
    """One text of the request: its parts (HTML: verbatim markup between), language."""

    text: str
    pieces: list[str | Part]
    detected: Detection | None = None
    unchanged: bool = False  # the detected language is the target: the text is the answer

    @property
    def parts(self) -> list[Part]:
        return [p for p in self.pieces if isinstance(p, Part)]


@dataclass
class Plan:
    """Every text's plan and the flat list of units to decode, each with its target and its
    detected source language (None: the request's)."""

    texts: list[TextPlan]
    units: list[str] = field(default_factory=list)
    targets: list[str | None] = field(default_factory=list)
    source_langs: list[str | None] = field(default_factory=list)

    def add(self, unit: str, target: str | None, source: str | None) -> int:
        self.units.append(unit)
        self.targets.append(target)
        self.source_langs.append(source)
        return len(self.units) - 1


def target_languages(model: ServedModel) -> list[str]:
    tokenizer = model.tokenizer
    if tokenizer.target_languages:
        return list(tokenizer.target_languages)
    return [tokenizer.target_lang] if tokenizer.target_lang else []


def detect(text: str, model: ServedModel, param: str = "source_lang") -> Detection:
    """The language of `text` (its first DETECT_CHARS) among those the model translates from;
    400 when it has no letters or is clearly another language."""
    languages = source_languages(model)
    result = detector_for(languages).detect(text[:DETECT_CHARS])
    if result is None:
        raise ApiError(
            400, "could not detect the language of the text: it has no letters", param=param
        )
    if languages is not None and not any(same_language(result.language, x) for x in languages):
        raise ApiError(
            400,
            f"the text is in {result.language!r} (confidence {result.confidence:.2f}); model "
            f"{model.name} translates from {', '.join(languages)}",
            param=param,
        )
    return result


def visible_text(text: str, fmt: str) -> str:
    """What a reader sees of a text: HTML's blocks (empty for markup that does not parse)."""
    if fmt != "html":
        return text
    try:
        return " ".join(p.plain for p in parse_html(text) if isinstance(p, Block))
    except HtmlError:
        return ""


class _Planner:
    """Splits the texts of one request into units (one Plan)."""

    def __init__(
        self, body: TranslateRequest, model: ServedModel, service: ServiceState, target: str | None
    ) -> None:
        self.body, self.model, self.target = body, model, target
        self.limit = model.max_input_tokens
        self.soft = service.settings.sentence_tokens
        self.cap = min(service.settings.max_sentences_per_request, service.settings.max_waiting)
        self.auto = body.source_lang is not None and body.source_lang.lower() == AUTO
        self.model_source = None if self.auto else _check_source_language(body, model)
        self.language = None if self.auto else body.source_lang or model.tokenizer.source_lang
        self.plan = Plan([])

    def text(self, i: int, text: str) -> None:
        where = text_name(self.body, i)
        tokenizer = self.model.tokenizer
        try:  # a token the model does not know was refused by check_languages
            typed = tokenizer.typed_target(text)
        except ValueError:
            typed = None
        _, rest = tokenizer.split_typed_target(text) if typed else ("", text)
        target = self.target or typed
        plan = TextPlan(text, [])
        self.plan.texts.append(plan)
        source = None
        if self.auto:
            visible = visible_text(rest, self.body.format)
            if not visible.strip():
                raise ApiError(422, f"{where} has no text to translate", param="text")
            plan.detected = detect(visible, self.model)
            source = plan.detected.language
            if target and same_language(source, target):
                plan.unchanged = True
                return
        try:
            self._pieces(plan, rest, target, source)
        except HtmlError as exc:
            raise ApiError(422, f"{where} is not well-formed HTML: {exc}", param="text") from exc
        except UnitTooLong as exc:
            raise ApiError(422, f"{where}: {exc}", param="text") from exc
        except TooManyUnits as exc:
            raise self._too_many() from exc
        if not any(p.document.spans for p in plan.parts):
            what = "only markup" if self.body.format == "html" else "only whitespace"
            raise ApiError(422, f"{where} has no text to translate ({what})", param="text")
        if len(self.plan.units) > self.cap:
            raise self._too_many()

    def _too_many(self) -> ApiError:
        return ApiError(
            422,
            f"text: more than {self.cap} sentences to translate in one request (send the "
            "document in parts)",
            param="text",
        )

    def _pieces(self, plan: TextPlan, rest: str, target: str | None, source: str | None) -> None:
        split = self._splitter(target, source)
        if self.body.format != "html":
            plan.pieces.append(self._part(split(rest), None, target, source))
            return
        for piece in parse_html(rest):
            if isinstance(piece, str):
                plan.pieces.append(piece)
            else:
                plan.pieces.append(self._part(split(piece.plain), piece, target, source))

    def _splitter(self, target: str | None, source: str | None) -> Callable[[str], Document]:
        model, limit, soft = self.model, self.limit, self.soft
        encoding_source = self.model_source
        if source is not None and model.tokenizer.multilingual_source:
            encoding_source = _model_source(model, source)
        counts: dict[str, int] = {}

        def tokens(unit: str) -> int:
            if unit not in counts:
                counts[unit] = len(model.encode(unit, target, encoding_source, typed=False))
            return counts[unit]

        def split(plain: str) -> Document:
            if not self.body.split_sentences:
                return whole(plain)
            budget = self.cap - len(self.plan.units)
            return split_document(
                plain, default_segmenter(), source or self.language,
                lambda u: tokens(u) <= limit, (lambda u: tokens(u) <= soft) if soft else None,
                max_units=budget,
            )  # fmt: skip

        return split

    def _part(
        self, document: Document, block: Block | None, target: str | None, source: str | None
    ) -> Part:
        part = Part(document, block)
        kept = set(kept_units(block, document.spans)) if block is not None else set()
        for k, unit in enumerate(document.units):
            part.indices.append(None if k in kept else self.plan.add(unit, target, source))
        if block is None:
            return part
        for k, element in enumerate(block.elements):
            inner = block.plain[element.a : element.b].strip()
            inside = any(
                x <= element.a and element.b <= y and (element.a, element.b) != (x, y)
                for x, y in document.spans
            )
            if inner and element.verbatim is None and inside:
                part.inline[k] = self.plan.add(inner, target, source)
        return part


def plan_texts(
    body: TranslateRequest,
    texts: Sequence[str],
    model: ServedModel,
    service: ServiceState,
    target: str | None,
) -> Plan:
    """Detect, split and fit every text; ApiError for what cannot be translated."""
    planner = _Planner(body, model, service, target)
    for i, text in enumerate(texts):
        planner.text(i, text)
    return planner.plan


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
        body,
        planned.units,
        model,
        options,
        target,
        planned.source_langs if auto else None,
        unit_targets=planned.targets,
    )
    request_id = request_id_var.get() or "request"
    requests = new_requests(request_id, sources, options, timeout, stream=stream)
    futures = submit_all(service, model, requests)
    return TranslationRun(model, planned, requests, futures, timeout, request_id)
