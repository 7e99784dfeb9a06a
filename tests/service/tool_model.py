"""Language models for the tool calling tests: a byte-level tokenizer (any text, JSON
included, can be written with it: the word-level tiny LM cannot write a brace), model
directories that use it with a chosen chat template, and a scripted backend.

The scripted backend is a deterministic stand-in for a model that can call tools: it answers
the text that follows the last `SAY«` of its prompt, up to the next `»` (so a user message or
a tool's result says what the model answers next), byte by byte, then ends its turn. Its
logits put the scripted token first and every other token far below, finitely, so a token
mask (constrained decoding) still picks among what it allows.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnserve.engine.backend import FloatArray, IntArray, ModelSpec

EOS = 2
CONTEXT = 4096  # the generic tool prompt alone is ~800 byte tokens
SCRIPT_START, SCRIPT_END = "SAY«", "»"
TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"


def byte_tokenizer(added: Sequence[str] = (), special: Sequence[str] = ()) -> Any:
    """tests/conftest.py's byte-level tokenizer (the ChatML specials at ids 0-2, then the 256
    bytes), then `added` (plain added tokens, as Qwen's `<tool_call>`) and `special` (special
    tokens, as Mistral's `[TOOL_CALLS]`)."""
    from tests.conftest import byte_tokenizer as plain_bytes

    tokenizer = plain_bytes()
    if added:
        tokenizer.add_tokens(list(added))
    if special:
        tokenizer.add_special_tokens(list(special))
    return tokenizer


def write_tool_lm(out: Path, template: str, **tokens: Sequence[str]) -> Path:
    """A tiny random Llama directory with the byte-level tokenizer and `template` (a file
    name under tests/fixtures/chat_templates)."""
    from tests.conftest import write_tiny_lm

    write_tiny_lm(out, tokenizer=byte_tokenizer(**tokens), max_positions=CONTEXT)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = (TEMPLATES / template).read_text(encoding="utf-8")
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return out


@dataclass
class _Row:
    fed: list[int]  # every token the row has seen
    prompt: int  # how many of them are the prompt


class ScriptedLM:
    """The scripted backend (module docstring) for a tool LM directory."""

    def __init__(self, directory: Path, stop_ids: Sequence[int] = ()) -> None:
        from attnserve.model.text_tokenizer import TextTokenizer

        self.tokenizer = TextTokenizer.load(directory)
        self.vocab = self.tokenizer.vocab_size
        self._spec = ModelSpec(
            vocab_size=self.vocab,
            pad_id=EOS,
            eos_id=EOS,
            start_id=1,
            max_positions=CONTEXT,
            decoder_only=True,
            stop_ids=tuple(i for i in stop_ids if i != EOS),
            banned_ids=(),
            returns_logits=True,
        )

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    def encode(self, src_ids: IntArray, src_lengths: IntArray) -> list[_Row]:
        return [
            _Row([int(t) for t in ids[:n]], int(n) + 1)
            for ids, n in zip(src_ids, src_lengths, strict=True)
        ]

    def step(self, tokens: IntArray, state: list[_Row]) -> tuple[FloatArray, list[_Row]]:
        rows = [_Row([*row.fed, int(t)], row.prompt) for row, t in zip(state, tokens, strict=True)]
        logits = np.full((len(rows), self.vocab), -20.0, dtype=np.float32)
        for i, row in enumerate(rows):
            logits[i, self._next(row)] = 20.0
        return logits, rows

    def _next(self, row: _Row) -> int:
        prompt = self.tokenizer.decode(row.fed[: row.prompt], skip_special_tokens=False)
        start = prompt.rfind(SCRIPT_START)
        script = ""
        if start >= 0:
            start += len(SCRIPT_START)
            end = prompt.find(SCRIPT_END, start)
            script = prompt[start : end if end >= 0 else len(prompt)]
        ids = self.tokenizer.encode(script, add_special_tokens=False)
        done = len(row.fed) - row.prompt
        return ids[done] if done < len(ids) else EOS

    def select(self, state: list[_Row], rows: IntArray) -> list[_Row]:
        return [state[int(r)] for r in rows]

    def concat(self, states: Sequence[list[_Row]]) -> list[_Row]:
        return [row for state in states for row in state]


def scripted_factory(directory: Path, settings: Any, stop_ids: Sequence[int] = ()) -> ScriptedLM:
    return ScriptedLM(directory, stop_ids)


def say(text: str) -> str:
    """A message that makes the scripted model answer `text`."""
    return f"{SCRIPT_START}{text}{SCRIPT_END}"
