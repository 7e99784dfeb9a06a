"""Request and response bodies of the HTTP API (pydantic v2; they are the OpenAPI schema).

Ranges a JSON schema can state are declared here (a request outside them is a 422 before any
work); limits that depend on the server's configuration or the model (beam_size at most
`max_beam_size`, texts per request, input tokens, max_new_tokens) and rules across fields
(num_hypotheses <= beam_size, sampling with beam_size 1) are checked by the routes, with the same
422 error naming the `param`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Request bodies are validated strictly, as their JSON schema says: unknown fields (a typo must
# not silently decode with defaults), "4" for an integer, "yes" for a boolean and NaN / Infinity
# (Python's JSON parser accepts them) are 422s. Integers are accepted for numbers.
_REQUEST_CONFIG = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

Text = str | list[str]


class TranslateRequest(BaseModel):
    """Translate one text or a list of texts (each decoded as its own request, all together)."""

    model_config = ConfigDict(
        **_REQUEST_CONFIG,
        json_schema_extra={
            "examples": [
                {"text": "How are you?", "target_lang": "de"},
                {
                    "text": ["Good morning.", "Where is the station?"],
                    "target_lang": "de",
                    "beam_size": 4,
                    "num_hypotheses": 2,
                    "return_scores": True,
                },
            ]
        },
    )

    text: Text = Field(description="A text, or a list of texts (each is translated separately).")
    model: str | None = Field(
        default=None, description="Model name (GET /v1/models); default: the first."
    )
    source_lang: str | None = Field(
        default=None,
        max_length=32,
        description="Checked against the model's source language, where it declares one; "
        '"auto": detected per text among the languages the model translates from '
        "(the answer's detected_language).",
    )
    target_lang: str | None = Field(
        default=None,
        max_length=32,
        description="Target language (adds its >>xx<< tag); required by a multi-target model "
        "such as ende-small (GET /v1/models: target_languages).",
    )
    beam_size: int | None = Field(default=None, ge=1, description="Default: the model's.")
    num_hypotheses: int | None = Field(
        default=None, ge=1, description="n-best list size <= beam_size."
    )
    max_new_tokens: int | None = Field(default=None, ge=1)
    length_penalty: float | None = Field(default=None, ge=-10.0, le=10.0)
    return_scores: bool = Field(
        default=False, description="Include scores (log-prob / length**penalty)."
    )
    timeout_ms: int | None = Field(
        default=None, ge=1, description="Deadline; default and maximum are server settings."
    )
    format: Literal["text", "html"] = Field(
        default="text",
        description="html: tags and attributes kept, text nodes translated (inline tags "
        "around the words they wrapped). text is never parsed as markup.",
    )
    split_sentences: bool = Field(
        default=True,
        description="Translate each sentence of a text as its own request (line breaks and "
        "spacing kept); false: each text (HTML: each block) as one unit.",
    )


class ChatMessage(BaseModel):
    """One message of a chat (language models with a chat template)."""

    model_config = _REQUEST_CONFIG

    role: str = Field(min_length=1, max_length=64, description="system, user, assistant, ...")
    content: str


_FORMAT_CONFIG = ConfigDict(extra="allow", strict=True, allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the schema the answer follows."""

    model_config = _FORMAT_CONFIG

    name: str = Field(default="response", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(
        default=None, alias="schema", description="A JSON schema (default: any JSON object)."
    )
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON following a schema."""

    model_config = _FORMAT_CONFIG

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one of a JSON schema, a regex, a choice or a grammar."""

    model_config = _FORMAT_CONFIG

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class Guided(BaseModel):
    """Structured outputs (language models): the answer follows a JSON schema, a regex, one
    of a list of strings or a grammar; at most one of these fields per request. Tokens the
    grammar does not allow are never chosen (greedy, sampling and beam search alike)."""

    response_format: ResponseFormat | None = Field(
        default=None, description="OpenAI's: text, json_object or json_schema."
    )
    guided_json: dict[str, Any] | str | None = Field(
        default=None, description="A JSON schema the answer follows (vLLM's name)."
    )
    guided_regex: str | None = Field(default=None, description="A regex the answer matches.")
    guided_choice: list[str] | None = Field(
        default=None, description="The answer is exactly one of these strings."
    )
    guided_grammar: str | None = Field(
        default=None,
        description="A grammar the answer follows: Lark (llguidance's dialect) or GBNF.",
    )
    structured_outputs: StructuredOutputs | None = Field(
        default=None, description="vLLM's newer form of the guided_* fields."
    )


class PromptCache(BaseModel):
    """Language models reuse the K/V of prompt prefixes that earlier requests computed."""

    cache_salt: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="Prompts reuse cached prefixes of requests with the same salt only "
        "(tenants apart; vLLM's name).",
    )


class GenerateRequest(TranslateRequest, Guided, PromptCache):
    """Full decoding control. `stream: true` needs a single text and beam_size 1.

    A language model takes a prompt (`text`) or chat `messages` (rendered by its chat
    template), and the language-model options (min_p, presence and frequency penalties,
    logprobs, n, stop); a translation model takes `text` and refuses those."""

    model_config = ConfigDict(
        **_REQUEST_CONFIG,
        json_schema_extra={
            "examples": [
                {"text": "How are you?", "target_lang": "de", "stream": True},
                {
                    "text": "How are you?",
                    "target_lang": "de",
                    "sampling": True,
                    "temperature": 0.8,
                    "top_p": 0.9,
                    "seed": 7,
                    "max_new_tokens": 64,
                },
            ]
        },
    )

    sampling: bool = Field(default=False, description="Sample instead of greedy / beam search.")
    temperature: float | None = Field(default=None, gt=0.0, le=100.0)
    top_k: int | None = Field(default=None, ge=0, description="0 = off")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="1.0 = off")
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    no_repeat_ngram_size: int | None = Field(default=None, ge=0)
    min_new_tokens: int | None = Field(default=None, ge=0)
    early_stopping: bool | Literal["never"] | None = Field(
        default=None, description="Beam search stop rule (Hugging Face's)."
    )
    stream: bool = Field(
        default=False, description="Answer with Server-Sent Events, one per new token."
    )
    text: Text | None = Field(  # type: ignore[assignment]
        default=None,
        description="A prompt, or a list of prompts (each decoded separately); or give messages.",
    )
    messages: list[ChatMessage] | None = Field(
        default=None,
        min_length=1,
        description="Language models: a chat, rendered by the model's chat template.",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description="Further variables of the chat template (e.g. Qwen3's enable_thinking).",
    )
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, description="0 = off")
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=20,
        description="Log-prob of every generated token and this many top alternatives.",
    )
    prompt_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=20,
        description="Language models: every prompt token's log-prob given the tokens before "
        "it, its rank and this many top alternatives (not with stream).",
    )
    n: int | None = Field(default=None, ge=1, description="Samples per prompt (sampling).")
    stop: str | list[str] | None = Field(
        default=None, description="Stop strings (up to 16); the output ends before the first."
    )


class Hypothesis(BaseModel):
    text: str
    score: float | None = Field(description="null only if the score is not finite")


class TopLogprob(BaseModel):
    token_id: int
    logprob: float


class TokenLogprob(BaseModel):
    """A generated token's log-prob under the model and the most likely tokens there."""

    token_id: int
    text: str
    logprob: float
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class PromptTokenLogprob(TokenLogprob):
    """A prompt token's log-prob given the tokens before it, its rank (1 = the most likely
    token there) and the most likely tokens there."""

    rank: int


class DetectedLanguage(BaseModel):
    language: str = Field(description="ISO 639-1 code (or the model's code) of the source")
    confidence: float = Field(ge=0.0, le=1.0)


class SentenceResult(BaseModel):
    """One sentence of a document and its translation."""

    source: str
    text: str
    score: float | None = None
    hypotheses: list[Hypothesis] | None = None


class Translation(BaseModel):
    text: str
    score: float | None = Field(default=None, description="With return_scores.")
    hypotheses: list[Hypothesis] | None = Field(
        default=None, description="The n-best list when num_hypotheses > 1."
    )
    output_tokens: int = Field(description="Generated tokens, the end-of-sentence token included.")
    finish_reason: Literal["stop", "length"]
    token_ids: list[int] | None = Field(
        default=None, description="/v1/generate only: the generated token ids (no EOS)."
    )
    logprobs: list[TokenLogprob] | None = Field(
        default=None, description="/v1/generate with logprobs: one per generated token."
    )
    prompt_logprobs: list[PromptTokenLogprob | None] | None = Field(
        default=None,
        description="/v1/generate with prompt_logprobs: one per prompt token, null for the "
        "first (nothing precedes it).",
    )
    detected_language: DetectedLanguage | None = Field(
        default=None, description='With source_lang "auto".'
    )
    sentences: list[SentenceResult] | None = Field(
        default=None,
        description="Per sentence, when a text has several and return_scores or an n-best list "
        "was asked for (score and hypotheses of the text are their means and joins).",
    )


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class TranslateResponse(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "model": "ende-small",
                    "translations": [
                        {"text": "Wie geht es dir?", "output_tokens": 6, "finish_reason": "stop"}
                    ],
                    "usage": {"input_tokens": 5, "output_tokens": 6},
                }
            ]
        }
    )

    model: str
    translations: list[Translation]
    usage: Usage


class TokenEvent(BaseModel):
    """One SSE `data:` event per new token; the `text` deltas concatenate to the output."""

    index: int
    token_id: int | None = Field(
        description="null: a translated document's own text between two sentences"
    )
    text: str


class FinalEvent(BaseModel):
    """The last event before `data: [DONE]`."""

    finish_reason: Literal["stop", "length"]
    text: str
    output_tokens: int
    usage: Usage


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = Field(default=None, description="The type, except for invalid requests")
    request_id: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class Status(BaseModel):
    status: Literal["ok", "ready", "loading", "draining", "failed"]
    detail: str | None = None


class ServerModel(BaseModel):
    """A served model as GET /v1/server describes it."""

    name: str
    kind: Literal["translation", "generation"]
    default: bool
    backend: str
    variant: str | None
    provider: str | None
    threads: int | None = Field(description="Intra-op threads; null: one per physical core")
    context_length: int
    max_input_tokens: int
    max_new_tokens: int
    beam_size: int = Field(description="Default beam size (the model's generation config)")
    source_languages: list[str] | None = Field(
        description="Translation models: the languages it translates from (null: it does not "
        "say); language models: null"
    )
    target_languages: list[str]


class ServerLimits(BaseModel):
    """The request limits of the server's settings."""

    max_body_bytes: int
    max_texts_per_request: int
    max_sentences_per_request: int
    max_beam_size: int
    max_waiting: int
    default_timeout_ms: int
    max_timeout_ms: int


class ServerInfo(BaseModel):
    """GET /v1/server: what is served and how (read-only; the page's Server view)."""

    version: str
    phase: Literal["loading", "ready", "draining", "failed"]
    batching: str
    max_batch_rows: int
    models: list[ServerModel]
    languages: dict[str, str] = Field(description="Language code -> English name")
    limits: ServerLimits
