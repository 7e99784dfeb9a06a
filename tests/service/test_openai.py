"""The OpenAI-compatible API through the official `openai` client against a real server:
models, chat and text completions (plain and streamed), n, stop, seeds, logprobs, usage,
a translation model behind /v1/completions, and each error status as the client's exception
(with its retries on 429 and none on a 504)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.service.helpers import LiveServer, make_settings, metric_value, slow_factory

CHAT = [{"role": "user", "content": "w4 w5 w6"}]


def client(server: LiveServer, **kwargs: Any) -> openai.OpenAI:
    kwargs.setdefault("api_key", "unused")
    kwargs.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=server.url + "/v1", timeout=60.0, **kwargs)


@pytest.fixture(scope="module")
def oa(both: LiveServer) -> openai.OpenAI:
    return client(both)


def native(server: LiveServer, **body: Any) -> dict[str, Any]:
    response = httpx.post(server.url + "/v1/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_models_list(oa: openai.OpenAI, model_dir: Path) -> None:
    models = oa.models.list().data
    assert [m.id for m in models] == [model_dir.name, "tiny-lm"]
    assert all(m.object == "model" and m.owned_by == "attnserve" for m in models)
    assert all(isinstance(m.created, int) and m.created > 0 for m in models)
    extra = [m.model_dump() for m in models]
    assert [e["kind"] for e in extra] == ["translation", "generation"]
    assert extra[0]["default"] and extra[0]["target_languages"]
    assert extra[1]["context_length"] > 0
    one = oa.models.retrieve("tiny-lm")
    assert one.id == "tiny-lm" and one.model_dump() == extra[1]
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve("no-such-model")


def test_chat_greedy_equals_native_generation(oa: openai.OpenAI, both: LiveServer) -> None:
    answer = oa.chat.completions.create(model="tiny-lm", messages=CHAT, temperature=0, max_tokens=8)
    want = native(both, model="tiny-lm", messages=CHAT, max_new_tokens=8)
    (choice,) = answer.choices
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    assert answer.model == "tiny-lm"
    assert choice.message.role == "assistant"
    assert choice.message.content == want["translations"][0]["text"]
    assert choice.finish_reason == want["translations"][0]["finish_reason"]
    usage = answer.usage
    assert usage is not None
    assert usage.prompt_tokens == want["usage"]["input_tokens"]
    assert usage.completion_tokens == want["usage"]["output_tokens"]
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # max_completion_tokens is max_tokens' newer name
    newer = oa.chat.completions.create(
        model="tiny-lm", messages=CHAT, temperature=0, max_completion_tokens=8
    )
    assert newer.choices[0].message.content == choice.message.content


def test_chat_stream_concatenates_to_the_plain_answer(oa: openai.OpenAI) -> None:
    plain = oa.chat.completions.create(model="tiny-lm", messages=CHAT, temperature=0, max_tokens=12)
    chunks = list(
        oa.chat.completions.create(
            model="tiny-lm",
            messages=CHAT,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    *content, last_choice, usage_chunk = chunks
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == plain.choices[0].message.content
    assert all(c.choices[0].finish_reason is None for c in content)
    assert last_choice.choices[0].finish_reason == plain.choices[0].finish_reason
    assert usage_chunk.choices == [] and usage_chunk.usage == plain.usage
    # without include_usage no chunk carries usage
    bare = list(
        oa.chat.completions.create(
            model="tiny-lm", messages=CHAT, temperature=0, max_tokens=12, stream=True
        )
    )
    assert all(c.usage is None for c in bare) and bare[-1].choices[0].finish_reason


def test_completions_prompts_n_and_seed(oa: openai.OpenAI) -> None:
    def sample(seed: int) -> list[str]:
        answer = oa.completions.create(
            model="tiny-lm", prompt=["w1 w2", "w7"], n=2, seed=seed, max_tokens=8
        )
        assert [c.index for c in answer.choices] == [0, 1, 2, 3]
        assert answer.object == "text_completion"
        return [c.text for c in answer.choices]

    first = sample(3)
    assert sample(3) == first  # a seed reproduces the samples
    assert any(sample(s) != first for s in (4, 5, 6))
    # usage counts every sample's tokens (min_tokens: each sample writes exactly 6)
    three = oa.chat.completions.create(
        model="tiny-lm", messages=CHAT, n=3, seed=1, max_tokens=6, extra_body={"min_tokens": 6}
    )
    assert len(three.choices) == 3 and three.usage is not None
    assert three.usage.completion_tokens == 18


def test_completion_stream_and_echo(oa: openai.OpenAI) -> None:
    plain = oa.completions.create(model="tiny-lm", prompt="w1 w2", temperature=0, max_tokens=10)
    stream = list(
        oa.completions.create(
            model="tiny-lm", prompt="w1 w2", temperature=0, max_tokens=10, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == plain.choices[0].text
    assert stream[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    echoed = oa.completions.create(
        model="tiny-lm", prompt="w1 w2", temperature=0, max_tokens=10, echo=True
    )
    assert echoed.choices[0].text == "w1 w2" + plain.choices[0].text


def test_stop_strings(oa: openai.OpenAI) -> None:
    plain = oa.completions.create(model="tiny-lm", prompt="w3", temperature=0, max_tokens=16)
    text = plain.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    cut = oa.completions.create(
        model="tiny-lm", prompt="w3", temperature=0, max_tokens=16, stop=[stop, "never-seen"]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs(oa: openai.OpenAI) -> None:
    chat = oa.chat.completions.create(
        model="tiny-lm", messages=CHAT, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3
    )
    choice = chat.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert chat.usage is not None and len(entries) == chat.usage.completion_tokens
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        assert bytes(entry.bytes or []).decode("utf-8", "replace") == entry.token
    text = oa.completions.create(
        model="tiny-lm", prompt="w3", temperature=0, max_tokens=6, logprobs=2
    )
    logprobs = text.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert "".join(logprobs.tokens) == text.choices[0].text
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
    ]
    assert all(len(top) <= 2 for top in logprobs.top_logprobs or [])


def test_extra_body_options(oa: openai.OpenAI) -> None:
    beams = oa.completions.create(
        model="tiny-lm",
        prompt="w1",
        max_tokens=6,
        n=2,
        extra_body={"use_beam_search": True, "best_of": 3},
    )
    assert len(beams.choices) == 2
    texts = [c.text for c in beams.choices]
    assert len(set(texts)) == 2  # the n-best list: two different answers
    greedy_min = oa.completions.create(
        model="tiny-lm", prompt="w1", temperature=0, max_tokens=6, extra_body={"min_tokens": 6}
    )
    assert greedy_min.usage is not None and greedy_min.usage.completion_tokens == 6
    sampled = oa.completions.create(
        model="tiny-lm",
        prompt="w1",
        max_tokens=6,
        seed=1,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2},
    )
    assert len(sampled.choices) == 1 and sampled.choices[0].finish_reason in ("stop", "length")


def test_translation_model_behind_completions(
    oa: openai.OpenAI, both: LiveServer, model_dir: Path
) -> None:
    translated = oa.completions.create(
        model=model_dir.name, prompt=["ka", "kamaru"], extra_body={"target_lang": "de"}
    )
    want = httpx.post(
        both.url + "/v1/translate",
        json={"model": model_dir.name, "text": ["ka", "kamaru"], "target_lang": "de"},
    ).json()
    assert [c.text for c in translated.choices] == [t["text"] for t in want["translations"]]
    nbest = oa.completions.create(
        model=model_dir.name, prompt="ka", n=2, extra_body={"target_lang": "de"}
    )
    want_nbest = httpx.post(
        both.url + "/v1/translate",
        json={"text": "ka", "target_lang": "de", "num_hypotheses": 2, "beam_size": 4},
    ).json()
    assert [c.text for c in nbest.choices] == [
        h["text"] for h in want_nbest["translations"][0]["hypotheses"]
    ]


def test_invalid_requests_are_bad_request_errors(oa: openai.OpenAI, model_dir: Path) -> None:
    cases: list[dict[str, Any]] = [
        {"temperature": 5},  # out of range (schema)
        {"max_tokens": 10**6},  # over the model's limit (options)
        {"n": 2, "temperature": 0},  # several answers of greedy decoding
        {"extra_body": {"tools": [{"type": "function", "function": {"name": "f g"}}]}},
        {"extra_body": {"functions": [{"name": "f"}]}},  # deprecated: use tools
        {"logprobs": True, "stream": True},
    ]
    cases += [
        {"top_logprobs": 2},  # without logprobs
        {"stream_options": {"include_usage": True}},  # without stream (as OpenAI answers it)
        {"stop": [""]},
    ]
    for extra in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            oa.chat.completions.create(**{"model": "tiny-lm", "messages": CHAT, **extra})
        error = caught.value.body
        assert isinstance(error, dict) and error["message"] and error["param"], extra
    with pytest.raises(openai.BadRequestError) as caught:
        oa.chat.completions.create(model=model_dir.name, messages=CHAT)
    assert "translates" in str(caught.value)
    with pytest.raises(openai.BadRequestError) as caught:
        oa.completions.create(model="tiny-lm", prompt="w1", max_tokens=10**6)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "max_tokens"
    message = caught.value.body["message"]  # the client's names, not the native API's
    assert "max_tokens" in message and "max_new_tokens" not in message, message
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="no-such-model", messages=CHAT)


def test_messages_without_their_text_and_native_streams_with_logprobs_are_refused(
    both: LiveServer,
) -> None:
    """A user message without content, a text part without its text: 400s that say so (an
    assistant's message may have none: its tool calls); the native stream does not carry
    logprobs, so asking for both is a 422, as the OpenAI routes' 400."""
    with both.client() as http:
        for message, words in [
            ({"role": "user"}, "needs its content"),
            ({"role": "user", "content": None}, "needs its content"),
            ({"role": "user", "content": [{"type": "text"}]}, "needs its text"),
            ({"role": "user", "content": [{"type": "image_url"}]}, "not 'image_url'"),
        ]:
            answer = http.post(
                "/v1/chat/completions",
                json={"model": "tiny-lm", "max_tokens": 2, "messages": [message]},
            )
            assert answer.status_code == 400, answer.text
            assert words in answer.json()["error"]["message"], answer.text
        answer = http.post(
            "/v1/chat/completions",
            json={
                "model": "tiny-lm",
                "max_tokens": 2,
                "messages": [*CHAT, {"role": "assistant", "content": None}, *CHAT],
            },
        )
        assert answer.status_code == 200, answer.text
        native = http.post(
            "/v1/generate",
            json={"model": "tiny-lm", "text": "w1", "stream": True, "logprobs": 1},
        )
        assert native.status_code == 422 and native.json()["error"]["param"] == "logprobs"
        stop = http.post("/v1/generate", json={"model": "tiny-lm", "text": "w1", "stop": ["", "x"]})
        assert stop.json()["error"]["message"] == "stop must hold non-empty strings only"
        for probe in ("/healthz", "/readyz"):
            assert http.head(probe).status_code == 200


def test_text_that_is_not_unicode_is_a_bad_request(both: LiveServer) -> None:
    # a lone surrogate, escaped in the JSON (the client cannot even encode it)
    raw = b'{"model": "tiny-lm", "messages": [{"role": "user", "content": "w1\\ud800"}]}'
    answer = httpx.post(
        both.url + "/v1/chat/completions",
        content=raw,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "messages"


def test_translation_model_refuses_language_model_options(
    oa: openai.OpenAI, model_dir: Path
) -> None:
    lm_only: list[dict[str, Any]] = [
        {"stop": ["x"]},
        {"presence_penalty": 0.5},
        {"logprobs": 0},
        {"echo": True},
        {"extra_body": {"target_lang": "de", "min_p": 0.1}},
    ]
    for extra in lm_only:
        body = {"extra_body": {"target_lang": "de"}, **extra}
        with pytest.raises(openai.BadRequestError) as caught:
            oa.completions.create(model=model_dir.name, prompt="ka", **body)
        assert isinstance(caught.value.body, dict) and caught.value.body["param"], extra


def test_null_fields_mean_their_defaults(both: LiveServer) -> None:
    """The client sends null for a parameter given as None; that is the default, not a 400."""
    body = {
        "model": "tiny-lm",
        "messages": CHAT,
        "temperature": 0,
        "max_tokens": 4,
        "stream": None,
        "logprobs": None,
        "top_logprobs": None,
        "n": None,
        "stop": None,
        "seed": None,
        "user": None,
        "use_beam_search": None,
    }
    answer = httpx.post(both.url + "/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    text = {**body, "prompt": "w1", "echo": None}
    del text["messages"], text["top_logprobs"]
    answer = httpx.post(both.url + "/v1/completions", json=text, timeout=60)
    assert answer.status_code == 200, answer.text


def test_authentication_error(model_dir: Path) -> None:
    with LiveServer(make_settings(model_dir, api_key="k3y")) as server:
        with pytest.raises(openai.AuthenticationError):
            client(server, api_key="wrong").completions.create(
                model=model_dir.name, prompt="ka", extra_body={"target_lang": "de"}
            )
        right = client(server, api_key="k3y").completions.create(
            model=model_dir.name, prompt="ka", extra_body={"target_lang": "de"}
        )
        assert right.object == "text_completion" and len(right.choices) == 1


@pytest.fixture(scope="module")
def slow(model_dir: Path) -> Iterator[LiveServer]:
    settings = make_settings(model_dir, variant="fp32", max_batch_rows=1, max_waiting=1)
    with LiveServer(settings, backend_factory=slow_factory(0.05)) as server:
        yield server


def _long(server: LiveServer, tokens: int = 50, **extra: Any) -> dict[str, Any]:
    """A greedy translation of `tokens` steps of 0.05 s (2.5 s)."""
    body = {"target_lang": "de", "min_tokens": tokens, **extra}
    model = server.service.registry.default.name
    return {
        "model": model,
        "prompt": "kamaru tesino",
        "temperature": 0,
        "max_tokens": tokens,
        "extra_body": body,
    }


def test_queue_full_is_a_rate_limit_error_retried_without_running_twice(
    slow: LiveServer,
) -> None:
    route = "/v1/completions"
    before = slow.metrics()
    with ThreadPoolExecutor(2) as pool:
        # one request runs, one waits: the queue (max_waiting 1) is full for ~2.5 s
        busy = [pool.submit(client(slow).completions.create, **_long(slow)) for _ in range(2)]
        time.sleep(0.5)
        with pytest.raises(openai.RateLimitError) as caught:
            client(slow).completions.create(**_long(slow))
        assert caught.value.response.headers["retry-after"] == "1"
        # the client's own retries (Retry-After 1 s) outlast the busy requests: it succeeds
        retried = client(slow, max_retries=5).completions.create(**_long(slow, 5))
        for future in busy:
            future.result()
    after = slow.metrics()
    rejected = metric_value(after, "attnserve_requests_total", route=route, status="429")
    rejected -= metric_value(before, "attnserve_requests_total", route=route, status="429")
    served = metric_value(after, "attnserve_requests_total", route=route, status="200")
    served -= metric_value(before, "attnserve_requests_total", route=route, status="200")
    assert retried.object == "text_completion" and len(retried.choices) == 1
    assert served == 3  # the busy two and the retried one, each run once
    assert rejected >= 2  # the refused call and at least one of the retried call's attempts


def test_deadline_is_not_retried(slow: LiveServer) -> None:
    route = "/v1/completions"
    before = metric_value(slow.metrics(), "attnserve_requests_total", route=route, status="504")
    with pytest.raises(openai.InternalServerError) as caught:
        client(slow, max_retries=2).completions.create(**_long(slow, timeout_ms=200))
    assert caught.value.status_code == 504
    assert caught.value.response.headers["x-should-retry"] == "false"
    after = metric_value(slow.metrics(), "attnserve_requests_total", route=route, status="504")
    assert after - before == 1


def test_logprob_pieces_and_bytes_with_a_byte_fallback_tokenizer() -> None:
    """SentencePiece's byte fallback (Llama 2, Phi-3, Gemma): 🎉 is four `<0x..>` tokens that
    decode to four U+FFFD until the last; the pieces join to the text, each token's bytes are
    its byte, a lone "▁" is a space even where the decoder strips a leading one, and a
    special token has no bytes."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer, decoders, models

    from attnserve.model.text_tokenizer import TextTokenizer
    from attnserve.service.openai_logprobs import Pieces

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    pieces += ["▁ok", "▁", "ok"]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    byte = {b: vocab[f"<0x{b:02X}>"] for b in range(256)}
    ids = [*(byte[b] for b in "🎉".encode()), vocab["▁ok"], vocab["▁"]]
    ids += [*(byte[b] for b in "日".encode()), vocab["</s>"]]
    model: Any = SimpleNamespace(tokenizer=TextTokenizer(tok))
    split = Pieces(model, ids)
    texts = [split.piece(i) for i in range(len(ids))]
    assert texts == ["", "", "", "🎉", " ok", " ", "", "", "日", ""]
    assert "".join(texts) == model.tokenizer.decode(ids) == "🎉 ok 日"
    raw = [split.token_bytes(t, text) for t, text in zip(ids, texts, strict=True)]
    assert [len(r) for r in raw] == [1, 1, 1, 1, 3, 1, 1, 1, 1, 0]
    assert bytes(b for r in raw for b in r).decode() == "🎉 ok 日"
