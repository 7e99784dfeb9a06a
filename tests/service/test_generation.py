"""/v1/generate on a language model, through a real server serving it beside the translation
model: prompts and chats against the offline Generator, streaming, stop strings, samples,
logprobs, concurrency (each request as alone), and the 4xx answers."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from attnserve.engine.generator import Generator, StopStrings
from attnserve.engine.options import DecodingOptions
from tests.service.helpers import LiveServer


@pytest.fixture(scope="module")
def offline(lm_model: Path) -> Generator:
    return Generator.from_model_dir(lm_model, backend="onnx", variant="int8", threads=1)


def generate(server: LiveServer, **body: Any) -> httpx.Response:
    return httpx.post(server.url + "/v1/generate", json={"model": "tiny-lm", **body}, timeout=60)


def test_models_lists_both_kinds(both: LiveServer, model_dir: Path) -> None:
    models = httpx.get(both.url + "/v1/models").json()["data"]
    kinds = {m["id"]: m["kind"] for m in models}
    assert kinds == {model_dir.name: "translation", "tiny-lm": "generation"}
    assert models[0]["default"] and models[0]["kind"] == "translation"


def test_prompts_and_chats_equal_offline_generation(both: LiveServer, offline: Generator) -> None:
    options = DecodingOptions(max_new_tokens=8)
    answer = generate(both, text=["w1 w2 w3", "w9"], max_new_tokens=8).json()
    expected = offline.generate([offline.prompt_ids("w1 w2 w3"), offline.prompt_ids("w9")], options)
    for got, want in zip(answer["translations"], expected, strict=True):
        assert got["token_ids"] == want.completions[0].token_ids
        assert got["text"] == want.completions[0].text
        assert got["finish_reason"] == want.completions[0].finish_reason
    assert answer["usage"]["input_tokens"] == 4
    messages = [{"role": "user", "content": "w4 w5"}]
    chat = generate(both, messages=messages, max_new_tokens=8).json()
    want = offline.generate([offline.prompt_ids(messages=messages)], options)[0]
    assert chat["translations"][0]["token_ids"] == want.completions[0].token_ids
    assert chat["usage"]["input_tokens"] == want.prompt_tokens


def test_concurrent_requests_get_what_they_get_alone(both: LiveServer) -> None:
    bodies = [
        {"text": f"w{i} w{i + 1}", "max_new_tokens": 10, "sampling": True, "seed": i}
        for i in range(10)
    ] + [{"text": "w3 w2 w1", "max_new_tokens": 10, "beam_size": 3}]
    alone = [generate(both, **b).json()["translations"][0] for b in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda b: generate(both, **b).json()["translations"][0], bodies))
    assert [t["token_ids"] for t in together] == [a["token_ids"] for a in alone]


def test_samples_logprobs_and_stop_strings(both: LiveServer, offline: Generator) -> None:
    answer = generate(
        both, text="w1", max_new_tokens=6, sampling=True, seed=5, n=3, logprobs=2
    ).json()["translations"][0]
    assert len(answer["hypotheses"]) == 3
    assert len(answer["logprobs"]) == len(answer["token_ids"])
    assert all(len(e["top_logprobs"]) == 2 for e in answer["logprobs"])
    for prompt in ("w2 w3", "w6 w7", "w4 w9 w11"):  # one whose output has 4+ words
        free = generate(both, text=prompt, max_new_tokens=10, min_new_tokens=10).json()
        text = free["translations"][0]["text"]
        words = text.split(" ")
        if len(words) >= 4 and all(words[2:4]):
            break
    stop = " ".join(words[2:4])
    cut = generate(both, text=prompt, max_new_tokens=10, min_new_tokens=10, stop=[stop]).json()
    first = cut["translations"][0]
    assert first["finish_reason"] == "stop"
    assert first["text"] == StopStrings(offline.tokenizer, [stop]).truncate(text)
    assert stop not in first["text"]


def test_streaming_equals_the_json_answer_and_holds_back_stop_strings(both: LiveServer) -> None:
    body = {"text": "w6 w7", "max_new_tokens": 10, "min_new_tokens": 10}
    plain = generate(both, **body).json()["translations"][0]
    stop = " ".join(plain["text"].split(" ")[3:5])
    for extra in ({}, {"stop": stop}):
        events = []
        with httpx.stream(
            "POST",
            both.url + "/v1/generate",
            json={"model": "tiny-lm", **body, **extra, "stream": True},
            timeout=60,
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
        final = events[-1]
        streamed = "".join(e["text"] for e in events[:-1])
        if extra:
            assert final["finish_reason"] == "stop" and stop not in final["text"]
            assert streamed == final["text"]  # nothing of the stop string was ever shown
        else:
            assert [e["token_id"] for e in events[:-1]] == plain["token_ids"]
            assert final["text"] == plain["text"] == streamed


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"messages": [{"role": "user", "content": "w1"}], "text": "w1"}, 422, "messages"),
        ({}, 422, "text"),
        ({"text": "w1", "n": 2}, 422, "n"),
        ({"text": "w1", "stream": True, "sampling": True, "n": 2}, 422, "n"),
        ({"text": "w1", "stop": ["x"], "beam_size": 2}, 422, "stop"),
        ({"text": "w1", "logprobs": 21}, 422, "logprobs"),
        ({"text": "w1", "min_p": 2}, 422, "min_p"),
        ({"text": " ".join(["w1"] * 200)}, 422, "text"),
        ({"messages": []}, 422, "messages"),
    ],
)
def test_bad_requests_are_4xx_naming_the_param(
    both: LiveServer, body: dict[str, Any], status: int, param: str
) -> None:
    response = generate(both, **body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param or param in error["message"]


def test_kinds_do_not_mix(both: LiveServer) -> None:
    translate = httpx.post(both.url + "/v1/translate", json={"model": "tiny-lm", "text": "w1"})
    assert translate.status_code == 422
    assert translate.json()["error"]["param"] == "model"
    name = next(
        m["id"]
        for m in httpx.get(both.url + "/v1/models").json()["data"]
        if m["kind"] == "translation"
    )
    chat = httpx.post(
        both.url + "/v1/generate",
        json={"model": name, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 422 and chat.json()["error"]["param"] == "messages"
