"""vLLM's /tokenize and /detokenize through a real server, for the language model (prompts and
chats, as the model's own tokenizer and chat template give them) and the translation model (the
source as its encoder sees it), and their 400s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from attnserve.model.checkpoint import load_tokenizer
from attnserve.model.text_tokenizer import TextTokenizer
from tests.service.helpers import LiveServer

CHAT = [{"role": "system", "content": "w1"}, {"role": "user", "content": "w4 w5 w6"}]


def post(server: LiveServer, path: str, body: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def ok(server: LiveServer, path: str, **body: Any) -> dict[str, Any]:
    answer = post(server, path, body)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def test_language_model_prompts_and_chats(both: LiveServer, lm_model: Path) -> None:
    tokenizer = TextTokenizer.load(lm_model)
    answer = ok(both, "/tokenize", model="tiny-lm", prompt="w1 w2\nw3")
    assert answer["tokens"] == tokenizer.encode("w1 w2\nw3")
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == 128
    assert "token_strs" not in answer
    # lm-evaluation-harness's check of a remote tokenizer
    probe = ok(both, "/tokenize", model="tiny-lm", prompt="w7", add_special_tokens=False)
    assert probe["tokens"] == tokenizer.encode("w7", add_special_tokens=False)
    strs = ok(both, "/tokenize", model="tiny-lm", prompt="w1 w2", return_token_strs=True)
    assert strs["token_strs"] == ["w1", "w2"]
    chat = ok(both, "/tokenize", model="tiny-lm", messages=CHAT)
    assert chat["tokens"] == tokenizer.encode_chat(CHAT)
    bare = ok(both, "/tokenize", model="tiny-lm", messages=CHAT, add_generation_prompt=False)
    assert bare["tokens"] == tokenizer.encode_chat(CHAT, add_generation_prompt=False)
    assert bare["count"] < chat["count"]
    assistant = [*CHAT, {"role": "assistant", "content": "w9 w10"}]
    open_turn = ok(
        both,
        "/tokenize",
        model="tiny-lm",
        messages=assistant,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    closed = tokenizer.encode_chat(assistant, add_generation_prompt=False)
    assert open_turn["tokens"] == closed[:-1]  # the same chat, without the closing <|im_end|>
    text = ok(both, "/detokenize", model="tiny-lm", tokens=chat["tokens"])["prompt"]
    assert text == tokenizer.decode(chat["tokens"], skip_special_tokens=False)
    assert "<|im_start|>" in text
    assert ok(both, "/detokenize", model="tiny-lm", tokens=[])["prompt"] == ""
    assert ok(both, "/tokenize", model="tiny-lm", prompt="")["count"] == 0


def test_translation_model_tokenizes_its_source(both: LiveServer, model_dir: Path) -> None:
    tokenizer = load_tokenizer(model_dir)
    served = httpx.get(both.url + "/v1/models").json()["data"][0]
    answer = ok(both, "/tokenize", prompt="kamaru ka", target_lang="de")  # the default model
    assert answer["tokens"] == tokenizer.encode_source("kamaru ka", target_lang="de")
    assert answer["max_model_len"] == served["max_input_tokens"]
    pieces = ok(both, "/tokenize", prompt="kamaru ka", add_special_tokens=False)
    assert pieces["tokens"] == [t for t in answer["tokens"] if t not in tokenizer.added_ids()]
    assert len(pieces["tokens"]) < answer["count"]
    strs = ok(both, "/tokenize", prompt="ka", return_token_strs=True)["token_strs"]
    assert strs == tokenizer.source_pieces(tokenizer.encode_source("ka"))
    back = ok(both, "/detokenize", model=model_dir.name, tokens=answer["tokens"])["prompt"]
    assert back == "kamaru ka"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"model": "tiny-lm", "prompt": "w1", "messages": CHAT}, None),
        ("/tokenize", {"model": "tiny-lm", "messages": []}, "messages"),
        ("/tokenize", {"model": "tiny-lm", "prompt": 5}, None),
        ("/tokenize", {"prompt": "ka", "messages": CHAT}, None),
        ("/tokenize", {"messages": CHAT}, "messages"),  # the translation model
        ("/tokenize", {"prompt": "ka", "target_lang": "xx"}, "target_lang"),
        ("/tokenize", {"model": "tiny-lm", "prompt": "w1", "target_lang": "de"}, "target_lang"),
        ("/tokenize", {"model": "no-such-model", "prompt": "w1"}, "model"),
        (
            "/tokenize",
            {"model": "tiny-lm", "messages": CHAT, "continue_final_message": True},
            "messages",
        ),
        ("/tokenize", {}, None),
        ("/detokenize", {"model": "tiny-lm", "tokens": [1, 68]}, "tokens"),  # 68 words
        ("/detokenize", {"model": "tiny-lm", "tokens": [-1]}, "tokens"),
        ("/detokenize", {"model": "tiny-lm", "tokens": [2**70]}, "tokens"),
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
        ("/detokenize", {"model": "tiny-lm", "tokens": "w1"}, "tokens"),
    ],
)
def test_bad_input_is_a_400(
    both: LiveServer, path: str, body: dict[str, Any], param: str | None
) -> None:
    answer = post(both, path, body)
    expected = 404 if param == "model" else 400
    assert answer.status_code == expected, answer.text
    error = answer.json()["error"]
    assert error["message"]
    if param is not None:
        assert error["param"] == param


def test_text_that_is_not_unicode_is_a_400(both: LiveServer) -> None:
    for raw in (
        b'{"model": "tiny-lm", "prompt": "w1\\ud800"}',
        b'{"model": "tiny-lm", "messages": [{"role": "user", "content": "w1\\ud800"}]}',
        b'{"prompt": "ka\\udfff"}',
    ):
        answer = httpx.post(
            both.url + "/tokenize",
            content=raw,
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        assert answer.status_code == 400, answer.text
    assert 'status="500"' not in both.metrics()


def test_chat_template_kwargs_reach_the_template_on_every_route(both: LiveServer) -> None:
    """The tiny model's template reads no further variable: kwargs are taken and change
    nothing; a name the rendering sets itself is a 400 (422 natively), and a translation
    model refuses the field."""
    plain = ok(both, "/tokenize", model="tiny-lm", messages=CHAT)
    kwargs = {"enable_thinking": False}
    same = ok(both, "/tokenize", model="tiny-lm", messages=CHAT, chat_template_kwargs=kwargs)
    assert same["tokens"] == plain["tokens"]
    answer = post(
        both,
        "/v1/chat/completions",
        {"model": "tiny-lm", "messages": CHAT, "max_tokens": 2, "chat_template_kwargs": kwargs},
    )
    assert answer.status_code == 200, answer.text
    for path, body, status in [
        ("/tokenize", {"model": "tiny-lm", "messages": CHAT}, 400),
        ("/v1/chat/completions", {"model": "tiny-lm", "messages": CHAT, "max_tokens": 2}, 400),
        ("/v1/generate", {"model": "tiny-lm", "messages": CHAT, "max_new_tokens": 2}, 422),
    ]:
        refused = post(both, path, {**body, "chat_template_kwargs": {"messages": []}})
        assert refused.status_code == status, refused.text
        assert "chat_template_kwargs" in refused.json()["error"]["message"]
    translation = post(both, "/v1/generate", {"text": "ka", "chat_template_kwargs": kwargs})
    assert translation.status_code == 422, translation.text
    assert translation.json()["error"]["param"] == "chat_template_kwargs"
