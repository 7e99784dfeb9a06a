"""The conversations bench (`bench-lm --http --conversations`) against a real server with the
tiny language model: histories grow turn by turn, the server's cached tokens are read back, and
the report has a row per server."""

from __future__ import annotations

import asyncio
from pathlib import Path

from attnserve.bench.lm_conversations import (
    command,
    conversations,
    conversations_markdown,
    summarize,
    system_prompt,
)
from attnserve.model.text_tokenizer import TextTokenizer
from tests.service.conftest import lm_model  # noqa: F401 (the served tiny language model)
from tests.service.helpers import LiveServer, make_settings


def test_the_system_prompt_has_the_tokens_asked(lm_model: Path) -> None:  # noqa: F811
    tokenizer = TextTokenizer.load(lm_model)
    for tokens in (30, 200):
        text = system_prompt(tokenizer, tokens)
        assert tokens <= len(tokenizer.encode(text)) < tokens + 40


def test_conversations_against_a_server(lm_model: Path) -> None:  # noqa: F811
    system = " ".join(f"w{i % 60}" for i in range(40))  # the tiny model's words
    with LiveServer(make_settings(lm_model, variant="int8", prefix_block=8)) as server:
        turns, seconds = asyncio.run(conversations(server.url, "tiny-lm", system, 2, 3, 4))
    assert len(turns) == 6 and seconds > 0
    for user in (0, 1):
        mine = sorted((t for t in turns if t.user == user), key=lambda t: t.turn)
        prompts = [t.prompt_tokens for t in mine]
        assert prompts == sorted(prompts) and prompts[0] < prompts[-1]  # histories grow
        assert all(t.cached_tokens is not None for t in mine)
        assert (mine[-1].cached_tokens or 0) >= 40  # the system prompt and more, reused
    result = summarize("attnserve", 2, 3, turns, seconds)
    assert result.cached_tokens and result.cached_tokens < result.prompt_tokens
    assert "| attnserve |" in conversations_markdown([result])


def test_the_servers_commands(lm_model: Path) -> None:  # noqa: F811
    cached = command("attnserve", lm_model, 8000, 1, 16, None, "int8")
    plain = command("attnserve-no-cache", lm_model, 8000, 1, 16, None, "int8")
    assert plain == [*cached, "--prefix-cache-bytes", "0"]
    assert "--default-timeout-ms" in cached
