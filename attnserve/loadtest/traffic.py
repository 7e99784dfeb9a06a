"""What the load test sends and how it judges the answers (plain Python: no locust, no gevent).

The locustfile is glue around this module: its user classes ask `Traffic.next(shape)` for a
request and check the response with `json_problem`, `http_problem` and `StreamState`; `Record`
counts what was sent per route and status, the output tokens and the time to first token, and is
written as JSON for the runner. Everything is configured by `ATTNSERVE_LOADTEST_*` variables
(`TrafficConfig.from_env`), so `locust -f attnserve/loadtest/locustfile.py` works on its own.
"""

from __future__ import annotations

import codecs
import json
import os
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from attnserve.loadtest.sentences import LanguagePool

ENV_PREFIX = "ATTNSERVE_LOADTEST_"
CLIENT_GRACE_SECONDS = 10.0  # the client waits this much longer than the server's deadline
# chat and chat_stream go to a language model through the OpenAI route; they are sent only
# when the server serves one (GET /v1/models: kind "generation").
DEFAULT_WEIGHTS = {"short": 4, "long": 2, "batch": 1, "stream": 3, "chat": 2, "chat_stream": 2}
DEFAULT_BEAMS = {"short": 1, "long": 4, "batch": 4, "stream": 1, "chat": 1, "chat_stream": 1}
CHAT_MAX_TOKENS = 48  # a chat answer's max_tokens unless max_new_tokens is set
CHAT_PROMPTS = (
    "Explain this sentence in simple words: {}",
    "Write one sentence that follows this one: {}",
    "What is the main idea of this sentence? {}",
)
MIXES = ("requests", "users")
SAMPLING = {"sampling": True, "temperature": 0.8, "top_p": 0.95}


@dataclass(frozen=True)
class Shape:
    """One kind of request: its route, which sentences, how many per request, the beam."""

    name: str
    route: str
    pool: str  # "short", "long" or "all" sentences of the source language
    stream: bool = False
    chat: bool = False  # an OpenAI chat completion to the language model

    def label(self, beam: int, texts: int) -> str:
        """The locust request name; its first word is the route (the metrics label)."""
        if self.chat:
            return f"{self.route} stream" if self.stream else self.route
        if self.stream:
            return f"{self.route} stream sampling"
        many = f" x{texts}" if texts > 1 else ""
        return f"{self.route} {self.name}{many} beam{beam}"


SHAPES = {
    "short": Shape("short", "/v1/translate", "short"),
    "long": Shape("long", "/v1/translate", "long"),
    "batch": Shape("batch", "/v1/translate", "all"),
    "stream": Shape("stream", "/v1/generate", "all", stream=True),
    "chat": Shape("chat", "/v1/chat/completions", "all", chat=True),
    "chat_stream": Shape("chat_stream", "/v1/chat/completions", "all", stream=True, chat=True),
}


def route_of(name: str) -> str:
    """The route of a locust request name (`/v1/translate short beam1` -> `/v1/translate`)."""
    return name.split(" ", 1)[0]


def parse_mapping(text: str, defaults: Mapping[str, int]) -> dict[str, int]:
    """`short=4,batch=0` over the defaults; names must be shapes, values integers >= 0."""
    values = dict(defaults)
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in SHAPES or not value.strip().isdigit():
            raise ValueError(f"{item!r}: expected NAME=INTEGER with NAME in {', '.join(SHAPES)}")
        values[name] = int(value)
    return values


def _flag(value: str) -> bool:
    return value.lower() in ("1", "true", "yes")


def _format_mapping(values: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in values.items())


@dataclass(frozen=True)
class TrafficConfig:
    """The load test's knobs; each is an ATTNSERVE_LOADTEST_<NAME> variable."""

    weights: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    beams: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_BEAMS))
    batch_size: int = 8  # texts per request of the `batch` shape
    deadline_ms: int = 30_000  # sent as timeout_ms; the client gives up CLIENT_GRACE later
    max_new_tokens: int | None = None  # None: the server's default for the model
    model: str | None = None  # None: the server's default model
    lm_model: str | None = None  # chat shapes' model; None: the first language model served
    sentences: Path | None = None  # TSV with language columns; None: the test books
    max_chars: int = 0  # drop longer sentences (0: keep all)
    wait_seconds: float = 0.0  # think time between a user's requests (uniform 0..wait)
    seed: int = 0
    # "requests": every user draws each request's shape by the weights, so every user count
    # sends the same mix; "users": each user keeps one shape (locust splits the users between
    # the shape classes by weight: with fewer users than shapes some shapes are never sent).
    mix: str = "requests"
    allow_empty: bool = False  # accept empty translations (random test models may end at once)
    record: Path | None = None  # where the locustfile writes its Record (JSON)

    @property
    def client_timeout(self) -> float:
        return self.deadline_ms / 1000 + CLIENT_GRACE_SECONDS

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> TrafficConfig:
        def get(name: str) -> str | None:
            value = env.get(ENV_PREFIX + name, "").strip()
            return value or None

        config = cls()
        changes: dict[str, Any] = {
            "weights": parse_mapping(get("WEIGHTS") or "", DEFAULT_WEIGHTS),
            "beams": parse_mapping(get("BEAMS") or "", DEFAULT_BEAMS),
        }
        for name, kind in (
            ("batch_size", int),
            ("deadline_ms", int),
            ("max_new_tokens", int),
            ("model", str),
            ("lm_model", str),
            ("sentences", Path),
            ("max_chars", int),
            ("wait_seconds", float),
            ("seed", int),
            ("mix", str),
            ("allow_empty", _flag),
            ("record", Path),
        ):
            value = get(name.upper())
            if value is not None:
                changes[name] = kind(value)
        config = replace(config, **changes)
        if min(config.beams.values()) < 1 or config.batch_size < 1 or config.deadline_ms < 1:
            raise ValueError("beams, batch size and deadline must be positive")
        if config.mix not in MIXES or not any(config.weights.values()):
            raise ValueError(f"mix must be one of {', '.join(MIXES)}, with a non-zero weight")
        return config

    def to_env(self) -> dict[str, str]:
        """The variables that make `from_env` return this configuration."""
        env = {
            "WEIGHTS": _format_mapping(self.weights),
            "BEAMS": _format_mapping(self.beams),
            "BATCH_SIZE": str(self.batch_size),
            "DEADLINE_MS": str(self.deadline_ms),
            "MAX_CHARS": str(self.max_chars),
            "WAIT_SECONDS": str(self.wait_seconds),
            "SEED": str(self.seed),
            "MIX": self.mix,
            "ALLOW_EMPTY": "1" if self.allow_empty else "0",
        }
        for name in ("max_new_tokens", "model", "lm_model", "sentences", "record"):
            value = getattr(self, name)
            if value is not None:
                env[name.upper()] = str(value)
        return {ENV_PREFIX + k: v for k, v in env.items()}


@dataclass(frozen=True)
class Direction:
    source: str
    target: str | None  # None: the model's only target (no language tag)


def directions_for(model: Mapping[str, Any], languages: Sequence[str]) -> list[Direction]:
    """The directions a model (an entry of GET /v1/models) translates that we have text for."""
    declared = model.get("source_lang")
    source = None if declared in (None, "", "mul", "multi") else declared
    sources = [lang for lang in languages if source is None or lang == source]
    tags = model.get("target_languages") or []
    if tags:
        found = [Direction(s, t) for s in sources for t in tags if t != s]
    else:
        found = [Direction(s, None) for s in sources if s != model.get("target_lang")]
    if not found:
        raise ValueError(
            f"model {model.get('name')} translates {declared or 'any language'} -> "
            f"{', '.join(tags) or model.get('target_lang')}; the sentences are in "
            f"{', '.join(languages)}"
        )
    return found


def pick_models(
    models: Sequence[Mapping[str, Any]], model: str | None, lm_model: str | None
) -> tuple[Mapping[str, Any] | None, str | None]:
    """The translation model (an entry of GET /v1/models) and the language model's id the
    traffic goes to: the named ones, else the default translation model (or the first one) and
    the first language model; None where the server serves no such model."""

    def named(name: str) -> Mapping[str, Any]:
        for entry in models:
            if entry["id"] == name:
                return entry
        raise ValueError(f"the server does not serve model {name!r}")

    translation = named(model) if model is not None else None
    if translation is not None and translation.get("kind") == "generation":
        raise ValueError(f"model {model!r} is a language model: pass it as the LM model")
    if translation is None and model is None:
        kinds = [m for m in models if m.get("kind", "translation") == "translation"]
        translation = next((m for m in kinds if m.get("default")), kinds[0] if kinds else None)
    if lm_model is not None:
        if named(lm_model).get("kind") != "generation":
            raise ValueError(f"model {lm_model!r} is not a language model")
        return translation, lm_model
    lm = next((m["id"] for m in models if m.get("kind") == "generation"), None)
    return translation, lm


@dataclass(frozen=True)
class PlannedRequest:
    name: str  # locust's request name, route first
    route: str
    body: dict[str, Any]
    texts: int
    stream: bool
    chat: bool = False


class Traffic:
    """Draws each request of a shape: sentences from the pools, a direction, the options."""

    def __init__(
        self,
        config: TrafficConfig,
        pools: Mapping[str, LanguagePool],
        directions: Sequence[Direction],
        rng: random.Random | None = None,
        lm_model: str | None = None,
    ) -> None:
        self.config = config
        self.pools = pools
        self.directions = list(directions)
        self.rng = rng or random.Random(config.seed)
        self.lm_model = lm_model
        self.weights = {
            name: weight
            for name, weight in config.weights.items()
            if (lm_model is not None if SHAPES[name].chat else bool(self.directions))
        }
        if not any(self.weights.values()):
            raise ValueError("no traffic to send: the weighted shapes need a model not served")

    def pick_shape(self) -> str:
        """A shape drawn by the weights (the `requests` mix) among those the server can take."""
        names = list(self.weights)
        return self.rng.choices(names, weights=[self.weights[n] for n in names])[0]

    def _chat(self, shape: Shape) -> PlannedRequest:
        pool = self.pools.get("en") or next(iter(self.pools.values()))
        sentence = self.rng.choice(pool.all)
        prompt = self.rng.choice(CHAT_PROMPTS).format(sentence)
        body: dict[str, Any] = {
            "model": self.lm_model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.config.max_new_tokens or CHAT_MAX_TOKENS,
            "temperature": SAMPLING["temperature"],
            "top_p": SAMPLING["top_p"],
            "seed": self.rng.randrange(2**31),
            "timeout_ms": self.config.deadline_ms,
        }
        if shape.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return PlannedRequest(shape.label(1, 1), shape.route, body, 1, shape.stream, chat=True)

    def next(self, shape_name: str | None = None) -> PlannedRequest:
        """A request of `shape_name`, or of a shape drawn by the weights."""
        if shape_name is not None and not self.weights.get(shape_name):
            shape_name = None  # a shape the served models cannot take: draw another
        shape = SHAPES[shape_name or self.pick_shape()]
        if shape.chat:
            return self._chat(shape)
        config = self.config
        direction = self.rng.choice(self.directions)
        sentences = getattr(self.pools[direction.source], shape.pool)
        texts = config.batch_size if shape.name == "batch" else 1
        picked = [self.rng.choice(sentences) for _ in range(texts)]
        beam = config.beams[shape.name]
        body: dict[str, Any] = {
            "text": picked if shape.name == "batch" else picked[0],
            "source_lang": direction.source,
            "beam_size": beam,
            "timeout_ms": config.deadline_ms,
        }
        if direction.target is not None:
            body["target_lang"] = direction.target
        if config.model is not None:
            body["model"] = config.model
        if config.max_new_tokens is not None:
            body["max_new_tokens"] = config.max_new_tokens
        if shape.stream:
            body.update(SAMPLING, stream=True, seed=self.rng.randrange(2**31))
        return PlannedRequest(shape.label(beam, texts), shape.route, body, texts, shape.stream)


def http_problem(status: int, text: str) -> str:
    """The failure message of a non-200 answer: `HTTP 429 overloaded`."""
    try:
        kind = json.loads(text)["error"]["type"]
    except (ValueError, KeyError, TypeError):
        kind = ""
    return f"HTTP {status} {kind}".rstrip()


def json_problem(data: Any, texts: int, allow_empty: bool = False) -> str | None:
    """What is wrong with a 200 JSON answer to `texts` texts, or None."""
    try:
        translations = data["translations"]
        if len(translations) != texts:
            return f"bad response: {len(translations)} translations for {texts} texts"
        if not allow_empty and any(not str(t["text"]).strip() for t in translations):
            return "bad response: empty translation"
        if int(data["usage"]["output_tokens"]) < texts:
            return "bad response: usage.output_tokens too small"
    except (KeyError, TypeError, ValueError):
        return "bad response: not a translation"
    return None


def chat_problem(data: Any, allow_empty: bool = False) -> str | None:
    """What is wrong with a 200 chat completion, or None."""
    try:
        (choice,) = data["choices"]
        content = str(choice["message"]["content"])
        if choice["finish_reason"] not in ("stop", "length"):
            return f"bad response: finish_reason {choice['finish_reason']!r}"
        if not allow_empty and not content.strip():
            return "bad response: empty answer"
        if int(data["usage"]["completion_tokens"]) < 1:
            return "bad response: usage.completion_tokens too small"
    except (KeyError, TypeError, ValueError):
        return "bad response: not a chat completion"
    return None


def chat_usage(usage: Mapping[str, Any]) -> dict[str, int]:
    """OpenAI's usage as the native one (what `Record.add_usage` reads)."""
    return {
        "input_tokens": int(usage.get("prompt_tokens", 0)),
        "output_tokens": int(usage.get("completion_tokens", 0)),
    }


class StreamState:
    """Reads Server-Sent Events: token deltas, the final event or an error."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()  # chunks split characters
        self._buffer = ""
        self.tokens = 0
        self.text = ""
        self.final: dict[str, Any] | None = None
        self.error: str | None = None
        self.done = False

    def feed_bytes(self, chunk: bytes) -> int:
        """A chunk of the response body; the number of token events it completed."""
        self._buffer += self._decoder.decode(chunk)
        *lines, self._buffer = self._buffer.split("\n")
        return sum(self.feed(line) for line in lines)

    def close(self) -> None:
        """The end of the body (raises UnicodeDecodeError if it ends inside a character)."""
        self.feed(self._buffer + self._decoder.decode(b"", final=True))
        self._buffer = ""

    def feed(self, line: str) -> bool:
        """One line of the stream; True when it carried a token."""
        if not line.startswith("data: "):
            return False
        payload = line[len("data: ") :].strip()
        if payload == "[DONE]":
            self.done = True
            return False
        try:
            event = json.loads(payload)
        except ValueError:
            self.error = "stream: malformed event"
            return False
        if "error" in event:
            error = event["error"]
            self.error = f"stream error {error.get('type', '')}".rstrip()
        elif event.get("object") == "chat.completion.chunk":
            return self._chat_chunk(event)
        elif "token_id" in event:
            self.tokens += 1
            self.text += event.get("text", "")
            return True
        elif "finish_reason" in event:
            self.final = event
        return False

    def _chat_chunk(self, event: Mapping[str, Any]) -> bool:
        """An OpenAI chat chunk: a delta, the finish_reason, or the usage; True for content."""
        if event.get("usage"):
            self.final = {**(self.final or {}), "usage": chat_usage(event["usage"])}
        for choice in event.get("choices") or []:
            if choice.get("finish_reason") is not None:
                self.final = {**(self.final or {}), "finish_reason": choice["finish_reason"]}
            content = (choice.get("delta") or {}).get("content")
            if content:
                self.tokens += 1
                self.text += content
                return True
        return False

    @property
    def output_tokens(self) -> int:
        if not self.final:
            return 0
        if "output_tokens" in self.final:
            return int(self.final["output_tokens"])
        return int(self.final.get("usage", {}).get("output_tokens", 0))

    def problem(self, allow_empty: bool = False) -> str | None:
        if self.error is not None:
            return self.error
        if self.final is None or not self.done:
            return "stream: ended without a final event and [DONE]"
        if "finish_reason" not in self.final or "usage" not in self.final:
            return "stream: no finish_reason or no usage"
        if "text" in self.final and self.final["text"] != self.text:
            return "stream: the deltas do not add up to the final text"
        if not allow_empty and not self.text.strip():
            return "bad response: empty translation"
        return None


@dataclass
class Record:
    """What one locust process sent and got: answers per (route, status), the latency of every
    successful request per request name, target tokens and the streams' time to first token."""

    started: float | None = None  # time.time()
    ended: float | None = None
    responses: Counter[tuple[str, int]] = field(default_factory=Counter)
    output_tokens: int = 0
    input_tokens: int = 0
    texts: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    latency_ms: dict[str, list[float]] = field(default_factory=dict)  # successful requests

    def count(self, route: str, status: int) -> None:
        self.responses[route, status] += 1

    def add_latency(self, name: str, milliseconds: float) -> None:
        self.latency_ms.setdefault(name, []).append(milliseconds)

    def add_usage(self, usage: Mapping[str, Any], texts: int) -> None:
        self.output_tokens += int(usage.get("output_tokens", 0))
        self.input_tokens += int(usage.get("input_tokens", 0))
        self.texts += texts

    def to_dict(self) -> dict[str, Any]:
        responses: dict[str, dict[str, int]] = {}
        for (route, status), n in sorted(self.responses.items()):
            responses.setdefault(route, {})[str(status)] = n
        return {
            "started": self.started,
            "ended": self.ended,
            "responses": responses,
            "output_tokens": self.output_tokens,
            "input_tokens": self.input_tokens,
            "texts": self.texts,
            "ttft_ms": [round(t, 2) for t in self.ttft_ms],
            "latency_ms": {k: [round(t, 2) for t in v] for k, v in sorted(self.latency_ms.items())},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Record:
        responses: Counter[tuple[str, int]] = Counter()
        for route, by_status in data.get("responses", {}).items():
            for status, n in by_status.items():
                responses[route, int(status)] = int(n)
        return cls(
            started=data.get("started"),
            ended=data.get("ended"),
            responses=responses,
            output_tokens=int(data.get("output_tokens", 0)),
            input_tokens=int(data.get("input_tokens", 0)),
            texts=int(data.get("texts", 0)),
            ttft_ms=[float(t) for t in data.get("ttft_ms", [])],
            latency_ms={k: [float(t) for t in v] for k, v in data.get("latency_ms", {}).items()},
        )

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict()) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> Record:
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))
