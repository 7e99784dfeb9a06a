"""Service configuration: one `Settings` object, from `ATTNSERVE_*` variables and CLI flags."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from attnserve.defaults import (
    DEFAULT_BACKEND,
    DEFAULT_PROVIDER,
    DEFAULT_SENTENCE_TOKENS,
    DEFAULT_VARIANT,
    default_model_dir,
)
from attnserve.provision import Runtime


def _default_models() -> list[str]:
    return [str(default_model_dir())]


def _split_commas(value: Any) -> Any:
    """ "a,b" -> ["a", "b"] (lists pass through); an empty string is an empty list."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only: 127.0.0.0/8, ::1 or "localhost"
    (a wildcard such as 0.0.0.0 or ::, any other address or name reaches beyond it)."""
    name = host.strip().strip("[]").lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    """Everything the service reads at start-up; CLI flags override the environment."""

    model_config = SettingsConfigDict(env_prefix="ATTNSERVE_", extra="forbid", frozen=True)

    # Model directories, comma-separated in ATTNSERVE_MODELS. A model's name is its directory's
    # name; the first one is the default for requests that name none.
    models: Annotated[list[str], NoDecode] = Field(default_factory=_default_models)
    backend: Literal["onnx", "torch"] = DEFAULT_BACKEND
    variant: Literal["fp32", "int8", "int4", "fp16"] = DEFAULT_VARIANT
    provider: Literal["auto", "cpu", "cuda"] = DEFAULT_PROVIDER
    threads: int | None = Field(default=None, ge=0, description="intra-op threads per model")
    # ONNX Runtime's intra-op threads spin between nodes instead of sleeping: faster with 2+
    # threads on a machine the server has to itself (a language model's step at one row: 1.4x
    # at 2 threads), CPU burnt when idle between steps and stolen from anything sharing it.
    spinning: bool = False
    # glibc's malloc_trim after a step at most this often (seconds; 0 = never): memory steps
    # freed goes back to the OS instead of staying resident in the engine threads' heaps, for
    # a deployment under a memory limit (engine/memory.py: both default models under chat and
    # translation load, 1 s: peak RSS 1075 -> 1001 MB, tokens/s at 16 users 186 -> 166).
    trim_seconds: float = Field(default=0.0, ge=0)
    # `attnserve serve` imports the default language model and exports MODEL/onnx/<variant>
    # when they are missing (needs torch, once).
    auto_export: bool = True

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    # The names (and IP addresses) clients may reach the server by: the Host header, its port
    # aside, against DNS rebinding (service/security.py). "*.example.com" takes its
    # subdomains, "*" any name. Empty: the loopback names (localhost, 127.0.0.1, ::1) when
    # `host` is a loopback address, else any name (the start-up log says which).
    allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Slow and idle clients (service/connections.py): a request's line and headers must be
    # whole within `header_timeout_seconds` of its first byte (of the connection's opening, for
    # its first request), its body within `body_timeout_seconds` of its headers, else 408 and
    # the connection is closed; an idle kept-alive connection is closed after
    # `keep_alive_seconds`; a connection past `max_connections` open ones gets 503 and is
    # closed (keep the process's open-file limit above it).
    header_timeout_seconds: float = Field(default=10.0, gt=0)
    body_timeout_seconds: float = Field(default=30.0, gt=0)
    keep_alive_seconds: int = Field(default=5, ge=1)
    max_connections: int = Field(default=1000, ge=1)

    # Scheduler limits (per model).
    max_batch_rows: int = Field(default=64, ge=1)
    max_batch_tokens: int = Field(default=65536, ge=1)
    max_waiting: int = Field(default=1024, ge=1)
    # While more requests wait than fit, they join the running batch in groups of at least
    # `join_rows` rows (or after `max_join_steps` steps): fewer encoder passes and cache copies
    # at saturation. "request" batching starts a new batch only when the last one has finished
    # (no joining); "static" also answers a batch's requests only when all of them are done
    # (a server around `generate()`). Both are kept to compare (docs/BENCHMARKS.md).
    batching: Literal["continuous", "request", "static"] = "continuous"
    join_rows: int = Field(default=8, ge=0)
    max_join_steps: int = Field(default=16, ge=1)
    # Requests join the running batch only if that pads them by at most `max_join_padding`
    # rows x columns (their rows x its age); else they start another batch ("cohort", stepped
    # beside it) while there are fewer than `max_cohorts`, else wait (engine/scheduler.py).
    max_join_padding: int = Field(default=64, ge=0)
    max_cohorts: int = Field(default=1, ge=1)
    # Language models: their requests join a running batch at any age (a padding column costs
    # a row little next to its weights: docs/BENCHMARKS.md), and prompts longer than
    # `prefill_chunk` tokens are prefilled a chunk per step between decoding steps.
    lm_max_join_padding: int = Field(default=1 << 30, ge=0)
    prefill_chunk: int = Field(default=512, ge=0)
    # Language models: the K/V of recent prompts' blocks kept for reuse, per model, up to this
    # many bytes (0: off; engine/prefix_cache.py), in blocks of `prefix_block` tokens.
    prefix_cache_bytes: int = Field(default=256 << 20, ge=0)
    prefix_block: int = Field(default=16, ge=1, le=1024)

    # Request limits.
    default_timeout_ms: int = Field(default=30_000, ge=1)
    max_timeout_ms: int = Field(default=120_000, ge=1)
    max_body_bytes: int = Field(default=1 << 20, ge=64)
    max_texts_per_request: int = Field(default=64, ge=1)
    # Sentences (units) one translation request may decode: a document's, all its texts'.
    max_sentences_per_request: int = Field(default=512, ge=1)
    # A sentence of more tokens is cut at its clause ends (commas, semicolons, colons, dashes)
    # where it has any: the default model translates long multi-clause sentences worse than
    # their parts (docs/BENCHMARKS.md, "Documents"). 0: sentences are cut only at the model's
    # input limit.
    sentence_tokens: int = Field(default=DEFAULT_SENTENCE_TOKENS, ge=0)
    max_input_tokens: int = Field(default=512, ge=1, description="capped by the model's")
    max_prompt_tokens: int = Field(
        default=4096, ge=1, description="language models; capped by the context"
    )
    max_new_tokens_limit: int = Field(default=512, ge=1, description="capped by the model's")
    # Language models: a prompt (all its text, a chat's included) of more UTF-8 bytes than
    # max input tokens x this (or x the vocabulary's longest token, where that is longer) is
    # refused before it is rendered or tokenized (service/prompts.py).
    prompt_bytes_per_token: int = Field(default=64, ge=1)
    max_beam_size: int = Field(default=8, ge=1)
    retry_after_seconds: int = Field(default=1, ge=0, description="Retry-After of a 429")

    # What a client sends is data (service/prompts.py): a raw prompt's special-token text is
    # tokenized as text unless this is on (trusted back ends that send prompts they rendered
    # themselves); chat text never becomes a control token. Chat roles are system, user,
    # assistant, tool and developer, and these others.
    prompt_special_tokens: bool = False
    extra_chat_roles: Annotated[list[str], NoDecode] = Field(default_factory=list)

    api_key: SecretStr | None = None
    # A server reachable beyond this machine (`host`, or `published_host` when it is set, not
    # a loopback address) refuses to start without `api_key` unless `allow_no_api_key` says
    # an open API is meant (then it says so in a warning). `published_host`: the address
    # clients reach the server on when it is not `host`, e.g. the host address a container's
    # port is published on (docker-compose.yml: 127.0.0.1 unless told otherwise).
    published_host: str | None = None
    allow_no_api_key: bool = False
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    drain_seconds: float = Field(default=30.0, ge=0)
    log_json: bool = True
    # The page for people at / (service/ui.py): static files only; its data comes from the API
    # routes, with the API key the user types in.
    ui: bool = True
    # The OpenAPI page at /docs and its schema at /openapi.json (service/docs_page.py): open
    # without the API key; false removes both (404).
    docs: bool = True
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # The syntax language models write tool calls in (service/tool_parsers.py): "auto" reads
    # it from the chat template's markers; a template without a tools section gets the
    # generic tool prompt and its Hermes syntax whatever this says.
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = "auto"
    # Where language models' reasoning goes (service/reasoning.py): "auto" splits <think>
    # blocks off into reasoning_content for models whose template and vocabulary have them;
    # "qwen3" / "deepseek_r1" (vLLM's names; the same <think> syntax) for every language
    # model; "none" leaves the blocks in the content.
    reasoning_parser: Literal["auto", "none", "qwen3", "deepseek_r1"] = "auto"

    @field_validator("models", "cors_origins", "allowed_hosts", "extra_chat_roles", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        return _split_commas(value)

    @field_validator("api_key", mode="before")
    @classmethod
    def _empty_key_is_none(cls, value: Any) -> Any:
        return None if value == "" else value

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if not self.models:
            raise ValueError("models: at least one model directory is needed")
        names = [self.model_name(d) for d in self.models]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"models: two directories share the name {', '.join(duplicates)}")
        if self.default_timeout_ms > self.max_timeout_ms:
            raise ValueError("default_timeout_ms must not exceed max_timeout_ms")
        return self

    @staticmethod
    def model_name(directory: str | Path) -> str:
        return Path(directory).resolve().name

    @property
    def beam_limit(self) -> int:
        """The largest beam a request may ask for (a beam's rows must fit the batch)."""
        return min(self.max_beam_size, self.max_batch_rows)

    @property
    def exposed_host(self) -> str:
        """The address clients reach the server on."""
        return self.published_host or self.host

    @property
    def open_beyond_loopback(self) -> bool:
        """No API key, and reachable beyond this machine."""
        return self.api_key is None and not is_loopback(self.exposed_host)

    @property
    def model_dirs(self) -> list[Path]:
        return [Path(d) for d in self.models]

    @property
    def runtime(self) -> Runtime:
        """How every model runs (attnserve/provision.py)."""
        return Runtime(
            backend=self.backend,
            variant=self.variant,
            provider=self.provider,
            threads=self.threads,
            spinning=self.spinning,
            auto_export=self.auto_export,
        )
