"""Request and response bodies of the OpenAI-compatible API (/v1/chat/completions,
/v1/completions, /v1/models), in the shapes the official `openai` client parses.

Unlike the native API's, these request bodies ignore fields they do not know: OpenAI clients
and the tools built on them send fields a server may not use (`user`, `store`, `metadata`,
...). Fields that would change the answer and are not supported (`logit_bias`, `suffix`, the
deprecated `functions`, ...) are refused with a 400 naming them (openai_api.py). Tools
(`tools`, `tool_choice`, `parallel_tool_calls`, assistant `tool_calls` and `tool` results in
the chat) are checked further by service/tool_calls.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from attnserve.service.schemas import Guided, PromptCache

# Types are strict, as OpenAI's are (an int for a float is fine; "4", or false for a number,
# is a 400); unknown fields are allowed (and ignored unless refused by name).
_REQUEST_CONFIG = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
MAX_TOP_LOGPROBS = 20
TokenId = Annotated[int, Field(ge=0)]


class ContentPart(BaseModel):
    model_config = _REQUEST_CONFIG

    type: str
    text: str | None = None


# A function's name as OpenAI allows it.
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionCall(BaseModel):
    """A past call in the chat: `arguments` is JSON text (an object)."""

    model_config = _REQUEST_CONFIG

    name: str = Field(min_length=1, max_length=64)
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(BaseModel):
    model_config = _REQUEST_CONFIG

    id: str | None = Field(default=None, max_length=256)
    type: str = "function"
    function: FunctionCall


class ChatCompletionMessage(BaseModel):
    """A message of the chat: text content (a string or text parts); an assistant's tool
    calls; a tool's result (`role: "tool"`, the call's `tool_call_id`)."""

    model_config = _REQUEST_CONFIG

    role: str = Field(min_length=1, max_length=64)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = Field(default=None, max_length=256)


class FunctionDefinition(BaseModel):
    model_config = _REQUEST_CONFIG

    name: str = Field(pattern=FUNCTION_NAME, description="letters, digits, _ and -, up to 64")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="A JSON schema of an object (default: no arguments)."
    )
    strict: bool | None = Field(
        default=None, description="Accepted; required and named calls are always constrained."
    )


class ToolDefinition(BaseModel):
    model_config = _REQUEST_CONFIG

    type: str = Field(description='"function" (the only type)')
    function: FunctionDefinition | None = None


class NamedFunction(BaseModel):
    model_config = _REQUEST_CONFIG

    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(BaseModel):
    model_config = _REQUEST_CONFIG

    type: Literal["function"]
    function: NamedFunction


class StreamOptions(BaseModel):
    model_config = _REQUEST_CONFIG

    include_usage: bool = False


class _Sampling(Guided, PromptCache):
    """Options both endpoints take (OpenAI's, then the extras clients send in `extra_body`)."""

    model_config = _REQUEST_CONFIG

    model: str | None = Field(default=None, description="A model id of GET /v1/models.")
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(
        default=None, ge=0.0, le=2.0, description="0 = greedy; default 1 (sampling)"
    )
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1, le=64)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extras (vLLM's names), sent by the openai client through `extra_body`.
    top_k: int | None = Field(default=None, ge=-1, description="-1 or 0 = off")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    min_tokens: int | None = Field(default=None, ge=0)
    use_beam_search: bool | None = None
    best_of: int | None = Field(default=None, ge=1, description="with use_beam_search: the beam")
    length_penalty: float | None = Field(default=None, ge=-10.0, le=10.0)
    timeout_ms: int | None = Field(default=None, ge=1, description="attnserve's deadline")


def _prompt_logprobs() -> Any:
    return Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="vLLM's: every prompt token's log-prob, rank and this many top "
        "alternatives (language models; not with stream)",
    )


class ChatCompletionRequest(_Sampling):
    model_config = ConfigDict(
        **_REQUEST_CONFIG,
        json_schema_extra={
            "examples": [
                {
                    "model": "smollm2-135m-instruct",
                    "messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "temperature": 0,
                    "max_tokens": 32,
                },
                {
                    "model": "smollm2-135m-instruct",
                    "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                    "tools": [
                        {
                            "type": "function",
                            "function": {
                                "name": "get_weather",
                                "description": "The current weather in a city.",
                                "parameters": {
                                    "type": "object",
                                    "properties": {"city": {"type": "string"}},
                                    "required": ["city"],
                                },
                            },
                        }
                    ],
                    "tool_choice": "required",
                },
            ]
        },
    )

    messages: list[ChatCompletionMessage] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description="Further variables of the chat template (e.g. Qwen3's enable_thinking).",
    )
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    prompt_logprobs: int | None = _prompt_logprobs()
    tools: list[ToolDefinition] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description='default "auto" with tools, "none" without'
    )
    parallel_tool_calls: bool | None = Field(default=None, description="default true")
    include_reasoning: bool = Field(
        default=True,
        description="a thinking model's reasoning in reasoning_content (false: left out)",
    )


class CompletionRequest(_Sampling):
    model_config = ConfigDict(
        **_REQUEST_CONFIG,
        json_schema_extra={
            "examples": [
                {"model": "smollm2-135m-instruct", "prompt": "Once upon a time", "max_tokens": 16},
                {"model": "ende-small", "prompt": "Where is the station?", "target_lang": "de"},
            ]
        },
    )

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        description="A prompt or a list of prompts (translation: the source texts); language "
        "models also take token ids (a list, or a list of lists)"
    )
    # 0 only with echo: the prompt (with its logprobs) and nothing generated, as vLLM's.
    max_tokens: int | None = Field(default=None, ge=0)
    echo: bool | None = Field(
        default=None,
        description="The prompt before the completion; with logprobs, the prompt tokens' "
        "logprobs before the generated ones' (the first one null)",
    )
    logprobs: int | None = Field(default=None, ge=0, le=5)
    prompt_logprobs: int | None = _prompt_logprobs()
    suffix: str | None = None
    # Translation models (through `extra_body`).
    source_lang: str | None = Field(default=None, max_length=32)
    target_lang: str | None = Field(default=None, max_length=32)


class TopLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class LogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprobEntry]


class ChoiceLogprobs(BaseModel):
    content: list[LogprobEntry] | None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str = Field(description="JSON text of the arguments (an object)")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(
        description="null when the answer is only tool calls, or only reasoning"
    )
    reasoning_content: str | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="a thinking model's <think> block (its tags and outer white space left out)",
    )
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChoiceLogprobs | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose K/V came from the prefix cache")


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = Field(
        default=None, exclude_if=lambda v: v is None, description="language models"
    )


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's log-prob of a token at a prompt position."""

    logprob: float
    rank: int | None = Field(description="1 + the tokens more likely there")
    decoded_token: str | None


# vLLM's prompt_logprobs: per prompt token, {token id: its log-prob} for the token and the
# most likely ones there; null for the first token.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage
    system_fingerprint: str | None = None


class OpenAIModel(BaseModel):
    """A model in OpenAI's shape, with attnserve's own fields beside."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    kind: Literal["translation", "generation"] = Field(
        description="translation: encoder-decoder; generation: language model"
    )
    default: bool
    backend: str
    variant: str | None
    provider: str | None
    source_lang: str | None
    target_lang: str | None
    target_languages: list[str]
    max_input_tokens: int
    max_new_tokens: int
    context_length: int
    beam_size: int = Field(description="Default beam size (the model's generation config).")


class OpenAIModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIModel]


def chunk_json(
    kind: Literal["chat.completion.chunk", "text_completion"],
    id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One streamed chunk (a `data:` event)."""
    chunk: dict[str, Any] = {
        "id": id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        chunk["usage"] = usage
    return chunk
