"""`attnserve bench-lm --http --conversations`: users behind one long system prompt, several
turns each, through streaming chat: what prompt reuse (engine/prefix_cache.py) buys.

Each of `users` clients holds a conversation of `turns` turns behind the same system prompt of
about `system_tokens` tokens (`system_prompt`: a support desk's instructions, written out until
the model's tokenizer counts that many tokens): every turn sends the whole history (system
prompt, earlier questions and the server's own answers) and a new question, streamed, greedy,
`max_tokens` each. The users start together; a user's next turn is sent when its answer ends.
Servers, one at a time (module `lm_http`'s commands): ``attnserve`` (the prefix cache on, as by
default), ``attnserve-no-cache`` (`--prefix-cache-bytes 0`) and ``llama-server`` (llama.cpp's
server on the model's GGUF source, `cache_prompt` on, one slot per user). One conversation is
held first as a warm-up (it also leaves the system prompt in a cache that keeps it).

Reported per server: time to first token (sending to the first content chunk) p50 / p90 over all
turns, p50 of the first turns and of the later ones, completion tokens/s over the run (all
users' tokens / wall time from the first request to the last answer), the prompt tokens sent and
those the server reports cached (`usage.prompt_tokens_details.cached_tokens`, where it does).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnserve.bench.lm_http import _stream, running, server_command
from attnserve.defaults import DEFAULT_VARIANT
from attnserve.loadtest.runner import free_port

log = logging.getLogger(__name__)

SERVERS = ("attnserve", "attnserve-no-cache", "llama-server")
# llama-server: each user's slot holds its whole conversation.
SLOT_CONTEXT = 2048
INSTRUCTIONS = (
    "You are the support assistant of Northwind Outfitters, a shop for hiking and camping gear.",
    "Answer in a friendly, short and precise way, in the customer's language.",
    "Orders ship from the warehouse in Leipzig within two working days of payment.",
    "Standard delivery in Germany takes one to three days and costs 4.90 euros.",
    "Orders over 60 euros ship free of charge within Germany.",
    "Delivery to Austria and Switzerland takes three to five days and costs 9.90 euros.",
    "Customers may return unworn items within 30 days for a full refund.",
    "Returns are free with the prepaid label in the parcel; refunds take five working days.",
    "Boots that were worn outdoors can be returned only if they have a manufacturing defect.",
    "Tents come with a two-year warranty against seam and zip failures.",
    "Sleeping bags are rated by comfort temperature; recommend a rating five degrees below "
    "the coldest night expected.",
    "Never promise delivery dates that the tracking page does not show.",
    "If a parcel is late by more than five days, offer to open a carrier investigation.",
    "Gift cards are valid for three years and cannot be exchanged for cash.",
    "The loyalty programme gives one point per euro; 100 points are worth five euros.",
    "Price matching applies to identical items sold by authorised dealers in Germany.",
    "Do not give medical advice; for altitude sickness or injuries, refer to a doctor.",
    "For rentals, the deposit is 50 euros per item and is refunded when the item comes back.",
    "Rented tents must be returned dry; a cleaning fee of 15 euros applies otherwise.",
    "Store opening hours are Monday to Saturday, 9:00 to 19:00.",
    "The repair service fixes zips, seams and buckles; quotes are free.",
    "Always ask for the order number before discussing a specific order.",
    "Payment methods are card, PayPal, invoice and bank transfer.",
    "Invoices are payable within 14 days; reminders are sent after 21 days.",
)
QUESTIONS = (
    "How long does delivery to Munich take?",
    "Can I return boots I wore once on a trail?",
    "What sleeping bag do I need for nights at minus two degrees?",
    "My parcel is a week late. What can you do?",
    "Do you match a lower price I found online?",
    "How much is the deposit for renting a tent?",
    "When is the store open on Saturday?",
    "Can you repair a broken zip on my jacket?",
    "Which payment methods do you accept?",
    "How many points do I get for a 120 euro order?",
    "Is delivery to Vienna free?",
    "How long is the warranty on a tent?",
)


def system_prompt(tokenizer: Any, tokens: int) -> str:
    """The support desk's instructions, repeated in numbered sections until `tokenizer` counts
    at least `tokens` tokens."""
    parts: list[str] = []
    section = 0
    while len(tokenizer.encode(" ".join(parts))) < tokens:
        section += 1
        parts.append(f"Section {section}.")
        for line in INSTRUCTIONS:
            parts.append(line)
            if len(tokenizer.encode(" ".join(parts))) >= tokens:
                break
    return " ".join(parts)


@dataclass(frozen=True)
class Turn:
    user: int
    turn: int
    ttft: float  # seconds from sending to the first content chunk
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int | None


@dataclass(frozen=True)
class ConversationResult:
    server: str
    users: int
    turns: int
    seconds: float
    tokens_per_second: float
    ttft_p50: float
    ttft_p90: float
    first_turn_p50: float
    later_turns_p50: float
    prompt_tokens: int
    cached_tokens: int | None


async def _turn(http: Any, url: str, body: dict[str, Any]) -> tuple[str, float, dict[str, Any]]:
    """One streamed chat turn: the answer, its time to first content chunk, its usage."""
    sent = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with _stream(http, url + "/v1/chat/completions", body) as response:
        if response.status_code != 200:
            error = (await response.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {response.status_code}: {error[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            data = json.loads(line[5:])
            if data.get("error"):  # an error event mid-stream (a deadline: 504)
                raise RuntimeError(f"stream error: {json.dumps(data['error'])[:300]}")
            usage = data.get("usage") or usage
            choices = data.get("choices") or []
            content = (choices[0].get("delta") or {}).get("content") if choices else None
            if content:
                first = first if first is not None else time.perf_counter() - sent
                text.append(content)
    return "".join(text), first if first is not None else time.perf_counter() - sent, usage


async def conversations(
    url: str,
    model: str,
    system: str,
    users: int,
    turns: int,
    max_tokens: int,
    extra: dict[str, Any] | None = None,
) -> tuple[list[Turn], float]:
    """Every user's conversation, concurrently; the turns and the wall time. `extra`: more
    request fields (llama-server's `cache_prompt`)."""
    import httpx

    results: list[Turn] = []

    async def user(http: httpx.AsyncClient, index: int) -> None:
        messages = [{"role": "system", "content": system}]
        for turn in range(turns):
            question = QUESTIONS[(index + turn * 5) % len(QUESTIONS)]
            messages.append({"role": "user", "content": f"(customer {index + 1}) {question}"})
            body = {
                "model": model,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
                **(extra or {}),
            }
            answer, ttft, usage = await _turn(http, url, body)
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens")
            results.append(
                Turn(
                    index,
                    turn,
                    ttft,
                    int(usage.get("completion_tokens", 0)),
                    int(usage.get("prompt_tokens", 0)),
                    None if cached is None else int(cached),
                )
            )
            messages.append({"role": "assistant", "content": answer})

    limits = httpx.Limits(max_connections=users, max_keepalive_connections=users)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        started = time.perf_counter()
        await asyncio.gather(*(user(http, i) for i in range(users)))
        return results, time.perf_counter() - started


def summarize(server: str, users: int, turns: int, results: Sequence[Turn],
              seconds: float) -> ConversationResult:  # fmt: skip
    ttft = np.array([t.ttft for t in results])
    first = [t.ttft for t in results if t.turn == 0]
    later = [t.ttft for t in results if t.turn > 0]
    reported = [t.cached_tokens for t in results if t.cached_tokens is not None]
    return ConversationResult(
        server=server,
        users=users,
        turns=turns,
        seconds=seconds,
        tokens_per_second=sum(t.completion_tokens for t in results) / seconds,
        ttft_p50=float(np.percentile(ttft, 50)),
        ttft_p90=float(np.percentile(ttft, 90)),
        first_turn_p50=float(np.percentile(first, 50)) if first else float("nan"),
        later_turns_p50=float(np.percentile(later, 50)) if later else float("nan"),
        prompt_tokens=sum(t.prompt_tokens for t in results),
        cached_tokens=sum(reported) if reported else None,
    )


def command(server: str, model_dir: Path, port: int, threads: int, users: int,
            server_bin: Path | None, variant: str) -> list[str]:  # fmt: skip
    base = "attnserve" if server.startswith("attnserve") else server
    cmd = server_command(base, model_dir, port, threads, users, server_bin, variant)
    if base == "attnserve":  # a turn waits as long as it takes: no deadline cuts it short
        cmd += ["--default-timeout-ms", "600000", "--max-timeout-ms", "600000"]
    if server == "attnserve-no-cache":
        cmd += ["--prefix-cache-bytes", "0"]
    if server == "llama-server":  # the conversations' context, not the chat bench's
        cmd[cmd.index("-c") + 1] = str(users * SLOT_CONTEXT)
    return cmd


def bench_conversations(
    model_dir: str | Path,
    servers: Sequence[str],
    *,
    users: int = 16,
    turns: int = 4,
    system_tokens: int = 1000,
    max_tokens: int = 48,
    threads: int = 1,
    server_bin: Path | None = None,
    variant: str = DEFAULT_VARIANT,
    work_dir: Path,
    ready_timeout: float = 600.0,
) -> list[ConversationResult]:
    from attnserve.model.text_tokenizer import TextTokenizer

    model_dir = Path(model_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    system = system_prompt(TextTokenizer.load(model_dir), system_tokens)
    results = []
    for server in servers:
        if server not in SERVERS:
            raise ValueError(f"unknown server {server!r}; choose from {', '.join(SERVERS)}")
        port = free_port()
        cmd = command(server, model_dir, port, threads, users, server_bin, variant)
        log.info("starting %s: %s", server, " ".join(cmd))
        extra = {"cache_prompt": True} if server == "llama-server" else None
        with running(cmd, port, work_dir / f"{server}-conversations.log", ready_timeout) as url:
            asyncio.run(conversations(url, model_dir.name, system, 1, 2, 8, extra))  # warm-up
            turns_done, seconds = asyncio.run(
                conversations(url, model_dir.name, system, users, turns, max_tokens, extra)
            )
        result = summarize(server, users, turns, turns_done, seconds)
        log.info("%s", json.dumps(asdict(result)))
        results.append(result)
    return results


def conversations_markdown(results: Sequence[ConversationResult]) -> str:
    lines = [
        "| server | TTFT p50 s | p90 s | first turns p50 s | later turns p50 s | x first server "
        "(p50) | completion tokens/s | prompt tokens | cached |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = results[0].ttft_p50 if results else float("nan")
    for r in results:
        cached = "-" if r.cached_tokens is None else f"{r.cached_tokens:,}"
        lines.append(
            f"| {r.server} | {r.ttft_p50:.3f} | {r.ttft_p90:.3f} | {r.first_turn_p50:.3f} | "
            f"{r.later_turns_p50:.3f} | {r.ttft_p50 / base:.2f} | {r.tokens_per_second:.1f} | "
            f"{r.prompt_tokens:,} | {cached} |"
        )
    return "\n".join(lines) + "\n"


def write_conversations_report(
    results: Sequence[ConversationResult], output_dir: Path, name: str
) -> Path:
    from attnserve.bench.report import write_table

    rows = [asdict(r) for r in results]
    write_table(output_dir, name, rows, conversations_markdown(results))
    return output_dir / f"{name}.md"
