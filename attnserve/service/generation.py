"""Language-model requests of /v1/generate: prompts or chat messages in, completions out.

The same admission, deadline, cancellation and metrics path as translation (decoding.py); what
differs is the input (a prompt, a list of prompts, or chat messages rendered by the model's
chat template), the options (min_p, presence and frequency penalties, logprobs, n samples,
stop strings) and the output (finish reasons of stop strings, logprobs, samples).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from attnserve.engine.constraints import Constraint
from attnserve.engine.generator import (
    PromptTooLong,
    StopStrings,
    check_stop_strings,
    fit_to_context,
)
from attnserve.engine.options import DecodingOptions, InvalidOption
from attnserve.engine.scheduler import Request, lm_request
from attnserve.engine.search import Hypothesis as EngineHypothesis
from attnserve.service.decoding import (
    GENERATE_OPTIONS,
    _score,
    deadline_seconds,
    next_serial,
    submit_all,
    text_name,
)
from attnserve.service.errors import ApiError
from attnserve.service.guided import constraint_for, requested
from attnserve.service.logs import request_id_var
from attnserve.service.models import ServedModel
from attnserve.service.prompts import chat_ids, check_messages, text_ids
from attnserve.service.schemas import (
    GenerateRequest,
    Hypothesis,
    PromptTokenLogprob,
    TokenLogprob,
    TopLogprob,
    TranslateRequest,
    Translation,
)
from attnserve.service.state import ServiceState

# A log-prob JSON can carry (-inf is not JSON): vLLM's floor for the same answers.
MIN_LOGPROB = -9999.0

# Fields only a language model takes (a translation model answers 422 naming them).
LM_ONLY = (
    "messages", "chat_template_kwargs", "min_p", "presence_penalty", "frequency_penalty",
    "logprobs", "prompt_logprobs", "n", "stop", "cache_salt",
)  # fmt: skip
LM_OPTIONS = ("min_p", "presence_penalty", "frequency_penalty", "logprobs", "prompt_logprobs")


def check_kind(body: TranslateRequest, model: ServedModel) -> None:
    """422 when the endpoint or the fields do not fit the model's kind."""
    if model.generates and not isinstance(body, GenerateRequest):
        raise ApiError(
            422,
            f"model {model.name} is a language model: use /v1/generate or /v1/chat/completions",
            param="model",
        )
    if not model.generates and isinstance(body, GenerateRequest):
        for name in LM_ONLY:
            if getattr(body, name) is not None:
                raise ApiError(
                    422,
                    f"{name} is for language models; model {model.name} translates",
                    param=name,
                )
        if body.text is None:
            raise ApiError(422, "text: give a text or a non-empty list of texts", param="text")
        asked = requested(body)
        if asked is not None:
            raise ApiError(
                422,
                f"{asked[1]}: structured outputs need a language model; {model.name} translates",
                param=asked[1],
            )


def stop_strings(body: GenerateRequest) -> list[str]:
    if body.stop is None:
        return []
    return [body.stop] if isinstance(body.stop, str) else list(body.stop)


def lm_options(body: GenerateRequest, model: ServedModel, service: ServiceState) -> DecodingOptions:
    """The request's options over the model's (greedy unless sampling or a beam is asked for),
    validated: 422 naming the param."""
    given: dict[str, Any] = {
        name: getattr(body, name)
        for name in (*GENERATE_OPTIONS, *LM_OPTIONS)
        if getattr(body, name) is not None
    }
    if body.n is not None:
        given["num_samples"] = body.n
    base = model.defaults.replace(beam_size=1, num_hypotheses=1, sampling=body.sampling)
    options = base.replace(**given)
    if "num_hypotheses" not in given:
        options = options.replace(num_hypotheses=1)
    if body.stream and options.beam_size != 1:
        raise ApiError(422, "stream needs beam_size 1 (greedy or sampling)", param="beam_size")
    if body.stream and options.num_samples != 1:
        raise ApiError(422, "stream needs n = 1", param="n")
    if body.stream and options.logprobs is not None:
        raise ApiError(422, "logprobs are not streamed: use stream false", param="logprobs")
    if options.prompt_logprobs is not None:
        if body.stream:
            raise ApiError(422, "prompt_logprobs are not streamed", param="prompt_logprobs")
        if not getattr(model.backend, "scores_prompts", False):
            raise ApiError(
                422,
                f"model {model.name} cannot score prompts: its graphs were exported before "
                f"prompt scoring (run `attnserve export {model.directory}` again)",
                param="prompt_logprobs",
            )
    try:
        options.validate(
            max_beam_size=service.settings.beam_limit, max_new_tokens_limit=model.max_new_tokens
        )
        check_stop_strings(stop_strings(body), options)
    except InvalidOption as exc:
        raise ApiError(422, f"{exc.param} {exc.message}", param=exc.param) from exc
    return options


def check_lengths(
    where: Sequence[str], prompts: Sequence[Sequence[int]], model: ServedModel
) -> None:
    """422 for a prompt without tokens or over the model's input limit."""
    for name, ids in zip(where, prompts, strict=True):
        if not ids:
            raise ApiError(422, f"{name} has no tokens", param=where[0].split("[")[0])
        if len(ids) > model.max_input_tokens:
            raise ApiError(
                422,
                f"{name} has {len(ids)} tokens; the limit is {model.max_input_tokens}",
                param=name.split("[")[0],
            )


def token_prompts(
    prompts: Sequence[Sequence[int]], model: ServedModel, service: ServiceState, *, stream: bool
) -> list[list[int]]:
    """Prompts given as token ids (OpenAI's token-array prompts), checked: 1 to the request
    limit of them, none empty, every id in the model's vocabulary (422 naming `text`)."""
    limit = min(service.settings.max_texts_per_request, service.settings.max_waiting)
    if not prompts or len(prompts) > limit:
        raise ApiError(422, f"text: give 1 to {limit} prompts", param="text")
    if stream and len(prompts) != 1:
        raise ApiError(422, "stream needs a single text, not a list", param="stream")
    vocab = model.backend.spec.vocab_size
    checked = []
    for i, ids in enumerate(prompts):
        where = "text" if len(prompts) == 1 else f"text[{i}]"
        wrong = next((t for t in ids if not 0 <= t < vocab), None)
        if wrong is not None:
            raise ApiError(
                422,
                f"{where} holds token id {wrong}, outside the vocabulary (0 to {vocab - 1})",
                param="text",
            )
        checked.append([int(t) for t in ids])
    return checked


async def prompts_of(
    body: GenerateRequest,
    model: ServedModel,
    service: ServiceState,
    token_ids: Sequence[Sequence[int]] | None = None,
) -> list[list[int]]:
    """Token ids of the prompt(s), of the rendered chat, or `token_ids` checked; 422 for what
    cannot be decoded."""
    if body.messages is not None and (body.text is not None or token_ids is not None):
        raise ApiError(422, "give text or messages, not both", param="messages")
    if body.messages is None and body.text is None and token_ids is None:
        raise ApiError(422, "give a prompt (text) or chat messages", param="text")
    if token_ids is not None:
        prompts = token_prompts(token_ids, model, service, stream=body.stream)
        where = ["text" if len(prompts) == 1 else f"text[{i}]" for i in range(len(prompts))]
    elif body.messages is not None:
        check_messages(body.messages, model, service.settings)
        messages = [m.model_dump() for m in body.messages]
        chat = await chat_ids(
            model, service.settings, messages, template_kwargs=body.chat_template_kwargs
        )
        prompts, where = [chat], ["messages"]
    else:
        texts = [body.text] if isinstance(body.text, str) else list(body.text or [])
        limit = min(service.settings.max_texts_per_request, service.settings.max_waiting)
        if not texts or len(texts) > limit:
            raise ApiError(422, f"text: give 1 to {limit} prompts", param="text")
        if body.stream and len(texts) != 1:
            raise ApiError(422, "stream needs a single text, not a list", param="stream")
        for i, text in enumerate(texts):
            where_i = text_name(body, i)
            if not text:
                raise ApiError(422, f"{where_i} is empty", param="text")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ApiError(422, f"{where_i} is not valid Unicode", param="text") from exc
        where = [text_name(body, i) for i in range(len(texts))]
        prompts = await text_ids(model, service.settings, texts, where)
    check_lengths(where, prompts, model)
    return prompts


def lm_requests(
    request_id: str,
    prompts: Sequence[Sequence[int]],
    options: DecodingOptions,
    model: ServedModel,
    timeout: float,
    *,
    stream: bool,
    stopper: StopStrings | None,
    constraint: Constraint | None = None,
    cache_salt: str | None = None,
) -> list[Request]:
    deadline = time.monotonic() + timeout
    serial = next_serial()
    requests = []
    for i, prompt in enumerate(prompts):
        try:
            fitted = fit_to_context(prompt, options, model.backend.spec.max_positions)
        except PromptTooLong as exc:
            raise ApiError(422, str(exc), param="text") from exc
        requests.append(
            lm_request(
                f"{request_id}#{serial}/{i}",
                prompt,
                fitted,
                deadline=deadline,
                stream=stream,
                stopper=stopper,
                constraint=constraint,
                cache_salt=cache_salt,
            )
        )
    return requests


@dataclass
class EngineRun:
    """The engine requests of one API request, on their way (language model or translation)."""

    model: ServedModel
    requests: list[Request]
    futures: list[asyncio.Future[Request]]
    stopper: StopStrings | None
    timeout: float


async def start_lm(
    body: GenerateRequest,
    service: ServiceState,
    model: ServedModel,
    prompt: Sequence[int] | None = None,
    token_ids: Sequence[Sequence[int]] | None = None,
    grammar_param: str | None = None,
) -> EngineRun:
    """Validate, tokenize and submit a language-model request (4xx before anything queues);
    `prompt`: a chat the caller rendered itself (the OpenAI route's chats with tools);
    `token_ids`: prompts given as token ids instead of `text`; `grammar_param`: the client's
    field a grammar the server wrote came from (a tool call's), for a limit it passes while
    decoding."""
    options = lm_options(body, model, service)
    timeout = deadline_seconds(body, service)
    if prompt is None:
        prompts = await prompts_of(body, model, service, token_ids)
    else:
        prompts = [list(prompt)]
        check_lengths(["messages"], prompts, model)
    constraint = await constraint_for(body, model, grammar_param)
    stops = stop_strings(body)
    stopper = StopStrings(model.tokenizer, stops) if stops else None
    request_id = request_id_var.get() or "request"
    requests = lm_requests(
        request_id,
        prompts,
        options,
        model,
        timeout,
        stream=body.stream,
        stopper=stopper,
        constraint=constraint,
        cache_salt=body.cache_salt,
    )
    return EngineRun(model, requests, submit_all(service, model, requests), stopper, timeout)


def text_of(model: ServedModel, hyp: EngineHypothesis, stopper: StopStrings | None) -> str:
    text = str(model.tokenizer.decode(hyp.tokens))
    return stopper.truncate(text) if hyp.stopped and stopper is not None else text


def _logprobs(model: ServedModel, hyp: EngineHypothesis) -> list[TokenLogprob] | None:
    if hyp.logprobs is None:
        return None
    piece = model.tokenizer.id_to_token
    return [
        TokenLogprob(
            token_id=e.token,
            text=str(piece(e.token)),
            logprob=e.logprob,
            top_logprobs=[TopLogprob(token_id=t, logprob=lp) for t, lp in e.top],
        )
        for e in hyp.logprobs
    ]


def _prompt_logprobs(
    model: ServedModel, request: Request
) -> list[PromptTokenLogprob | None] | None:
    if request.prompt_logprobs is None:
        return None
    piece = model.tokenizer.id_to_token
    return [
        None
        if e is None
        else PromptTokenLogprob(
            token_id=e.token,
            text=str(piece(e.token)),
            logprob=max(e.logprob, MIN_LOGPROB),
            rank=e.rank or 1,
            top_logprobs=[TopLogprob(token_id=t, logprob=max(lp, MIN_LOGPROB)) for t, lp in e.top],
        )
        for e in request.prompt_logprobs
    ]


def completion(
    model: ServedModel, request: Request, stopper: StopStrings | None, *, return_scores: bool
) -> Translation:
    """The answer for one finished language-model request."""
    hyps = request.hypotheses
    prompt_logprobs = _prompt_logprobs(model, request)
    if not hyps:
        return Translation(
            text="",
            output_tokens=0,
            finish_reason="length",
            token_ids=[],
            prompt_logprobs=prompt_logprobs,
        )
    best = hyps[0]
    alternatives = None
    if len(hyps) > 1:  # the n-best list of a beam, or n samples
        alternatives = [
            Hypothesis(text=text_of(model, h, stopper), score=_score(h.score)) for h in hyps
        ]
    reason: Literal["stop", "length"] = "stop" if best.finish_reason == "stop" else "length"
    return Translation(
        text=text_of(model, best, stopper),
        score=_score(best.score) if return_scores else None,
        hypotheses=alternatives,
        output_tokens=request.output_tokens,
        finish_reason=reason,
        token_ids=list(best.tokens),
        logprobs=_logprobs(model, best),
        prompt_logprobs=prompt_logprobs,
    )


def prompt_tokens(request: Request) -> int:
    """Input tokens of a request: a language model's whole prompt, or the source."""
    return len(request.prefix) if request.prefix else len(request.source)


def visible(text: str, stopper: StopStrings | None) -> str:
    """What a stream may show of `text`: up to a stop string, and without a tail that could
    still become one (it is shown once the next tokens rule that out)."""
    if stopper is None:
        return text
    text = stopper.truncate(text)
    hold = 0
    for stop in stopper.stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                hold = max(hold, k)
                break
    return text[: len(text) - hold]
