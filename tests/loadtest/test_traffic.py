"""What the locustfile sends and how it judges answers (traffic.py; no locust, no gevent)."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from attnserve.loadtest.sentences import LanguagePool
from attnserve.loadtest.traffic import (
    DEFAULT_WEIGHTS,
    SHAPES,
    Direction,
    Record,
    StreamState,
    Traffic,
    TrafficConfig,
    chat_problem,
    chat_usage,
    directions_for,
    http_problem,
    json_problem,
    parse_mapping,
    pick_models,
    route_of,
)

POOLS = {
    "en": LanguagePool.of(["Go.", "He went home.", "And he said unto them, Follow me."]),
    "de": LanguagePool.of(["Geh.", "Er ging heim.", "Und er sprach zu ihnen: Folgt mir nach."]),
}


def test_config_from_env_round_trips_and_rejects_nonsense(tmp_path: Path) -> None:
    config = TrafficConfig(
        weights=parse_mapping("batch=0,stream=5", DEFAULT_WEIGHTS),
        batch_size=3,
        max_new_tokens=16,
        model="m",
        sentences=tmp_path / "s.tsv",
        max_chars=80,
        mix="users",
        allow_empty=True,
        record=tmp_path / "r.json",
    )
    assert config.weights == {**DEFAULT_WEIGHTS, "batch": 0, "stream": 5}
    assert TrafficConfig.from_env(config.to_env()) == config
    assert TrafficConfig.from_env({}) == TrafficConfig()
    assert TrafficConfig().client_timeout == 40.0  # 30 s deadline + the client's grace
    for env in ({"WEIGHTS": "tiny=1"}, {"BEAMS": "short=0"}, {"MIX": "chaos"}, {"WEIGHTS": "x"}):
        with pytest.raises(ValueError):
            TrafficConfig.from_env({f"ATTNSERVE_LOADTEST_{k}": v for k, v in env.items()})
    zero = ",".join(f"{name}=0" for name in DEFAULT_WEIGHTS)
    with pytest.raises(ValueError, match="non-zero weight"):
        TrafficConfig.from_env({"ATTNSERVE_LOADTEST_WEIGHTS": zero})


def test_directions_follow_the_served_model() -> None:
    multi = {"id": "ende", "source_lang": None, "target_languages": ["de", "en"]}
    assert directions_for(multi, ["en", "de"]) == [Direction("en", "de"), Direction("de", "en")]
    tiny = {"id": "tiny", "source_lang": "en", "target_languages": ["de", "nl"]}
    assert directions_for(tiny, ["en", "de"]) == [Direction("en", "de"), Direction("en", "nl")]
    single = {"id": "opus", "source_lang": "en", "target_lang": "de", "target_languages": []}
    assert directions_for(single, ["en", "de"]) == [Direction("en", None)]
    with pytest.raises(ValueError, match="the sentences are in de"):
        directions_for(single, ["de"])


def test_each_shape_builds_its_request() -> None:
    config = TrafficConfig(batch_size=3, max_new_tokens=12, model="m")
    traffic = Traffic(config, POOLS, [Direction("de", "en")], random.Random(1))
    short = traffic.next("short")
    assert short.name == "/v1/translate short beam1" and short.route == "/v1/translate"
    assert short.body["text"] in POOLS["de"].short and short.texts == 1 and not short.stream
    assert short.body["source_lang"] == "de" and short.body["target_lang"] == "en"
    assert short.body["model"] == "m" and short.body["max_new_tokens"] == 12
    assert short.body["timeout_ms"] == 30_000 and short.body["beam_size"] == 1
    long = traffic.next("long")
    assert long.name == "/v1/translate long beam4" and long.body["text"] in POOLS["de"].long
    batch = traffic.next("batch")
    assert batch.name == "/v1/translate batch x3 beam4" and batch.texts == 3
    assert len(batch.body["text"]) == 3 and set(batch.body["text"]) <= set(POOLS["de"].all)
    stream = traffic.next("stream")
    assert stream.name == "/v1/generate stream sampling" and stream.route == "/v1/generate"
    assert stream.stream and stream.body["stream"] and stream.body["sampling"]
    assert stream.body["beam_size"] == 1 and isinstance(stream.body["seed"], int)
    assert all(route_of(r.name) == r.route for r in (short, long, batch, stream))
    # The server accepts exactly these fields (its request schemas forbid unknown ones).
    from attnserve.service.schemas import GenerateRequest, TranslateRequest

    TranslateRequest.model_validate(batch.body, strict=True)
    GenerateRequest.model_validate(stream.body, strict=True)


def test_mixed_traffic_draws_shapes_by_weight() -> None:
    config = TrafficConfig(weights={"short": 3, "long": 0, "batch": 1, "stream": 0})
    traffic = Traffic(config, POOLS, [Direction("en", "de")], random.Random(0))
    drawn = Counter(traffic.pick_shape() for _ in range(4000))
    assert set(drawn) == {"short", "batch"} and 2.6 < drawn["short"] / drawn["batch"] < 3.4


def test_json_and_http_problems() -> None:
    ok = {"translations": [{"text": "Hallo"}, {"text": "Welt"}], "usage": {"output_tokens": 5}}
    assert json_problem(ok, 2) is None
    assert json_problem(ok, 3) == "bad response: 2 translations for 3 texts"
    empty = {"translations": [{"text": " "}], "usage": {"output_tokens": 1}}
    assert json_problem(empty, 1) == "bad response: empty translation"
    assert json_problem(empty, 1, allow_empty=True) is None
    assert json_problem({"detail": "?"}, 1) == "bad response: not a translation"
    body = json.dumps({"error": {"type": "overloaded", "message": "at capacity"}})
    assert http_problem(429, body) == "HTTP 429 overloaded"
    assert http_problem(502, "<html>bad gateway</html>") == "HTTP 502"


def _events(*events: object) -> bytes:
    return b"".join(
        f"data: {e if isinstance(e, str) else json.dumps(e, ensure_ascii=False)}\n\n".encode()
        for e in events
    )


def test_stream_state_reads_events_split_anywhere_even_inside_a_character() -> None:
    body = _events(
        {"index": 0, "token_id": 5, "text": "Grüß"},
        {"index": 1, "token_id": 9, "text": " Gott"},
        {"finish_reason": "stop", "text": "Grüß Gott", "output_tokens": 3, "usage": {}},
        "[DONE]",
    )
    for size in (1, 2, 7, len(body)):
        state = StreamState()
        tokens = sum(state.feed_bytes(body[i : i + size]) for i in range(0, len(body), size))
        state.close()
        assert tokens == 2 and state.text == "Grüß Gott" and state.output_tokens == 3
        assert state.problem() is None


def test_stream_state_problems() -> None:
    def problem(body: bytes, allow_empty: bool = False) -> str | None:
        state = StreamState()
        state.feed_bytes(body)
        state.close()
        return state.problem(allow_empty)

    token = {"index": 0, "token_id": 5, "text": "Ja"}
    final = {"finish_reason": "stop", "text": "Ja", "output_tokens": 2, "usage": {}}
    assert problem(_events(token, final)) == "stream: ended without a final event and [DONE]"
    error = {"error": {"type": "deadline_exceeded", "message": "late"}}
    assert problem(_events(token, error, "[DONE]")) == "stream error deadline_exceeded"
    wrong = {**final, "text": "Nein"}
    assert problem(_events(token, wrong, "[DONE]")) == (
        "stream: the deltas do not add up to the final text"
    )
    blank = {**final, "text": "", "output_tokens": 1}
    assert problem(_events(blank, "[DONE]")) == "bad response: empty translation"
    assert problem(_events(blank, "[DONE]"), allow_empty=True) is None
    state = StreamState()
    state.feed_bytes("data: Grü".encode()[:-1])
    with pytest.raises(UnicodeDecodeError):  # the body ended inside a character
        state.close()


def test_record_round_trips(tmp_path: Path) -> None:
    record = Record(started=1.0, ended=2.5, output_tokens=7, input_tokens=9, texts=2)
    record.count("/v1/translate", 200)
    record.count("/v1/translate", 429)
    record.count("/v1/translate", 200)
    record.add_latency("/v1/translate short beam1", 12.345)
    record.ttft_ms.append(3.21)
    record.save(tmp_path / "r.json")
    loaded = Record.load(tmp_path / "r.json")
    assert loaded.responses == Counter({("/v1/translate", 200): 2, ("/v1/translate", 429): 1})
    assert loaded.latency_ms == {"/v1/translate short beam1": [12.35]}
    assert (loaded.started, loaded.ended, loaded.output_tokens, loaded.texts) == (1.0, 2.5, 7, 2)
    assert loaded.ttft_ms == [3.21]


MODELS = [
    {"id": "ende", "kind": "translation", "default": True, "target_languages": ["de", "en"]},
    {"id": "lm", "kind": "generation", "default": False, "target_languages": []},
]


def test_pick_models_finds_the_translation_and_the_language_model() -> None:
    translation, lm = pick_models(MODELS, None, None)
    assert translation is not None and translation["id"] == "ende" and lm == "lm"
    assert pick_models(MODELS[:1], None, None)[1] is None
    assert pick_models(MODELS[1:], None, None) == (None, "lm")
    with pytest.raises(ValueError, match="is a language model"):
        pick_models(MODELS, "lm", None)
    with pytest.raises(ValueError, match="not a language model"):
        pick_models(MODELS, None, "ende")
    with pytest.raises(ValueError, match="does not serve"):
        pick_models(MODELS, "other", None)


def test_chat_shapes_build_openai_requests() -> None:
    config = TrafficConfig(max_new_tokens=20)
    traffic = Traffic(config, POOLS, [Direction("en", "de")], random.Random(2), lm_model="lm")
    chat = traffic.next("chat")
    assert chat.route == "/v1/chat/completions" and chat.name == "/v1/chat/completions"
    assert chat.chat and not chat.stream and chat.body["model"] == "lm"
    assert chat.body["max_tokens"] == 20 and chat.body["messages"][0]["role"] == "user"
    assert any(s in chat.body["messages"][0]["content"] for s in POOLS["en"].all)
    stream = traffic.next("chat_stream")
    assert stream.name == "/v1/chat/completions stream" and stream.stream
    assert stream.body["stream_options"] == {"include_usage": True}
    # The server's OpenAI schema takes them.
    from attnserve.service.openai_schemas import ChatCompletionRequest

    for planned in (chat, stream):
        request = ChatCompletionRequest.model_validate(planned.body)
        assert not request.model_extra
    # without a language model the chat shapes are never drawn, and a chat user draws another
    alone = Traffic(config, POOLS, [Direction("en", "de")], random.Random(3))
    assert not any(SHAPES[alone.pick_shape()].chat for _ in range(200))
    assert not alone.next("chat").chat
    with pytest.raises(ValueError, match="no traffic"):
        Traffic(config, POOLS, [], random.Random(3))
    only_lm = Traffic(config, POOLS, [], random.Random(4), lm_model="lm")
    assert all(SHAPES[only_lm.pick_shape()].chat for _ in range(200))


def test_chat_answers_are_checked() -> None:
    ok = {
        "choices": [{"message": {"content": "Yes."}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3},
    }
    assert chat_problem(ok) is None
    assert chat_usage(ok["usage"]) == {"input_tokens": 7, "output_tokens": 3}
    empty = {**ok, "choices": [{"message": {"content": ""}, "finish_reason": "stop"}]}
    assert chat_problem(empty) == "bad response: empty answer"
    assert chat_problem(empty, allow_empty=True) is None
    assert chat_problem({"translations": []}) == "bad response: not a chat completion"
    body = _events(
        {"object": "chat.completion.chunk", "choices": [{"delta": {"role": "assistant"}}]},
        {"object": "chat.completion.chunk", "choices": [{"delta": {"content": "Grüß"}}]},
        {"object": "chat.completion.chunk", "choices": [{"delta": {"content": " dich"}}]},
        {"object": "chat.completion.chunk", "choices": [{"delta": {}, "finish_reason": "stop"}]},
        {
            "object": "chat.completion.chunk",
            "choices": [],
            "usage": {"prompt_tokens": 4, "completion_tokens": 2},
        },
        "[DONE]",
    )
    for size in (1, 3, len(body)):
        state = StreamState()
        tokens = sum(state.feed_bytes(body[i : i + size]) for i in range(0, len(body), size))
        state.close()
        assert tokens == 2 and state.text == "Grüß dich" and state.output_tokens == 2
        assert state.problem() is None
    cut = body[: body.index(b'"usage"') - 60]  # no usage chunk, no [DONE]
    state = StreamState()
    state.feed_bytes(cut)
    assert state.problem() is not None
