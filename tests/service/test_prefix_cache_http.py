"""Prompt reuse over HTTP: a real server (the tiny language model, int8, GroupQueryAttention)
with the prefix cache and one without, through the `openai` client. Turns of a conversation and
users behind one system prompt answer exactly as without the cache, report their cached tokens
as OpenAI does (`usage.prompt_tokens_details.cached_tokens`), `cache_salt` keeps tenants apart,
and the pool's counters reach /metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.service.helpers import LiveServer, make_settings, metric_value

SYSTEM = " ".join(f"w{i % 60}" for i in range(7, 7 + 50))  # 50 words: several blocks


@pytest.fixture(scope="module")
def servers(lm_model: Path) -> Iterator[tuple[LiveServer, LiveServer]]:
    cached = make_settings(lm_model, variant="int8", prefix_block=8)
    plain = make_settings(lm_model, variant="int8", prefix_cache_bytes=0)
    with LiveServer(cached) as with_cache, LiveServer(plain) as without:
        yield with_cache, without


def chat(server: LiveServer, messages: list[dict[str, str]], **extra: Any) -> Any:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60.0)
    return client.chat.completions.create(
        model="tiny-lm",
        messages=messages,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=8,
        extra_body=extra or None,
    )


def cached_tokens(answer: Any) -> int:
    details = answer.usage.prompt_tokens_details
    return 0 if details is None else int(details.cached_tokens or 0)


def test_turns_and_users_answer_as_without_the_cache(
    servers: tuple[LiveServer, LiveServer],
) -> None:
    with_cache, without = servers
    system = {"role": "system", "content": SYSTEM}
    history: list[dict[str, str]] = [system]
    for turn in range(4):
        history.append({"role": "user", "content": f"w{turn} w{turn + 1} w{turn + 2}"})
        got, expected = chat(with_cache, history), chat(without, history)
        assert got.choices[0].message.content == expected.choices[0].message.content
        assert cached_tokens(expected) == 0
        if turn:  # the history before this turn's question was prefilled by the last turn
            assert cached_tokens(got) >= 48
        history.append({"role": "assistant", "content": got.choices[0].message.content or ""})
    for user in range(3):  # new users behind the same system prompt
        messages = [system, {"role": "user", "content": f"w{40 + user}"}]
        got = chat(with_cache, messages)
        assert cached_tokens(got) >= 48
        assert got.choices[0].message.content == chat(without, messages).choices[0].message.content


def test_salts_keep_tenants_apart(servers: tuple[LiveServer, LiveServer]) -> None:
    with_cache, _ = servers
    other = " ".join(f"w{i * 7 % 60}" for i in range(50))  # a system prompt no test sent
    messages = [{"role": "system", "content": other}, {"role": "user", "content": "w2"}]
    assert cached_tokens(chat(with_cache, messages, cache_salt="a")) == 0
    assert cached_tokens(chat(with_cache, messages, cache_salt="b")) == 0
    assert cached_tokens(chat(with_cache, messages, cache_salt="a")) >= 48
    assert cached_tokens(chat(with_cache, messages)) == 0  # no salt is a salt of its own
    bad = httpx.post(
        with_cache.url + "/v1/chat/completions",
        json={"model": "tiny-lm", "messages": messages, "cache_salt": ""},
        timeout=30,
    )
    assert bad.status_code == 400 and "cache_salt" in bad.text


def test_counters_reach_metrics(servers: tuple[LiveServer, LiveServer]) -> None:
    with_cache, without = servers
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "w9 w9"}]
    chat(with_cache, messages)
    chat(with_cache, messages)
    text = with_cache.metrics()
    queries = metric_value(text, "attnserve_prefix_cache_queries_total", model="tiny-lm")
    hits = metric_value(text, "attnserve_prefix_cache_hits_total", model="tiny-lm")
    assert 0 < hits < queries
    assert (metric_value(text, "attnserve_prefix_cache_bytes", model="tiny-lm") or 0) > 0
    assert metric_value(text, "attnserve_prefix_cache_capacity_bytes", model="tiny-lm") == 256 << 20
    # a server without the cache declares the metrics with no samples
    assert "attnserve_prefix_cache_queries_total{" not in without.metrics()
