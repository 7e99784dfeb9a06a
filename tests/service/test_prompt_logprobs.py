"""Prompt logprobs through a real server: /v1/completions with echo and logprobs (the legacy
shape lm-evaluation-harness reads), token-array prompts, max_tokens 0, vLLM's prompt_logprobs on
both OpenAI routes and the native /v1/generate, each prompt of a batch scored as alone, and the
4xx answers."""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch

from attnserve.model.decoder_checkpoint import load_decoder_dir
from attnserve.model.text_tokenizer import TextTokenizer
from tests.service.helpers import LiveServer, make_settings

PROMPT = "w1 w2 w3 w4 w5 w6"


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def oa(both: LiveServer) -> openai.OpenAI:
    return client(both)


@pytest.fixture(scope="module")
def torch_server(lm_model: Path) -> Iterator[LiveServer]:
    """The tiny language model on the torch backend: its scores are the torch model's."""
    with LiveServer(make_settings(lm_model, backend="torch")) as server:
        yield server


def teacher_forced(model_dir: Path, ids: list[int]) -> np.ndarray:
    """log_softmax of one full forward of the torch model over the prompt: (T, V)."""
    model = load_decoder_dir(model_dir)
    tokens = torch.tensor([ids])
    with torch.no_grad():
        logits = model(tokens, torch.ones_like(tokens))[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()


def post(server: LiveServer, path: str, **body: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_echo_logprobs_are_the_torch_models_teacher_forced_scores(
    torch_server: LiveServer, lm_model: Path
) -> None:
    oa = client(torch_server)
    ids = TextTokenizer.load(lm_model).encode(PROMPT)
    answer = oa.completions.create(
        model="tiny-lm", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1
    )
    plain = oa.completions.create(model="tiny-lm", prompt=PROMPT, max_tokens=1, temperature=0)
    (choice,) = answer.choices
    assert choice.text == PROMPT + plain.choices[0].text
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert logprobs.top_logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.token_logprobs) == len(ids) + 1  # the prompt, then the generated token
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = teacher_forced(lm_model, ids)
    for i in range(1, len(ids)):
        assert logprobs.token_logprobs[i] == pytest.approx(expected[i - 1, ids[i]], abs=1e-5)
        top = logprobs.top_logprobs[i]
        assert max(top.values()) == pytest.approx(expected[i - 1].max(), abs=1e-5)
        assert logprobs.token_logprobs[i] in top.values()  # the prompt token is always listed
    # the generated token: the most likely after the whole prompt (greedy)
    assert logprobs.token_logprobs[-1] == pytest.approx(expected[-1].max(), abs=1e-5)
    assert "".join(logprobs.tokens[: len(ids)]).split() == PROMPT.split()
    assert logprobs.text_offset[: len(ids)] == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(ids))
    ]


def test_lm_eval_loglikelihood_requests(oa: openai.OpenAI, both: LiveServer) -> None:
    """What lm-evaluation-harness's local-completions model sends for loglikelihood: token-id
    prompts (several per request), max_tokens 1, echo and logprobs 1; it sums
    token_logprobs[ctxlen:-1] and reads top_logprobs for greedy-ness. A batch gives each
    prompt the numbers it gets alone."""
    prompts = [[1, 5, 9, 13, 20], [1, 5, 9, 30], [7, 8, 9, 10, 11, 12, 13, 14, 15]]
    body = {"temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": True, "seed": 1234}
    together = oa.completions.create(model="tiny-lm", prompt=prompts, **body)
    assert [c.index for c in together.choices] == [0, 1, 2]
    for ids, choice in zip(prompts, together.choices, strict=True):
        alone = oa.completions.create(model="tiny-lm", prompt=ids, **body).choices[0]
        assert choice.logprobs is not None and alone.logprobs is not None
        assert choice.logprobs.token_logprobs == alone.logprobs.token_logprobs
        assert choice.logprobs.top_logprobs == alone.logprobs.top_logprobs
        assert choice.text == alone.text
        assert len(choice.logprobs.token_logprobs or []) == len(ids) + 1
        assert all(len(top) <= 2 for top in (choice.logprobs.top_logprobs or [])[1:] if top)
    # concurrent requests (joining each other's batches) score as alone too
    single = {"model": "tiny-lm", **body, "prompt": prompts[2]}
    reference = post(both, "/v1/completions", **single).json()["choices"][0]["logprobs"]
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: post(both, "/v1/completions", **single), range(6)))
    assert all(a.json()["choices"][0]["logprobs"] == reference for a in answers)
    # the same numbers from the native API (and prompt_logprobs' ranks and alternatives)
    native = post(
        both, "/v1/generate", model="tiny-lm", text="w1 w2 w3", max_new_tokens=1, prompt_logprobs=2
    ).json()["translations"][0]["prompt_logprobs"]
    echoed = oa.completions.create(
        model="tiny-lm", prompt="w1 w2 w3", max_tokens=1, temperature=0, logprobs=2, echo=True
    ).choices[0]
    assert native[0] is None and len(native) == 3
    assert echoed.logprobs is not None and echoed.logprobs.token_logprobs is not None
    for entry, logprob in zip(native[1:], echoed.logprobs.token_logprobs[1:3], strict=True):
        assert entry["logprob"] == logprob and entry["rank"] >= 1
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"]


def test_max_tokens_zero_scores_the_prompt_alone(oa: openai.OpenAI) -> None:
    answer = oa.completions.create(
        model="tiny-lm", prompt=PROMPT, max_tokens=0, logprobs=0, echo=True
    )
    (choice,) = answer.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert len(choice.logprobs.token_logprobs) == 6  # the prompt's tokens only
    assert answer.usage is not None and answer.usage.completion_tokens == 0
    stream = list(
        oa.completions.create(model="tiny-lm", prompt=PROMPT, max_tokens=0, echo=True, stream=True)
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == PROMPT


def test_vllm_prompt_logprobs(oa: openai.OpenAI) -> None:
    completion = oa.completions.create(
        model="tiny-lm", prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 2}
    )
    scores = completion.choices[0].model_dump()["prompt_logprobs"]
    assert len(scores) == 6 and scores[0] is None
    for entry in scores[1:]:
        assert 2 <= len(entry) <= 3  # the prompt token and the 2 most likely
        assert {1, 2} <= {v["rank"] for v in entry.values()}
        for token_id, value in entry.items():
            assert int(token_id) >= 0 and value["logprob"] <= 0
            assert isinstance(value["decoded_token"], str)
    assert completion.choices[0].logprobs is None  # not asked for
    chat = oa.chat.completions.create(
        model="tiny-lm",
        messages=[{"role": "user", "content": "w4 w5"}],
        max_tokens=2,
        temperature=0,
        extra_body={"prompt_logprobs": 0},
    )
    chat_scores = chat.model_dump()["prompt_logprobs"]
    assert chat_scores[0] is None and all(len(e) == 1 for e in chat_scores[1:])
    assert chat.usage is not None and len(chat_scores) == chat.usage.prompt_tokens


def test_logprobs_without_echo_are_the_generated_tokens(oa: openai.OpenAI) -> None:
    answer = oa.completions.create(
        model="tiny-lm", prompt="w3", temperature=0, max_tokens=6, logprobs=2
    )
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert answer.usage is not None
    assert len(logprobs.token_logprobs) == answer.usage.completion_tokens  # a stop token too
    assert all(lp is not None for lp in logprobs.token_logprobs)
    assert answer.choices[0].model_dump()["prompt_logprobs"] is None


def test_bad_requests_are_400s_naming_the_field(
    oa: openai.OpenAI, both: LiveServer, model_dir: Path
) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"prompt": [[1, 2, 10_000]]}, "prompt"),  # an id outside the vocabulary
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": "w1", "extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
        ({"prompt": "w1", "extra_body": {"prompt_logprobs": -1}}, "prompt_logprobs"),
        ({"prompt": "w1", "max_tokens": 0}, "max_tokens"),  # nothing to answer without echo
        ({"prompt": "w1", "stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            oa.completions.create(model="tiny-lm", **extra)
        body = caught.value.body
        assert isinstance(body, dict) and body["param"] == param, (extra, body)
    with pytest.raises(openai.BadRequestError) as caught:
        oa.chat.completions.create(
            model="tiny-lm",
            messages=[{"role": "user", "content": "w1"}],
            extra_body={"prompt_logprobs": 50},
        )
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "prompt_logprobs"
    translation: list[tuple[dict[str, Any], str]] = [
        (
            {"prompt": "ka", "extra_body": {"prompt_logprobs": 1, "target_lang": "de"}},
            "prompt_logprobs",
        ),
        ({"prompt": [3, 4], "extra_body": {"target_lang": "de"}}, "prompt"),
        ({"prompt": "ka", "max_tokens": 0, "echo": True}, "max_tokens"),
    ]
    for extra, param in translation:
        with pytest.raises(openai.BadRequestError) as caught:
            oa.completions.create(model=model_dir.name, **extra)
        body = caught.value.body
        assert isinstance(body, dict) and body["param"] == param, (extra, body)
    native = post(both, "/v1/generate", text="ka", target_lang="de", prompt_logprobs=1)
    assert native.status_code == 422 and native.json()["error"]["param"] == "prompt_logprobs"
    streamed = post(
        both, "/v1/generate", model="tiny-lm", text="w1", stream=True, prompt_logprobs=1
    )
    assert streamed.status_code == 422 and streamed.json()["error"]["param"] == "prompt_logprobs"
    assert 'status="500"' not in both.metrics()


def test_first_logprob_is_null_and_finite_elsewhere(oa: openai.OpenAI) -> None:
    answer = oa.completions.create(
        model="tiny-lm", prompt=[2, 2, 2, 5], max_tokens=1, logprobs=5, echo=True, temperature=0
    )
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert logprobs.token_logprobs[0] is None
    assert all(math.isfinite(lp) for lp in logprobs.token_logprobs[1:] if lp is not None)
