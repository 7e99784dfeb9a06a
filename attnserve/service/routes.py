"""The endpoints: /v1/translate, /v1/generate (JSON or Server-Sent Events), /v1/models,
/healthz, /readyz, /metrics."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from attnserve.engine.constraints import GrammarError
from attnserve.engine.generator import StopStrings
from attnserve.engine.scheduler import Outcome
from attnserve.engine.scheduler import Request as EngineRequest
from attnserve.service.answers import answers
from attnserve.service.decoding import finish_reason, resolve_model, wait_all
from attnserve.service.documents import TranslationRun, start_translation
from attnserve.service.errors import ApiError, error_body, shown
from attnserve.service.generation import (
    check_kind,
    completion,
    prompt_tokens,
    start_lm,
    text_of,
    visible,
)
from attnserve.service.logs import request_id_var
from attnserve.service.models import ServedModel
from attnserve.service.openai_schemas import OpenAIModel, OpenAIModelList
from attnserve.service.schemas import (
    ErrorBody,
    FinalEvent,
    GenerateRequest,
    Status,
    TokenEvent,
    TranslateRequest,
    TranslateResponse,
    Usage,
)
from attnserve.service.state import Service

log = logging.getLogger(__name__)

router = APIRouter()
OWNED_BY = "attnserve"
STREAM_DEADLINE_GRACE = 1.0  # seconds

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": description}
    for status, description in {
        401: "API key missing or wrong (only when the server has one)",
        404: "Unknown model (param: model)",
        413: "Body larger than the server's max_body_bytes",
        422: "Invalid request; `param` names the offending field",
        429: "Queue full: retry after Retry-After seconds",
        500: "Decoding failed for this request (the body has its request id)",
        503: "Not ready yet, or shutting down",
        504: "Deadline (timeout_ms) exceeded",
    }.items()
}
_SSE_EVENT_DATA = {
    "anyOf": [
        {"const": "[DONE]"},
        {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {
                "anyOf": [
                    {"$ref": "#/components/schemas/TokenEvent"},
                    {"$ref": "#/components/schemas/FinalEvent"},
                    {"$ref": "#/components/schemas/ErrorBody"},
                ]
            },
        },
    ]
}
_SSE_DOC = {
    "text/event-stream": {
        # One Server-Sent Event (OpenAPI before 3.2: `schema` describes each event).
        "schema": {
            "type": "object",
            "properties": {"event": {"type": "string"}, "data": _SSE_EVENT_DATA},
            "required": ["data"],
        },
        "example": 'data: {"index": 0, "token_id": 17, "text": "Wie"}\n\n'
        'data: {"finish_reason": "stop", "text": "Wie geht es?", "output_tokens": 5, '
        '"usage": {"input_tokens": 4, "output_tokens": 5}}\n\ndata: [DONE]\n\n',
    }
}


@router.post(
    "/v1/translate",
    response_model=TranslateResponse,
    response_model_exclude_none=True,
    responses=ERROR_RESPONSES,
    summary="Translate one text or a list of texts",
)
async def translate(body: TranslateRequest, request: Request, service: Service) -> Any:
    return await _decode(body, request, service)


@router.post(
    "/v1/generate",
    response_model=TranslateResponse,
    response_model_exclude_none=True,
    responses={
        **ERROR_RESPONSES,
        200: {"content": _SSE_DOC, "description": "JSON, or SSE with stream"},
    },
    summary="Decode with full control (sampling, penalties); stream tokens with stream=true",
)
async def generate(body: GenerateRequest, request: Request, service: Service) -> Any:
    return await _decode(body, request, service)


async def _decode(body: TranslateRequest, request: Request, service: Service) -> Any:
    model = resolve_model(service, body.model)
    check_kind(body, model)
    if model.generates:
        assert isinstance(body, GenerateRequest)
        return await _generate(body, request, service, model)
    run = await start_translation(body, service, model)
    stream = isinstance(body, GenerateRequest) and body.stream
    if stream:
        # cancel() frees the rows of a stream that did not end (client gone) and drops a token
        # queue nobody read; for a request that ended it changes nothing.
        return EventStream(_document_events(run), cleanup=run.cancel)
    outcome = await wait_all(model, run.requests, run.futures, run.timeout, request.receive)
    raise_for(outcome, run.requests, run.timeout, run.request_id)
    if outcome is Outcome.CANCELLED:
        return Response(status_code=499)  # nobody reads it; logged and counted as 499
    generate = isinstance(body, GenerateRequest)
    results = [f.result() for f in run.futures]
    return TranslateResponse(
        model=model.name,
        translations=await answers(
            model, run.plan, results, return_scores=body.return_scores, token_ids=generate
        ),
        usage=Usage(
            input_tokens=sum(len(r.source) for r in results),
            output_tokens=sum(r.output_tokens for r in results),
        ),
    )


async def _generate(
    body: GenerateRequest, request: Request, service: Service, model: ServedModel
) -> Any:
    """/v1/generate on a language model: prompts or a chat, completions or a stream."""
    run = await start_lm(body, service, model)
    engine_requests, futures, stopper, timeout = run.requests, run.futures, run.stopper, run.timeout
    request_id = request_id_var.get() or "request"
    if body.stream:
        (engine_request,), (future,) = engine_requests, futures
        return EventStream(
            _events(model, engine_request, future, timeout, stopper),
            cleanup=lambda: model.engine.cancel(engine_request.id),
        )
    outcome = await wait_all(model, engine_requests, futures, timeout, request.receive)
    raise_for(outcome, engine_requests, timeout, request_id)
    if outcome is Outcome.CANCELLED:
        return Response(status_code=499)
    results = [f.result() for f in futures]
    return TranslateResponse(
        model=model.name,
        translations=[
            completion(model, r, stopper, return_scores=body.return_scores) for r in results
        ],
        usage=Usage(
            input_tokens=sum(prompt_tokens(r) for r in results),
            output_tokens=sum(r.output_tokens for r in results),
        ),
    )


def raise_for(
    outcome: Outcome, requests: list[EngineRequest], timeout: float, request_id: str
) -> None:
    """The error answer of a request that did not end DONE (CANCELLED: the caller's 499)."""
    if outcome is Outcome.CANCELLED:
        log.info("client disconnected; its requests were cancelled")
    if outcome is Outcome.DEADLINE:
        raise ApiError(504, f"deadline of {timeout * 1000:.0f} ms exceeded", param="timeout_ms")
    if outcome is Outcome.FAILED:
        refused = grammar_refused(requests)
        if refused is not None:
            others = [r for r in requests if not isinstance(r.error, GrammarError)]
            if any(r.outcome is Outcome.FAILED for r in others):
                _log_failure(others)  # another prompt's failure is still the server's to see
            raise refused
        _log_failure(requests)
        raise ApiError(500, f"decoding failed; quote request id {request_id} when reporting it")


def grammar_refused(requests: Sequence[EngineRequest]) -> ApiError | None:
    """The 422 of a request whose grammar passed llguidance's limits while it was followed
    (the client's grammar, not a failure of the server), naming the field that held it."""
    for request in requests:
        error = request.error
        if request.outcome is Outcome.FAILED and isinstance(error, GrammarError):
            where = f"{error.param}: " if error.param else ""
            return ApiError(422, f"{where}{error}", param=error.param)
    return None


def _log_failure(requests: list[EngineRequest]) -> None:
    failed = [r for r in requests if r.outcome is Outcome.FAILED]
    error = failed[0].error if failed else None
    exc_info = (type(error), error, error.__traceback__) if error is not None else None
    log.error("decoding failed for %s", ", ".join(r.id for r in failed), exc_info=exc_info)


class EventStream(StreamingResponse):
    """Server-Sent Events; `cleanup` runs however the response ends (done, error, disconnect)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


def _delta(full: str, emitted: str) -> tuple[str, str]:
    """The new text since `emitted` (nothing while a multi-byte character is incomplete)."""
    if full.endswith("\ufffd") or not full.startswith(emitted):
        return "", emitted
    return full[len(emitted) :], full


@dataclass(frozen=True)
class Delta:
    """A streamed token and the text it adds (empty while held back)."""

    index: int
    token: int | None  # None: source text kept between a document's sentences
    text: str
    reasoning: str = ""  # a thinking model's reasoning text (service/reasoning.py)


@dataclass(frozen=True)
class StreamEnd:
    """The end of a stream: the finished request (None: cancelled, the client is gone), or
    an error (status, error body)."""

    request: EngineRequest | None
    error: tuple[int, dict[str, Any]] | None = None
    done: bool = False  # ended without a request of its own (a text returned unchanged)


async def token_deltas(
    model: ServedModel,
    request: EngineRequest,
    future: asyncio.Future[EngineRequest],
    timeout: float,
    stopper: StopStrings | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
) -> AsyncIterator[Delta | StreamEnd]:
    """One Delta per token, then a StreamEnd. With stop strings, text that may turn out to
    start one is held back until it does not. `decode`: token ids -> text (default: the
    tokenizer's, special tokens left out)."""
    decode = decode or model.tokenizer.decode
    loop = asyncio.get_running_loop()
    # The scheduler ends the request at its deadline; this later one only guards against an
    # engine that stopped stepping.
    end = loop.time() + timeout + STREAM_DEADLINE_GRACE
    deadline = f"deadline of {timeout * 1000:.0f} ms exceeded"
    tokens: list[int] = []
    emitted = ""
    chunks = model.engine.tokens(request)
    while True:
        try:
            chunk = await asyncio.wait_for(anext(chunks), max(end - loop.time(), 0.0))
        except StopAsyncIteration:
            break
        except TimeoutError:
            model.engine.cancel(request.id)
            yield StreamEnd(None, (504, error_body(504, deadline, param="timeout_ms")))
            return
        for token in chunk:
            tokens.append(token)
            delta, emitted = _delta(visible(decode(tokens), stopper), emitted)
            yield Delta(len(tokens) - 1, token, delta)
    done = await future
    if done.outcome is Outcome.DONE and done.hypotheses:
        yield StreamEnd(done)
    elif done.outcome is Outcome.CANCELLED:
        yield StreamEnd(None)
    elif done.outcome is Outcome.DEADLINE:
        yield StreamEnd(None, (504, error_body(504, deadline, param="timeout_ms")))
    elif (refused := grammar_refused([done])) is not None:
        yield StreamEnd(None, (422, error_body(422, refused.message, param=refused.param)))
    else:
        _log_failure([done])
        message = f"decoding failed; quote request id {request_id_var.get()} when reporting it"
        yield StreamEnd(None, (500, error_body(500, message)))


async def _native_events(
    deltas: AsyncIterator[Delta | StreamEnd],
    final: Callable[[StreamEnd], Awaitable[FinalEvent]],
) -> AsyncIterator[bytes]:
    """The native stream: one event per delta, `final`'s event (or an error event), [DONE]."""
    async for item in deltas:
        if isinstance(item, Delta):
            event = TokenEvent(index=item.index, token_id=item.token, text=item.text)
            yield sse(event.model_dump())
            continue
        if item.error is not None:
            yield sse(item.error[1])
        elif item.request is None and not item.done:
            return  # the client is gone
        else:
            yield sse((await final(item)).model_dump())
        break
    yield sse("[DONE]")


def _events(
    model: ServedModel,
    request: EngineRequest,
    future: asyncio.Future[EngineRequest],
    timeout: float,
    stopper: StopStrings | None = None,
) -> AsyncIterator[bytes]:
    """A language model's (or one sentence's) stream: a token an event."""

    async def final(end: StreamEnd) -> FinalEvent:
        done = end.request
        assert done is not None
        return FinalEvent(
            finish_reason=finish_reason(done),
            text=text_of(model, done.hypotheses[0], stopper),
            output_tokens=done.output_tokens,
            usage=Usage(input_tokens=prompt_tokens(done), output_tokens=done.output_tokens),
        )

    return _native_events(token_deltas(model, request, future, timeout, stopper), final)


async def document_deltas(run: TranslationRun) -> AsyncIterator[Delta | StreamEnd]:
    """A one-text translation stream: its sentences' tokens in order, the source's text
    between sentences as token-less deltas; a StreamEnd with the last request (or an error)."""
    (text,) = run.plan.texts
    if text.unchanged:
        yield Delta(0, None, text.text)
        yield StreamEnd(None, None, done=True)
        return
    (part,) = text.parts
    gaps = part.document.gaps()
    index = 0
    pending = gaps[0]
    last: EngineRequest | None = None
    for j, (request, future) in enumerate(zip(run.requests, run.futures, strict=True)):
        async for item in token_deltas(run.model, request, future, run.timeout):
            if isinstance(item, StreamEnd):
                if item.error is not None or item.request is None:
                    yield item
                    return
                last = item.request
                break
            if pending and item.text:
                yield Delta(index, None, pending)
                index, pending = index + 1, ""
            yield Delta(index, item.token, item.text)
            index += 1
        pending += gaps[j + 1]
    if pending:
        yield Delta(index, None, pending)
    yield StreamEnd(last)


def _document_events(run: TranslationRun) -> AsyncIterator[bytes]:
    """A translation's stream: a token an event (and an event for the source's text between
    sentences), a final event with the whole text."""

    async def final(end: StreamEnd) -> FinalEvent:
        results = [f.result() for f in run.futures]
        (answer,) = await answers(run.model, run.plan, results)
        return FinalEvent(
            finish_reason=answer.finish_reason,
            text=answer.text,
            output_tokens=answer.output_tokens,
            usage=Usage(
                input_tokens=sum(len(r.source) for r in results),
                output_tokens=answer.output_tokens,
            ),
        )

    return _native_events(document_deltas(run), final)


def _model_entry(m: ServedModel, default: bool) -> OpenAIModel:
    return OpenAIModel(
        id=m.name,
        created=m.created,
        owned_by=OWNED_BY,
        kind="generation" if m.generates else "translation",
        default=default,
        backend=m.backend_name,
        variant=m.variant,
        provider=m.provider,
        source_lang=None if m.generates else m.tokenizer.source_lang,
        target_lang=None if m.generates else m.tokenizer.target_lang,
        target_languages=[] if m.generates else m.tokenizer.target_languages,
        max_input_tokens=m.max_input_tokens,
        max_new_tokens=m.max_new_tokens,
        context_length=m.backend.spec.max_positions,
        beam_size=m.defaults.beam_size,
    )


@router.get(
    "/v1/models",
    response_model=OpenAIModelList,
    responses={401: ERROR_RESPONSES[401]},
    summary="The served models, in OpenAI's shape with attnserve's fields beside",
)
async def models(service: Service) -> OpenAIModelList:
    default = service.registry.default
    return OpenAIModelList(data=[_model_entry(m, m is default) for m in service.registry])


@router.get(
    "/v1/models/{model_id}",
    response_model=OpenAIModel,
    responses={401: ERROR_RESPONSES[401], 404: ERROR_RESPONSES[404]},
    summary="One served model (OpenAI's retrieve)",
)
async def model(model_id: str, service: Service) -> OpenAIModel:
    found = service.registry.get(model_id)
    if found is None:
        known = ", ".join(m.name for m in service.registry)
        raise ApiError(
            404, f"unknown model {shown(model_id)}; served: {known}", param="model",
            type="model_not_found",
        )  # fmt: skip
    return _model_entry(found, found is service.registry.default)


@router.get("/healthz", response_model=Status, summary="Liveness: 200 while the process runs")
async def healthz(service: Service) -> Status:
    return Status(status="ok")


@router.get(
    "/readyz",
    response_model=Status,
    responses={503: {"model": Status, "description": "Loading, draining or failed"}},
    summary="Readiness: 200 once every model is warmed up, 503 before and while draining",
)
async def readyz(service: Service) -> JSONResponse:
    lifecycle = service.lifecycle
    status = Status(status=lifecycle.phase, detail=lifecycle.detail)
    return JSONResponse(status.model_dump(), status_code=200 if lifecycle.ready else 503)


# HEAD too (uptime checkers and some load balancers probe with it): the status, no body.
@router.head("/healthz", include_in_schema=False)
async def healthz_head(service: Service) -> Response:
    return Response(status_code=200)


@router.head("/readyz", include_in_schema=False)
async def readyz_head(service: Service) -> Response:
    return Response(status_code=200 if service.lifecycle.ready else 503)


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    summary="Prometheus metrics (text exposition format)",
)
async def metrics(service: Service) -> Response:
    body, content_type = service.metrics.render()
    return Response(body, media_type=content_type)
