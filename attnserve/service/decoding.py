"""From an API request to scheduler requests and back: options, sources, admission, waiting.

Every check that can fail because of what the client sent raises ApiError (a 4xx naming the
`param`) before anything is queued.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Sequence
from typing import Any, Literal

from starlette.concurrency import run_in_threadpool
from starlette.types import Receive

from attnserve.engine.options import DecodingOptions, InvalidOption
from attnserve.engine.scheduler import Outcome, QueueFull, Request, RequestTooLarge
from attnserve.model.languages import same_language
from attnserve.service.errors import ApiError, shown
from attnserve.service.models import ServedModel
from attnserve.service.schemas import GenerateRequest, Hypothesis, TranslateRequest, Translation
from attnserve.service.state import ServiceState

log = logging.getLogger(__name__)
_SERIALS = itertools.count()  # engine request ids (new_requests)

TRANSLATE_OPTIONS = ("beam_size", "num_hypotheses", "max_new_tokens", "length_penalty")
GENERATE_OPTIONS = (
    *TRANSLATE_OPTIONS,
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "min_new_tokens",
    "early_stopping",
)
# Tokenize on a worker thread when the texts are long enough to hold up the event loop.
INLINE_CHARS = 8192


def resolve_model(service: ServiceState, name: str | None) -> ServedModel:
    model = service.registry.get(name)
    if model is None:
        known = ", ".join(m.name for m in service.registry)
        raise ApiError(
            404,
            f"unknown model {shown(name)}; served: {known}",
            param="model",
            type="model_not_found",
        )
    return model


def decoding_options(
    body: TranslateRequest, model: ServedModel, service: ServiceState
) -> DecodingOptions:
    """The model's defaults overridden by the request, validated (422 naming the param)."""
    generate = isinstance(body, GenerateRequest)
    base = model.defaults
    given: dict[str, Any] = {}
    for name in GENERATE_OPTIONS if generate else TRANSLATE_OPTIONS:
        value = getattr(body, name)
        if value is not None:
            given[name] = value
    if isinstance(body, GenerateRequest):
        # /v1/generate is raw decoding: greedy unless a beam (or sampling) is asked for.
        base = base.replace(beam_size=1, num_hypotheses=1, sampling=body.sampling)
        if body.stream and given.get("beam_size", 1) != 1:
            raise ApiError(422, "stream needs beam_size 1 (greedy or sampling)", param="beam_size")
    options = base.replace(**given)
    if "num_hypotheses" not in given:
        options = options.replace(num_hypotheses=1)
    try:
        options.validate(
            max_beam_size=service.settings.beam_limit,
            max_new_tokens_limit=model.max_new_tokens,
        )
    except InvalidOption as exc:
        raise ApiError(422, f"{exc.param} {exc.message}", param=exc.param) from exc
    return options


def text_name(body: TranslateRequest, i: int) -> str:
    """How errors name the request's i-th text: `text`, or `text[i]` in a list."""
    return "text" if isinstance(body.text, str) else f"text[{i}]"


def texts_of(body: TranslateRequest, service: ServiceState) -> list[str]:
    texts = [body.text] if isinstance(body.text, str) else list(body.text)
    # More texts than the waiting queue holds could never be queued: 422, not a 429 forever.
    limit = min(service.settings.max_texts_per_request, service.settings.max_waiting)
    if not texts:
        raise ApiError(422, "text: give a text or a non-empty list of texts", param="text")
    if len(texts) > limit:
        raise ApiError(422, f"text: {len(texts)} texts; at most {limit} per request", param="text")
    for i, text in enumerate(texts):
        where = text_name(body, i)
        if not text.strip():
            raise ApiError(422, f"{where} is empty", param="text")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800" in the JSON)
            raise ApiError(
                422, f"{where} is not valid Unicode: {exc.reason}", param="text"
            ) from exc
    if isinstance(body, GenerateRequest) and body.stream and not isinstance(body.text, str):
        raise ApiError(422, "stream needs a single text, not a list", param="stream")
    return texts


def _check_source_language(
    body: TranslateRequest, model: ServedModel, detected: bool = False
) -> str | None:
    """The source language of a model whose sources name it (NLLB, M2M100, mBART-50): the
    request's, else the tokenizer's default; 422 when unknown or missing. None for others,
    and where every unit's language was detected."""
    tokenizer = model.tokenizer
    if not tokenizer.multilingual_source or detected:
        return None
    name = body.source_lang or tokenizer.source_lang
    if name is None:
        raise ApiError(
            422, f"model {model.name} needs source_lang (one of its languages)", param="source_lang"
        )
    try:
        return str(tokenizer.language_tag(name))
    except ValueError as exc:
        raise ApiError(422, str(exc), param="source_lang") from exc


def source_languages(model: ServedModel) -> list[str] | None:
    """The languages a translation model translates from (None: it does not say)."""
    tokenizer = model.tokenizer
    if tokenizer.multilingual_source:
        return list(tokenizer.languages)
    declared = tokenizer.source_lang
    if declared in ("mul", "multi"):  # a Marian mul-* model reads any language
        return None
    if declared:
        return declared.split("+")  # opus-mt-ROMANCE-en: "fr+fr_BE+...+la"
    if tokenizer.layout != "hf" and tokenizer.target_languages:
        return list(tokenizer.target_languages)  # one model for every direction (ende-small)
    return None


def check_languages(body: TranslateRequest, texts: Sequence[str], model: ServedModel) -> str | None:
    """The target language to tag sources with (None: no tag); 422 for unsupported ones, and
    for a multi-target model's text that names no target (no `target_lang`, no language token
    typed at its start)."""
    tokenizer = model.tokenizer
    sources = source_languages(model) if not tokenizer.multilingual_source else None
    asked = body.source_lang
    if (
        asked is not None
        and asked.lower() != "auto"
        and sources
        and not any(same_language(asked, source) for source in sources)
    ):
        named = ", ".join(repr(source) for source in sources)
        raise ApiError(
            422,
            f"model {model.name} translates from {named}, not {shown(asked)}",
            param="source_lang",
        )
    tags = tokenizer.target_languages
    target = body.target_lang
    if target is None:
        if tokenizer.needs_target_lang:
            _check_typed_targets(body, texts, model)
        return None
    if not tags:  # single-target model: only its own language is fine
        if tokenizer.target_lang and same_language(target, tokenizer.target_lang):
            return None
        raise ApiError(
            422,
            f"model {model.name} translates into {tokenizer.target_lang!r} only",
            param="target_lang",
        )
    try:
        tokenizer.language_tag(target)
    except ValueError as exc:
        raise ApiError(422, str(exc), param="target_lang") from exc
    return target


def _check_typed_targets(body: TranslateRequest, texts: Sequence[str], model: ServedModel) -> None:
    """422 unless every text starts with a known target-language token (a multi-target
    model's source with neither that nor `target_lang` has no direction)."""
    tokenizer = model.tokenizer
    for i, text in enumerate(texts):
        where = text_name(body, i)
        try:
            typed = tokenizer.typed_target(text)
        except ValueError as exc:
            raise ApiError(422, f"{where}: {exc}", param="text") from exc
        if typed is None:
            example = tokenizer.target_token(tokenizer.target_languages[0])
            typing = f" or begin {where} with its language token ({example}, ...)"
            raise ApiError(
                422,
                f"model {model.name} translates into several languages: give target_lang "
                f"(one of {', '.join(tokenizer.target_languages)})"
                + (typing if tokenizer.tags_target_in_text else ""),
                param="target_lang",
            )


async def tokenize(
    body: TranslateRequest,
    units: Sequence[str],
    model: ServedModel,
    options: DecodingOptions,
    target: str | None,
    unit_sources: Sequence[str | None] | None = None,
    unit_targets: Sequence[str | None] | None = None,
) -> tuple[list[list[int]], DecodingOptions]:
    """Source ids of every unit (a sentence, or a whole text) and the options with the target
    language's forced first token (NLLB, M2M100, mBART-50: its code; models whose sources carry
    the target need none); 422 for a unit over the model's input limit. A unit's source
    language: its detected one (`unit_sources`), else the request's; a unit's target:
    `unit_targets` (a document's sentences: encoded as text only, see Tokenizer.encode_source),
    else `target`."""
    source = _check_source_language(body, model, detected=bool(unit_sources))
    forced = model.tokenizer.forced_bos_id(target)
    if forced is not None:
        options = options.replace(forced_bos_id=forced)
    langs = [source] * len(units)
    if unit_sources and model.tokenizer.multilingual_source:
        langs = [_model_source(model, lang) for lang in unit_sources]

    targets = list(unit_targets) if unit_targets is not None else [target] * len(units)
    typed = unit_targets is None

    def encode_all() -> list[list[int]]:
        return [
            model.encode(u, t, lang, typed=typed)
            for u, t, lang in zip(units, targets, langs, strict=True)
        ]

    if sum(len(u) for u in units) > INLINE_CHARS:
        sources = await run_in_threadpool(encode_all)
    else:
        sources = encode_all()
    limit = model.max_input_tokens
    for i, ids in enumerate(sources):
        if len(ids) > limit:
            whole_texts = units == texts_list(body)
            where = text_name(body, i) if whole_texts else f"a unit ({units[i][:40]!r}...)"
            raise ApiError(
                422,
                f"{where} has {len(ids)} tokens; the limit is {limit}",
                param="text",
            )
    return sources, options


def _model_source(model: ServedModel, lang: str | None) -> str | None:
    if lang is None:
        return None
    try:
        return str(model.tokenizer.language_tag(lang))
    except ValueError as exc:
        raise ApiError(400, str(exc), param="source_lang") from exc


def texts_list(body: TranslateRequest) -> list[str]:
    text = body.text
    return [] if text is None else [text] if isinstance(text, str) else list(text)


def deadline_seconds(body: TranslateRequest, service: ServiceState) -> float:
    settings = service.settings
    timeout_ms = body.timeout_ms if body.timeout_ms is not None else settings.default_timeout_ms
    if timeout_ms > settings.max_timeout_ms:
        raise ApiError(
            422, f"timeout_ms must be at most {settings.max_timeout_ms}", param="timeout_ms"
        )
    return timeout_ms / 1000.0


def submit_all(
    service: ServiceState, model: ServedModel, requests: Sequence[Request]
) -> list[asyncio.Future[Request]]:
    """Queue every request or none: 429 when the queue is full, 422 when one can never fit."""
    futures: list[asyncio.Future[Request]] = []
    try:
        for request in requests:
            futures.append(model.engine.submit(request))
    except QueueFull as exc:
        cancel_all(model, requests[: len(futures)])
        service.metrics.reject("queue_full")
        retry = str(service.settings.retry_after_seconds)
        raise ApiError(
            429, "the server is at capacity; retry later", headers={"Retry-After": retry}
        ) from exc
    except RequestTooLarge as exc:
        cancel_all(model, requests[: len(futures)])
        service.metrics.reject("request_too_large")
        param = "beam_size" if str(exc).startswith("beam_size") else "max_new_tokens"
        raise ApiError(422, f"request too large for this server: {exc}", param=param) from exc
    return futures


def cancel_all(model: ServedModel, requests: Sequence[Request]) -> None:
    for request in requests:
        if request.outcome is None:
            model.engine.cancel(request.id)


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client disconnects (the body has been read: only that can arrive)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def wait_all(
    model: ServedModel,
    requests: Sequence[Request],
    futures: Sequence[asyncio.Future[Request]],
    timeout: float,
    receive: Receive,
) -> Outcome:
    """Wait for every request; cancel the rest at the first that does not end DONE, at the
    deadline (DEADLINE) or when the client disconnects (CANCELLED)."""
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    pending: set[asyncio.Future[Request]] = set(futures)
    outcome = Outcome.DONE
    try:
        while pending:
            remaining = end - loop.time()
            if remaining <= 0:
                outcome = Outcome.DEADLINE
                break
            waited: set[asyncio.Future[Any]] = {*pending, watcher}
            done, _ = await asyncio.wait(
                waited, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
            if watcher in done:
                outcome = Outcome.CANCELLED
                break
            finished = [f for f in pending if f in done]
            pending -= done
            ended = [f.result().outcome or Outcome.FAILED for f in finished]
            bad = [o for o in ended if o is not Outcome.DONE]
            if bad:
                outcome = Outcome.FAILED if Outcome.FAILED in bad else bad[0]
                break
    finally:
        watcher.cancel()
        # At the deadline the scheduler ends the requests itself (Request.deadline) at its next
        # step, counted as deadline_exceeded; otherwise free their rows now.
        if pending and outcome is not Outcome.DEADLINE:
            cancel_all(model, requests)
    return outcome


def next_serial() -> int:
    """A number no other request in flight has (follows the client's request id)."""
    return next(_SERIALS)


def new_requests(
    request_id: str,
    sources: Sequence[Sequence[int]],
    options: DecodingOptions,
    timeout: float,
    stream: bool = False,
) -> list[Request]:
    deadline = time.monotonic() + timeout
    # The engine keys waiters and cancellations by id, so ids must be unique among requests in
    # flight: the client's X-Request-ID (kept for the logs) need not be, so a serial follows it.
    serial = next_serial()
    return [
        Request(
            id=f"{request_id}#{serial}/{i}",
            source=list(src),
            options=options,
            deadline=deadline,
            stream=stream,
            group=f"{request_id}#{serial}",
        )
        for i, src in enumerate(sources)
    ]


def _score(value: float) -> float | None:
    return value if math.isfinite(value) else None


def finish_reason(request: Request) -> Literal["stop", "length"]:
    """ "length" when the output hit max_new_tokens (a forced EOS there included), else "stop"."""
    if not request.hypotheses:
        return "length"
    best = request.hypotheses[0]
    if best.stopped:  # a stop string
        return "stop"
    at_limit = len(best.tokens) + int(best.ended_with_eos) >= request.options.max_new_tokens
    forced = best.ended_with_eos and request.options.forced_eos and at_limit
    return "stop" if best.ended_with_eos and not forced else "length"


def translation(
    model: ServedModel, request: Request, *, return_scores: bool, token_ids: bool
) -> Translation:
    """The answer for one finished request (best hypothesis first)."""
    hyps = request.hypotheses
    if not hyps:
        return Translation(text="", output_tokens=0, finish_reason="length")
    best = hyps[0]
    decode = model.tokenizer.decode
    nbest = None
    if request.options.num_hypotheses > 1:
        nbest = [Hypothesis(text=decode(h.tokens), score=_score(h.score)) for h in hyps]
    return Translation(
        text=decode(best.tokens),
        score=_score(best.score) if return_scores else None,
        hypotheses=nbest,
        output_tokens=request.output_tokens,
        finish_reason=finish_reason(request),
        token_ids=list(best.tokens) if token_ids else None,
    )
