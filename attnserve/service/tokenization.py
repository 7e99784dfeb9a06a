"""vLLM's tokenizer endpoints: POST /tokenize (a prompt, or chat messages through the chat
template) and POST /detokenize, in vLLM's shapes, for both kinds of model.

A language model tokenizes as its prompts are tokenized (`add_special_tokens`: what the
tokenizer adds around a text; a chat: the template writes its own, none are added unless
asked) and its `max_model_len` is its context. A translation model tokenizes the source text
as its encoder sees it (with `target_lang`, the target-language tag where the model reads it
from the source, and the end-of-sentence token; `add_special_tokens: false`: the text's pieces
alone), its `max_model_len` is its input limit, and it takes no messages; /detokenize reads
its source vocabulary. Errors are 400s, as on the OpenAI routes.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from starlette.concurrency import run_in_threadpool

from attnserve.service.decoding import INLINE_CHARS, resolve_model
from attnserve.service.errors import DETOKENIZE_PATH, TOKENIZE_PATH, ApiError
from attnserve.service.models import ServedModel
from attnserve.service.openai_schemas import ChatCompletionMessage, TokenId
from attnserve.service.prompts import chat_ids, check_messages, off_loop, text_ids
from attnserve.service.routes import ERROR_RESPONSES
from attnserve.service.state import Service

router = APIRouter()

# As the OpenAI routes' bodies: fields a client sends and that do not change the answer are
# ignored; types are strict.
_CONFIG = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
_RESPONSES = {k: v for k, v in ERROR_RESPONSES.items() if k != 422}
_RESPONSES[400] = {**ERROR_RESPONSES[422], "description": "Invalid request (`param` names it)"}


def _exclusive(data: Any, own: str, other: str) -> Any:
    if isinstance(data, dict) and own in data and other in data:
        raise ValueError(f"give {own} or {other}, not both")
    return data


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(
        **_CONFIG,
        json_schema_extra={"examples": [{"model": "smollm2-135m-instruct", "prompt": "Hello"}]},
    )

    model: str | None = Field(default=None, description="A model id of GET /v1/models.")
    prompt: str
    add_special_tokens: bool = Field(
        default=True, description="What the tokenizer adds around a text (BOS, EOS, tags)."
    )
    return_token_strs: bool | None = Field(
        default=False, description="Also return each token's string in the vocabulary."
    )
    target_lang: str | None = Field(
        default=None, max_length=32, description="Translation models: the target language."
    )
    source_lang: str | None = Field(
        default=None, max_length=32, description="Translation models: the source language."
    )

    @model_validator(mode="before")
    @classmethod
    def _one_kind(cls, data: Any) -> Any:
        return _exclusive(data, "prompt", "messages")


class TokenizeChatRequest(BaseModel):
    model_config = _CONFIG

    model: str | None = Field(default=None, description="A model id of GET /v1/models.")
    messages: list[ChatCompletionMessage] = Field(min_length=1)
    add_generation_prompt: bool = Field(
        default=True, description="End with the template's start of the assistant's turn."
    )
    continue_final_message: bool = Field(
        default=False,
        description="End the chat open in its last message (not with add_generation_prompt).",
    )
    add_special_tokens: bool = Field(
        default=False, description="Special tokens beyond those the chat template writes."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description="Further variables of the chat template (e.g. Qwen3's enable_thinking).",
    )
    return_token_strs: bool | None = Field(
        default=False, description="Also return each token's string in the vocabulary."
    )

    @model_validator(mode="before")
    @classmethod
    def _one_kind(cls, data: Any) -> Any:
        return _exclusive(data, "messages", "prompt")


def _kind(data: Any) -> str:
    """Which request a body is: chat messages, or a prompt."""
    if isinstance(data, dict):
        return "messages" if "messages" in data else "prompt"
    return "messages" if isinstance(data, TokenizeChatRequest) else "prompt"


# vLLM's TokenizeRequest: a prompt or a chat, told apart by its field (so that a bad body's
# errors are those of the request it meant).
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("prompt")]
    | Annotated[TokenizeChatRequest, Tag("messages")],
    Discriminator(_kind),
]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int = Field(description="The model's context (translation: input limit).")
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = _CONFIG

    model: str | None = Field(default=None, description="A model id of GET /v1/models.")
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post(
    TOKENIZE_PATH,
    response_model=TokenizeResponse,
    response_model_exclude_none=True,
    responses=_RESPONSES,
    summary="Token ids of a prompt or of chat messages (vLLM's /tokenize)",
)
async def tokenize(body: TokenizeRequest, service: Service) -> TokenizeResponse:
    model = resolve_model(service, body.model)
    if isinstance(body, TokenizeChatRequest):
        if not model.generates:
            raise ApiError(
                400, f"model {model.name} translates: send a prompt, not messages", param="messages"
            )
        check_messages(body.messages, model, service.settings)
        messages = [
            {"role": m.role, "content": _content(m, i)} for i, m in enumerate(body.messages)
        ]
        ids = await chat_ids(
            model,
            service.settings,
            messages,
            template_kwargs=body.chat_template_kwargs,
            limit=False,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            add_special_tokens=body.add_special_tokens,
        )
    elif model.generates:
        for name in ("target_lang", "source_lang"):
            if getattr(body, name) is not None:
                raise ApiError(400, f"{name} is for translation models", param=name)
        _check_unicode(body.prompt)
        (ids,) = await text_ids(
            model,
            service.settings,
            [body.prompt],
            ["prompt"],
            add_special_tokens=body.add_special_tokens,
            limit=False,
        )
    else:
        ids = await off_loop(len(body.prompt), lambda: _source(model, body))
    strs = None
    if body.return_token_strs:
        tokenizer = model.tokenizer
        strs = tokenizer.pieces(ids) if model.generates else tokenizer.source_pieces(ids)
    limit = model.backend.spec.max_positions if model.generates else model.max_input_tokens
    return TokenizeResponse(count=len(ids), max_model_len=limit, tokens=ids, token_strs=strs)


@router.post(
    DETOKENIZE_PATH,
    response_model=DetokenizeResponse,
    responses=_RESPONSES,
    summary="The text of token ids (vLLM's /detokenize)",
)
async def detokenize(body: DetokenizeRequest, service: Service) -> DetokenizeResponse:
    model = resolve_model(service, body.model)
    vocab = _vocab_size(model)
    wrong = next((t for t in body.tokens if t >= vocab), None)
    if wrong is not None:
        raise ApiError(
            400, f"token id {wrong} is outside the vocabulary (0 to {vocab - 1})", param="tokens"
        )

    def decode() -> str:
        if model.generates:  # special tokens included, as vLLM's
            return str(model.tokenizer.decode(body.tokens, skip_special_tokens=False))
        return str(model.tokenizer.decode_source(body.tokens))

    prompt = await run_in_threadpool(decode) if len(body.tokens) > INLINE_CHARS else decode()
    return DetokenizeResponse(prompt=prompt)


def _vocab_size(model: ServedModel) -> int:
    """Ids a model reads: a language model's embedding rows, a translation model's source
    vocabulary."""
    return int(model.backend.spec.vocab_size if model.generates else model.tokenizer.vocab_size)


def _check_unicode(prompt: str) -> None:
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800" in the JSON)
        raise ApiError(400, "prompt is not valid Unicode", param="prompt") from exc


def _source(model: ServedModel, body: TokenizeCompletionRequest) -> list[int]:
    """A translation model's source ids, as its encoder sees them."""
    _check_unicode(body.prompt)
    try:
        ids = model.encode(body.prompt, body.target_lang, body.source_lang)
    except ValueError as exc:  # an unknown language
        param = "source_lang" if body.target_lang is None else "target_lang"
        raise ApiError(400, str(exc), param=param) from exc
    if body.add_special_tokens:
        return ids
    added = model.tokenizer.added_ids()
    return [i for i in ids if i not in added]


def _content(message: ChatCompletionMessage, i: int) -> str:
    """A message's text: a string, or its text parts joined."""
    content = message.content
    if isinstance(content, list):
        if any(part.type != "text" or part.text is None for part in content):
            raise ApiError(400, f"messages[{i}]: only text parts are supported", param="messages")
        content = "".join(str(part.text) for part in content)
    try:
        (content or "").encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800" in the JSON)
        raise ApiError(400, f"messages[{i}] is not valid Unicode", param="messages") from exc
    return content or ""
