"""A language-model request's text to prompt ids: chat roles and names checked, a byte limit
before anything is tokenized, and the rendering and tokenizing themselves on a worker thread
for long inputs, stopped early once a prompt is past the model's token limit.

What a client sends is data (model/control_tokens.py): chat text (messages, tools, template
variables) never becomes a control token, and neither does a raw prompt's unless the operator
allows it (`Settings.prompt_special_tokens`: for trusted back ends that send prompts they
rendered themselves). A role is one of the chat roles (`Settings.extra_chat_roles` adds
others); a role or name that holds a special token's text is refused outright.

The byte limit: a prompt's text over `max_input_tokens` times the larger of the vocabulary's
longest token (`TextTokenizer.max_token_bytes`: with a byte-level vocabulary no raw prompt
within the token limit is longer) and `Settings.prompt_bytes_per_token` (a floor for
vocabularies whose tokens may stand for more text than themselves) is refused before it is
rendered or tokenized. Under it, a long text is first counted on a prefix
(`TextTokenizer.check_length`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool

from attnserve.model.control_tokens import TokenLimitExceeded, strings
from attnserve.service.decoding import INLINE_CHARS
from attnserve.service.errors import ApiError
from attnserve.service.models import ServedModel
from attnserve.service.settings import Settings

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")

T = TypeVar("T")


def check_messages(messages: Sequence[Any], model: ServedModel, settings: Settings) -> None:
    """422 (an OpenAI route's 400) for a role that is not a chat role, and for a role or name
    holding one of the model's special tokens."""
    allowed = (*CHAT_ROLES, *settings.extra_chat_roles)
    control = model.tokenizer.control
    for i, message in enumerate(messages):
        for field in ("role", "name"):
            value = getattr(message, field, None)
            token = control.find(value) if isinstance(value, str) else None
            if token is not None:
                raise ApiError(
                    422,
                    f"messages[{i}].{field} holds the model's special token {token!r}",
                    param="messages",
                )
        if message.role not in allowed:
            raise ApiError(
                422,
                f"messages[{i}].role {message.role!r} is not one of {', '.join(allowed)}",
                param="messages",
            )


def utf8_bytes(data: Any) -> int:
    """UTF-8 bytes of every string in JSON-like data (keys included)."""
    return sum(
        len(s) if s.isascii() else len(s.encode("utf-8", "surrogatepass")) for s in strings(data)
    )


def byte_limit(model: ServedModel, settings: Settings) -> int:
    """The most bytes of text a prompt of `max_input_tokens` tokens can hold."""
    per_token = max(settings.prompt_bytes_per_token, model.tokenizer.max_token_bytes)
    return int(model.max_input_tokens * per_token)


def check_bytes(size: int, model: ServedModel, settings: Settings, where: str) -> None:
    limit = byte_limit(model, settings)
    if size > limit:
        raise ApiError(
            422,
            f"{where} is {size} bytes long: more than {model.max_input_tokens} tokens, the "
            f"model's input limit, can hold ({limit} bytes); nothing of it was tokenized",
            param=where.split("[")[0],
        )


def too_long(where: str, exc: TokenLimitExceeded) -> ApiError:
    return ApiError(
        422,
        f"{where} has more than {exc.limit} tokens (at least {exc.at_least}); "
        f"the limit is {exc.limit}",
        param=where.split("[")[0],
    )


async def off_loop(chars: int, function: Callable[[], T]) -> T:
    """`function()` on a worker thread when the text is long enough to hold up the loop."""
    if chars > INLINE_CHARS:
        return await run_in_threadpool(function)
    return function()


async def chat_ids(
    model: ServedModel,
    settings: Settings,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    limit: bool = True,
    **options: Any,
) -> list[int]:
    """Ids of a chat rendered by the model's template (TextTokenizer.encode_chat's
    `options`); `limit`: the byte limit and the early stop at the model's input limit apply.
    422 for what the template refuses or the tokenizer cannot take."""
    try:
        size = utf8_bytes([messages, tools, template_kwargs])
    except RecursionError as exc:  # arguments nested deeper than the walk goes
        raise ApiError(422, "messages: nested too deeply", param="messages") from exc
    if limit:
        check_bytes(size, model, settings, "messages")

    def encode() -> list[int]:
        return list(
            model.tokenizer.encode_chat(
                messages,
                tools=tools,
                template_kwargs=template_kwargs,
                limit=model.max_input_tokens if limit else None,
                **options,
            )
        )

    try:
        return await off_loop(size, encode)
    except TokenLimitExceeded as exc:
        raise too_long("messages", exc) from exc
    except ValueError as exc:  # the template refused them (raise_exception, bad roles)
        raise ApiError(422, f"messages: {exc}", param="messages") from exc
    except RecursionError as exc:  # arguments nested too deeply for the template's tojson
        raise ApiError(422, "messages: nested too deeply", param="messages") from exc
    except TypeError as exc:  # text the tokenizer cannot take (a lone surrogate)
        raise ApiError(422, "messages: text is not valid Unicode", param="messages") from exc


async def text_ids(
    model: ServedModel,
    settings: Settings,
    texts: Sequence[str],
    names: Sequence[str],
    *,
    add_special_tokens: bool = True,
    limit: bool = True,
) -> list[list[int]]:
    """Ids of raw prompts (`names`: each one's name in errors), their special tokens' text
    read as control tokens only where `Settings.prompt_special_tokens` allows it."""
    if limit:
        for text, name in zip(texts, names, strict=True):
            check_bytes(utf8_bytes(text), model, settings, name)
    special = settings.prompt_special_tokens
    cap = model.max_input_tokens if limit else None
    tokenizer = model.tokenizer

    def encode() -> list[list[int]]:
        out = []
        for text, name in zip(texts, names, strict=True):
            try:
                out.append(tokenizer.encode(text, add_special_tokens, special=special, limit=cap))
            except TokenLimitExceeded as exc:
                raise too_long(name, exc) from exc
            except ValueError as exc:  # the vocabulary spells a control token from text
                raise ApiError(422, f"{name}: {exc}", param=name.split("[")[0]) from exc
        return out

    return await off_loop(sum(len(t) for t in texts), encode)
