"""The OpenAI-compatible API: /v1/chat/completions, /v1/completions (and /v1/models in
routes.py), answered in the shapes the official `openai` client parses.

An OpenAI request is translated into the native GenerateRequest and decoded by the same code
as /v1/generate and /v1/translate (options, validation, admission, deadlines, cancellation,
metrics); only the shapes in and out differ. OpenAI's defaults apply: `temperature` 1
(sampling) unless given, 0 = greedy; a translation model decodes with its own defaults (beam
search) unless a temperature above 0 asks for sampling, and `n` is then its n-best list.
Errors are OpenAI's: `{"error": {"message", "type", "param", "code"}}`, 400 for an invalid
request (the native API's 422), and `x-should-retry: false` on 500 and 504, so that the client
does not run a request that failed or timed out a second time. Tool calling (`tools`,
`tool_choice`, calls and results in the chat) is tool_calls.py's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from attnserve.engine.generator import StopStrings
from attnserve.engine.scheduler import Outcome
from attnserve.engine.scheduler import Request as EngineRequest
from attnserve.engine.search import Hypothesis as EngineHypothesis
from attnserve.service.answers import answers
from attnserve.service.decoding import resolve_model, wait_all
from attnserve.service.documents import TranslationRun, start_translation
from attnserve.service.errors import CHAT_PATH, COMPLETIONS_PATH, ApiError, shown
from attnserve.service.generation import (
    EngineRun,
    check_kind,
    prompt_tokens,
    start_lm,
    text_of,
)
from attnserve.service.logs import request_id_var
from attnserve.service.models import ServedModel
from attnserve.service.openai_logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from attnserve.service.openai_schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionMessage,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    CompletionUsage,
    PromptTokensDetails,
    chunk_json,
)
from attnserve.service.prompts import check_messages
from attnserve.service.reasoning import (
    PROMPT_TAIL_TOKENS,
    Part,
    ThinkSplitter,
    opened_by_prompt,
    split,
)
from attnserve.service.routes import (
    ERROR_RESPONSES,
    Delta,
    EventStream,
    StreamEnd,
    document_deltas,
    raise_for,
    sse,
    token_deltas,
)
from attnserve.service.schemas import ChatMessage, GenerateRequest, Guided
from attnserve.service.state import Service
from attnserve.service.tool_calls import (
    ToolStream,
    answer_text,
    chat_prompt,
    constrain,
    decoder,
    plan_tools,
    template_messages,
    tool_answer,
)
from attnserve.service.tool_calls import start as start_tools

router = APIRouter()

# Structured outputs (service/guided.py): passed on to the native request.
GUIDED = tuple(Guided.model_fields)
# Language-model fields of /v1/completions a translation model refuses (400).
LM_ONLY = (
    "stop", "presence_penalty", "frequency_penalty", "min_p", "logprobs", "echo", "prompt_logprobs",
    "cache_salt",
)  # fmt: skip
# Fields that would change the answer and that attnserve does not implement: refused (400),
# never silently ignored. `functions` and `function_call` are OpenAI's deprecated names of
# `tools` and `tool_choice`.
UNSUPPORTED = ("functions", "function_call", "logit_bias", "suffix")
COMPLETION_UNSUPPORTED = ("tools", "tool_choice", "parallel_tool_calls")
_RESPONSES = {k: v for k, v in ERROR_RESPONSES.items() if k != 422}
_RESPONSES[400] = {**ERROR_RESPONSES[422], "description": "Invalid request (`param` names it)"}


def _streamed(kind: str, example: str) -> dict[int | str, dict[str, Any]]:
    """The responses of a route that answers JSON, or Server-Sent Events with stream=true:
    each event's data is one `kind` chunk (JSON), an error object, or the final [DONE]."""
    event = {
        "type": "object",
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {"type": "string", "contentMediaType": "application/json"},
                ],
                "description": f"a {kind} chunk, or {{'error': ...}} mid-stream, then [DONE]",
            }
        },
        "required": ["data"],
    }
    return {
        **_RESPONSES,
        200: {
            "description": f"JSON, or SSE of {kind} chunks with stream=true",
            "content": {"text/event-stream": {"schema": event, "example": example}},
        },
    }


_CHAT_RESPONSES = _streamed(
    "chat.completion.chunk",
    'data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", '
    '"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": null}]}\n\n'
    "data: [DONE]\n\n",
)
_COMPLETION_RESPONSES = _streamed(
    "text_completion",
    'data: {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", '
    '"choices": [{"index": 0, "text": "Hi", "finish_reason": null}]}\n\ndata: [DONE]\n\n',
)


def _check_supported(body: ChatCompletionRequest | CompletionRequest) -> None:
    extra = body.model_extra or {}
    names: tuple[str, ...] = UNSUPPORTED
    if isinstance(body, CompletionRequest):
        names += COMPLETION_UNSUPPORTED
    for name in names:
        value = extra.get(name) if name in extra else getattr(body, name, None)
        if value not in (None, {}, []):
            hint = ": use tools" if name in ("functions", "function_call") else ""
            raise ApiError(400, f"{name} is not supported by this server{hint}", param=name)
    if body.stream_options is not None and not body.stream:  # as OpenAI answers it
        raise ApiError(
            400, "stream_options is only allowed with stream true", param="stream_options"
        )


def _native(body: ChatCompletionRequest | CompletionRequest, model: ServedModel) -> dict[str, Any]:
    """The GenerateRequest fields that `body`'s options stand for (OpenAI's defaults)."""
    given = body.temperature
    if not model.generates and given is None:
        given = 0.0  # a translation model: its own defaults (beam search) unless asked
    temperature = 1.0 if given is None else given
    beam = bool(body.use_beam_search) or (
        not model.generates and temperature == 0 and not bool(body.stream)
    )
    sampling = temperature > 0 and not bool(body.use_beam_search)
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    fields: dict[str, Any] = {
        "model": body.model,
        "stream": bool(body.stream),
        "sampling": sampling,
        "max_new_tokens": max_tokens,
        "seed": body.seed,
        "repetition_penalty": body.repetition_penalty,
        "min_new_tokens": body.min_tokens,
        "length_penalty": body.length_penalty,
        "timeout_ms": body.timeout_ms,
        "cache_salt": body.cache_salt,
        **{name: getattr(body, name) for name in GUIDED},
    }
    n = body.n or 1
    if sampling:
        fields.update(temperature=temperature, top_p=body.top_p, min_p=body.min_p)
        fields["top_k"] = None if body.top_k is None else max(body.top_k, 0)
    if model.generates:
        fields.update(
            stop=body.stop,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
        )
    if beam:
        width = body.best_of or (model.defaults.beam_size if not bool(body.use_beam_search) else n)
        fields.update(beam_size=max(width, n), num_hypotheses=n)
    elif sampling and n > 1:
        fields["n"] = n
    elif n > 1:
        raise ApiError(400, "n > 1 needs sampling (a temperature above 0)", param="n")
    if not model.generates and sampling and n > 1:
        raise ApiError(400, "a translation model returns n > 1 from beam search", param="n")
    return {k: v for k, v in fields.items() if v is not None}


def _generate_request(fields: dict[str, Any]) -> GenerateRequest:
    try:
        return GenerateRequest.model_validate(fields)
    except ValueError as exc:  # a combination the native schema refuses
        raise ApiError(400, str(exc).splitlines()[0]) from exc


def _chat_messages(messages: Sequence[ChatCompletionMessage]) -> list[ChatMessage]:
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.type != "text":
                    raise ApiError(
                        400,
                        f"messages[{i}]: only text content parts are supported, "
                        f"not {shown(part.type)}",
                        param="messages",
                    )
                if part.text is None:
                    why = f"messages[{i}]: a text content part needs its text"
                    raise ApiError(400, why, param="messages")
                parts.append(part.text)
            content = "".join(parts)
        if content is None and message.role != "assistant":
            raise ApiError(400, f"messages[{i}]: a message needs its content", param="messages")
        role = "system" if message.role == "developer" else message.role
        try:
            (content or "").encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800" in the JSON)
            raise ApiError(400, f"messages[{i}] is not valid Unicode", param="messages") from exc
        out.append(ChatMessage(role=role, content=content or ""))
    return out


async def _finish(
    run: EngineRun | TranslationRun, request: Request
) -> list[EngineRequest] | Response:
    """The finished requests, or the error (raised) / 499 of a run that did not end DONE."""
    outcome = await wait_all(run.model, run.requests, run.futures, run.timeout, request.receive)
    raise_for(outcome, run.requests, run.timeout, request_id_var.get() or "request")
    if outcome is Outcome.CANCELLED:
        return Response(status_code=499)
    return [f.result() for f in run.futures]


def _completion_tokens(request: EngineRequest) -> int:
    """Tokens generated for a request: every sample's with n > 1 (each is its own output),
    else the answer's (a beam's n-best list shares its steps)."""
    if request.options.num_samples > 1:
        return sum(len(h.tokens) + int(h.ended_with_eos) for h in request.hypotheses)
    return request.output_tokens


def _usage(requests: Sequence[EngineRequest]) -> CompletionUsage:
    prompt = sum(prompt_tokens(r) for r in requests)
    completion = sum(_completion_tokens(r) for r in requests)
    # a language model's (a translation's requests have no prompt prefix to reuse)
    details = None
    if requests and requests[0].prefix:
        details = PromptTokensDetails(cached_tokens=sum(r.cached_tokens for r in requests))
    return CompletionUsage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=details,
    )


def _thinking(model: ServedModel, run: EngineRun) -> bool | None:
    """None for a model whose answers are not split into reasoning and content; else whether
    the prompt leaves a <think> block open (the answer starts inside it)."""
    if not model.thinks:
        return None
    tail = run.requests[0].prefix[-PROMPT_TAIL_TOKENS:]
    return opened_by_prompt(str(model.tokenizer.decode(tail, skip_special_tokens=False)))


def _finish_reason(hyp: EngineHypothesis, request: EngineRequest) -> Literal["stop", "length"]:
    if request.options.num_samples > 1 or request.prefix:
        return "stop" if hyp.finish_reason == "stop" else "length"
    # translation: a forced end at the limit is a length
    at_limit = len(hyp.tokens) + int(hyp.ended_with_eos) >= request.options.max_new_tokens
    forced = hyp.ended_with_eos and request.options.forced_eos and at_limit
    return "stop" if (hyp.ended_with_eos and not forced) or hyp.stopped else "length"


def _text(model: ServedModel, hyp: EngineHypothesis, stopper: StopStrings | None) -> str:
    if model.generates:
        return text_of(model, hyp, stopper)
    return str(model.tokenizer.decode(hyp.tokens))


@router.post(
    CHAT_PATH,
    response_model=ChatCompletion,
    response_model_exclude_none=False,
    responses=_CHAT_RESPONSES,
    summary="OpenAI chat completion (language models); stream=true for chunks",
)
async def chat_completions(body: ChatCompletionRequest, request: Request, service: Service) -> Any:
    _check_supported(body)
    model = resolve_model(service, body.model)
    if not model.generates:
        raise ApiError(
            400,
            f"model {model.name} translates: use /v1/completions (prompt = the source text)",
            param="model",
        )
    if body.logprobs and body.stream:
        raise ApiError(400, "logprobs are not streamed: use stream=false", param="logprobs")
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    fields = _native(body, model)
    if body.logprobs:
        fields["logprobs"] = body.top_logprobs or 0
    if body.prompt_logprobs is not None:
        fields["prompt_logprobs"] = body.prompt_logprobs
    check_messages(body.messages, model, service.settings)
    messages = _chat_messages(body.messages)
    plan = plan_tools(body, model, service.settings.tool_call_parser)
    if plan is None:
        fields["messages"] = messages
        fields["chat_template_kwargs"] = body.chat_template_kwargs
        run = await start_lm(_generate_request(fields), service, model)
    else:
        chat = template_messages(body.messages, messages, plan, model)
        prompt = await chat_prompt(plan, chat, model, service, body.chat_template_kwargs)
        constrain(plan, body, model, fields)
        run = await start_tools(_generate_request(fields), service, model, plan, prompt)
    id_, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    parses = plan is not None and plan.parses
    decode = decoder(model, plan.syntax) if plan is not None and parses else None
    inside = _thinking(model, run)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        tools = ToolStream(plan) if plan is not None and parses else None
        think = None if inside is None else ThinkSplitter(inside=inside)
        return _stream(
            run,
            "chat.completion.chunk",
            id_,
            created,
            include_usage,
            tools=tools,
            decode=decode,
            think=think,
            reasoning=body.include_reasoning,
        )
    done = await _finish(run, request)
    if isinstance(done, Response):
        return done
    (engine_request,) = done

    def choice(i: int, hyp: EngineHypothesis) -> ChatChoice:
        finish = _finish_reason(hyp, engine_request)
        if plan is not None and decode is not None:
            text: str | None = answer_text(decode, hyp, run.stopper)
        else:
            text = text_of(model, hyp, run.stopper)
        reasoning = None
        if inside is not None:
            reasoning, text = split(text or "", inside=inside)
        message = AssistantMessage(content=text)
        if plan is not None and decode is not None:
            content, calls = tool_answer(plan, text or "")
            message = AssistantMessage(content=content, tool_calls=calls or None)
        if reasoning is not None and body.include_reasoning:
            message.reasoning_content = reasoning
        return ChatChoice(
            index=i,
            message=message,
            finish_reason="tool_calls" if message.tool_calls and finish == "stop" else finish,
            logprobs=chat_logprobs(model, hyp),
        )

    def build() -> list[ChatChoice]:
        return [choice(i, hyp) for i, hyp in enumerate(engine_request.hypotheses)]

    # logprobs decode every token and its alternatives: off the event loop
    scored = body.prompt_logprobs is not None
    choices = await run_in_threadpool(build) if body.logprobs or scored else build()
    prompt_scores = None
    if scored:
        prompt_scores = await run_in_threadpool(
            prompt_logprobs, model, engine_request.prompt_logprobs, body.prompt_logprobs or 0
        )
    return ChatCompletion(
        id=id_,
        created=created,
        model=model.name,
        choices=choices,
        usage=_usage(done),
        prompt_logprobs=prompt_scores,
    )


@router.post(
    COMPLETIONS_PATH,
    response_model=Completion,
    responses=_COMPLETION_RESPONSES,
    summary="OpenAI text completion; a translation model translates the prompt",
)
async def completions(body: CompletionRequest, request: Request, service: Service) -> Any:
    _check_supported(body)
    model = resolve_model(service, body.model)
    token_ids = _token_prompts(body.prompt)
    echo_only = body.max_tokens == 0  # vLLM's: the prompt and its logprobs, nothing generated
    if echo_only and not body.echo:
        raise ApiError(400, "max_tokens 0 needs echo (the prompt alone)", param="max_tokens")
    fields = _native(body, model)
    if token_ids is None:
        fields["text"] = body.prompt
    if model.generates:
        for name in ("source_lang", "target_lang"):
            if getattr(body, name) is not None:
                raise ApiError(400, f"{name} is for translation models", param=name)
        if body.logprobs is not None:
            fields["logprobs"] = body.logprobs
        if body.stream and body.logprobs is not None:
            raise ApiError(400, "logprobs are not streamed: use stream=false", param="logprobs")
        if body.stream and body.prompt_logprobs is not None:
            raise ApiError(400, "prompt_logprobs are not streamed", param="prompt_logprobs")
        fields["prompt_logprobs"] = _prompt_scores(body)
        if echo_only:
            fields["max_new_tokens"] = 1  # decoded (as vLLM does), not answered
    else:
        if token_ids is not None:
            raise ApiError(400, "token ids are for language models: send text", param="prompt")
        if echo_only:
            raise ApiError(400, "max_tokens 0 is for language models", param="max_tokens")
        fields.update(source_lang=body.source_lang, target_lang=body.target_lang)
        for name in LM_ONLY:
            value = getattr(body, name)
            if value is not None and value is not False:  # logprobs=0 asks for logprobs
                raise ApiError(400, f"{name} is for language models", param=name)
    fields = {k: v for k, v in fields.items() if v is not None}
    native = _generate_request(fields)
    id_, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if not model.generates:
        return await _translate(native, body, request, service, model, id_, created)
    run = await start_lm(native, service, model, token_ids=token_ids)
    texts = _prompt_texts(body.prompt, run, model) if body.echo else [""] * len(run.requests)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        echo = texts[0] if body.echo else ""
        return _stream(
            run, "text_completion", id_, created, include_usage, echo, generated=not echo_only
        )
    done = await _finish(run, request)
    if isinstance(done, Response):
        return done

    def build() -> list[CompletionChoice]:
        choices: list[CompletionChoice] = []
        for engine_request, prompt in zip(done, texts, strict=True):
            prefix = prompt if body.echo else ""
            scores = engine_request.prompt_logprobs
            echoed = None
            if body.echo and scores is not None:
                echoed = (engine_request.prefix, scores)
            vllm_scores = None
            if body.prompt_logprobs is not None:
                vllm_scores = prompt_logprobs(model, scores, body.prompt_logprobs)
            for hyp in engine_request.hypotheses:
                logprobs = None
                if body.logprobs is not None:
                    logprobs = completion_logprobs(
                        model, None if echo_only else hyp, body.logprobs, len(prefix), echoed
                    )
                choices.append(
                    CompletionChoice(
                        index=len(choices),
                        text=prefix + ("" if echo_only else _text(model, hyp, run.stopper)),
                        finish_reason="length"
                        if echo_only
                        else _finish_reason(hyp, engine_request),
                        logprobs=logprobs,
                        prompt_logprobs=vllm_scores,
                    )
                )
        return choices

    scored = body.logprobs is not None or body.prompt_logprobs is not None
    choices = await run_in_threadpool(build) if scored else build()
    usage = _usage(done)
    if echo_only:  # the token decoded to finish the request is not answered
        usage = CompletionUsage(
            prompt_tokens=usage.prompt_tokens, completion_tokens=0, total_tokens=usage.prompt_tokens
        )
    return Completion(id=id_, created=created, model=model.name, choices=choices, usage=usage)


def _token_prompts(prompt: str | list[Any]) -> list[list[int]] | None:
    """OpenAI's token-array prompts (a list of ids, or a list of such lists) as lists of ids;
    None for text prompts."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], str):
        return None
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(ids) for ids in prompt]


def _prompt_scores(body: CompletionRequest) -> int | None:
    """How many alternatives the prompt's scores need: vLLM's prompt_logprobs, and with echo
    and logprobs, the legacy logprobs of the prompt tokens (as vLLM, which then scores the
    prompt with `logprobs` alternatives)."""
    wanted = [k for k in (body.prompt_logprobs,) if k is not None]
    if body.echo and body.logprobs is not None:
        wanted.append(body.logprobs)
    return max(wanted) if wanted else None


def _prompt_texts(prompt: str | list[Any], run: EngineRun, model: ServedModel) -> list[str]:
    """Each prompt's text as echo returns it: as sent, or a token-array prompt decoded (its
    special tokens included)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], str):
        return [str(p) for p in prompt]
    return [str(model.tokenizer.decode(r.prefix, skip_special_tokens=False)) for r in run.requests]


async def _translate(
    native: GenerateRequest,
    body: CompletionRequest,
    request: Request,
    service: Service,
    model: ServedModel,
    id_: str,
    created: int,
) -> Any:
    """/v1/completions on a translation model: each prompt a document, `n` its n-best."""
    check_kind(native, model)
    run = await start_translation(native, service, model)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return _stream(run, "text_completion", id_, created, include_usage)
    done = await _finish(run, request)
    if isinstance(done, Response):
        return done
    choices: list[CompletionChoice] = []
    for answer in await answers(model, run.plan, done):
        texts = [h.text for h in answer.hypotheses] if answer.hypotheses else [answer.text]
        for text in texts:
            choices.append(
                CompletionChoice(
                    index=len(choices), text=text, finish_reason=answer.finish_reason, logprobs=None
                )
            )
    return Completion(
        id=id_, created=created, model=model.name, choices=choices, usage=_usage(done)
    )


def _stream(
    run: EngineRun | TranslationRun,
    kind: Literal["chat.completion.chunk", "text_completion"],
    id_: str,
    created: int,
    include_usage: bool,
    echo: str = "",
    tools: ToolStream | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
    *,
    generated: bool = True,
    think: ThinkSplitter | None = None,
    reasoning: bool = True,
) -> EventStream:
    """`generated` False (echo with max_tokens 0): the echo, then the end, no generated text.
    `think`: the text is split into reasoning and content (`reasoning` False: the reasoning is
    left out)."""
    if isinstance(run, TranslationRun):
        return EventStream(
            _chunks(run, document_deltas(run), kind, id_, created, include_usage, echo),
            cleanup=run.cancel,
        )
    (engine_request,), (future,) = run.requests, run.futures
    deltas = token_deltas(run.model, engine_request, future, run.timeout, run.stopper, decode)
    if think is not None:
        deltas = _reasoning_deltas(deltas, think, reasoning)
    return EventStream(
        _chunks(run, deltas, kind, id_, created, include_usage, echo, tools, generated),
        cleanup=lambda: run.model.engine.cancel(engine_request.id),
    )


async def _reasoning_deltas(
    deltas: AsyncIterator[Delta | StreamEnd], think: ThinkSplitter, keep: bool
) -> AsyncIterator[Delta | StreamEnd]:
    """The deltas with their text split: content stays `text`, reasoning moves to
    `reasoning` (dropped unless `keep`); the text held back is released at the end."""
    last = Delta(0, 0, "")
    async for item in deltas:
        if isinstance(item, StreamEnd):
            if item.error is None and (item.request is not None or item.done):
                for part in _parts(last, think.finish(), keep):
                    yield part
            yield item
            continue
        last = item
        for part in _parts(item, think.feed(item.text), keep):
            yield part


def _parts(delta: Delta, parts: list[Part], keep: bool) -> list[Delta]:
    out = []
    for kind, text in parts:
        if kind == "content":
            out.append(Delta(delta.index, delta.token, text))
        elif keep:
            out.append(Delta(delta.index, delta.token, "", reasoning=text))
    return out


async def _ending(
    run: EngineRun | TranslationRun, done: EngineRequest | None, generated: bool = True
) -> tuple[str, CompletionUsage]:
    """A finished stream's finish_reason and usage."""
    if isinstance(run, TranslationRun):
        results = [f.result() for f in run.futures]
        (answer,) = await answers(run.model, run.plan, results)
        return answer.finish_reason, _usage(results)
    assert done is not None
    hyp = done.hypotheses[0] if done.hypotheses else None
    if not generated:
        prompt = prompt_tokens(done)
        return "length", CompletionUsage(
            prompt_tokens=prompt, completion_tokens=0, total_tokens=prompt
        )
    return (_finish_reason(hyp, done) if hyp is not None else "length"), _usage([done])


async def _chunks(
    run: EngineRun | TranslationRun,
    deltas: AsyncIterator[Delta | StreamEnd],
    kind: Literal["chat.completion.chunk", "text_completion"],
    id_: str,
    created: int,
    include_usage: bool,
    echo: str,
    tools: ToolStream | None = None,
    generated: bool = True,
) -> AsyncIterator[bytes]:
    """OpenAI's stream: (chat) a role delta first, a chunk per new text, the finish_reason
    in a last choice chunk, a usage chunk when asked, then [DONE]; an error mid-stream is an
    `error` event (as OpenAI's), then [DONE]. `tools`: the text goes through a tool call
    parser, whose content and tool call deltas are the chunks."""
    name = run.model.name
    chat = kind == "chat.completion.chunk"

    def choice(text: str | None, finish: str | None) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def event(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        return sse(chunk_json(kind, id_, created, name, choices, usage))

    def tool_event(delta: dict[str, Any]) -> bytes:
        return event([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])

    if chat:
        first = choice("", None)
        first["delta"] = {"role": "assistant", "content": ""}
        yield event([first])
    elif echo:
        yield event([choice(echo, None)])
    async for item in deltas:
        if isinstance(item, StreamEnd):
            if item.error is not None:
                yield sse(item.error[1])
                break
            if item.request is None and not item.done:
                return  # the client is gone
            finish, usage = await _ending(run, item.request, generated)
            if tools is not None:
                for delta in tools.finish():
                    yield tool_event(delta)
                finish = "tool_calls" if tools.called and finish == "stop" else finish
            yield event([choice(None if chat else "", finish)])
            if include_usage:
                yield event([], usage.model_dump())
            break
        if item.reasoning:
            yield event(
                [
                    {
                        "index": 0,
                        "delta": {"reasoning_content": item.reasoning},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
        elif item.text and tools is not None:
            for delta in tools.feed(item.text):
                yield tool_event(delta)
        elif item.text and generated:
            yield event([choice(item.text, None)])
    yield sse("[DONE]")
