"""A thinking model's reasoning, apart from its answer: `<think>...</think>` -> reasoning_content.

Qwen3, QwQ and DeepSeek-R1 (and their distillations) write their reasoning between `<think>` and
`</think>` before the answer. As vLLM's reasoning parsers do, the chat API answers that text in
`message.reasoning_content` (`delta.reasoning_content` when streamed) and the rest in `content`.

One syntax covers these families; what differs is who opens the block. Qwen3's template leaves it
to the model (the answer starts with `<think>`), DeepSeek-R1's and Qwen3's thinking-only models
end the prompt with `<think>` (the answer starts inside it), and Qwen3 with `enable_thinking:
false` ends the prompt with an empty `<think>\\n\\n</think>` (the answer is all content). So the
parser starts inside the block when the prompt's last tag is an open `<think>`, and otherwise
takes a block only at the very start of the answer (after white space): a `<think>` later in the
text is content. A block that never closes (the answer ran out of tokens) is all reasoning, and
the content is then null. White space around the reasoning and before the content is dropped, as
Qwen3's template drops it when it renders an answer back into the history.

`ThinkSplitter` is incremental (streaming holds back only what may be the start of a tag); the
whole-answer `split` feeds it once, so streamed and whole answers are the same text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

START = "<think>"
END = "</think>"
# How many prompt tokens `opened_by_prompt` reads back: enough for "<think>\n\n</think>\n\n".
PROMPT_TAIL_TOKENS = 32
ReasoningParser = Literal["auto", "none", "qwen3", "deepseek_r1"]

Part = tuple[Literal["reasoning", "content"], str]


def model_thinks(chat_template: str | None, token_to_id: Callable[[str], int | None]) -> bool:
    """Whether a model writes `<think>` blocks: its template mentions them and its vocabulary has
    both tags as tokens of their own (so that "auto" never fires on a model that only might
    spell them)."""
    if not chat_template or START not in chat_template:
        return False
    return token_to_id(START) is not None and token_to_id(END) is not None


def opened_by_prompt(prompt_tail: str) -> bool:
    """Whether the prompt (its last tokens' text) leaves a `<think>` block open for the answer."""
    start, end = prompt_tail.rfind(START), prompt_tail.rfind(END)
    return start >= 0 and start > end


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ThinkSplitter:
    """Feed the answer's text as it grows; each call returns the parts it can already tell
    apart. `finish()` returns what was held back."""

    inside: bool = False  # in the reasoning block (opened by the prompt, or by the answer)
    _state: Literal["start", "reasoning", "after", "content"] = field(init=False)
    _held: str = field(default="", init=False)
    _reasoned: bool = field(default=False, init=False)  # some reasoning text was emitted
    saw_reasoning: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self._state = "reasoning" if self.inside else "start"
        self.saw_reasoning = self.inside

    def feed(self, text: str) -> list[Part]:
        self._held += text
        parts: list[Part] = []
        while True:
            if self._state == "start":
                head = self._held.lstrip()
                if START.startswith(head):  # nothing yet, or a tag under way
                    return parts
                if not head.startswith(START):
                    self._state = "content"  # no block: the answer is content, as written
                    continue
                self._held = head[len(START) :]
                self._state, self.saw_reasoning = "reasoning", True
            elif self._state == "reasoning":
                end = self._held.find(END)
                if end < 0:
                    keep = _partial_suffix(self._held, END)
                    body = self._held[: len(self._held) - keep]
                    # trailing white space may turn out to precede the end tag: held too
                    stripped = body.rstrip()
                    self._reason(stripped, parts)
                    self._held = self._held[len(stripped) :]
                    return parts
                self._reason(self._held[:end].rstrip(), parts)
                self._held = self._held[end + len(END) :]
                self._state = "after"
            elif self._state == "after":
                self._held = self._held.lstrip()
                if not self._held:
                    return parts
                self._state = "content"
            else:
                if self._held:
                    parts.append(("content", self._held))
                self._held = ""
                return parts

    def _reason(self, text: str, parts: list[Part]) -> None:
        if not self._reasoned:
            text = text.lstrip()
        if text:
            parts.append(("reasoning", text))
            self._reasoned = True

    def finish(self) -> list[Part]:
        held, self._held = self._held, ""
        if self._state == "start" and held:
            return [("content", held)]
        if self._state == "reasoning":
            parts: list[Part] = []
            self._reason(held.rstrip(), parts)
            return parts
        return []


def split(text: str, *, inside: bool = False) -> tuple[str | None, str | None]:
    """A whole answer -> (reasoning, content). reasoning is None when the answer has no block;
    content is None when a block took the whole answer."""
    splitter = ThinkSplitter(inside=inside)
    parts = splitter.feed(text) + splitter.finish()
    reasoning = "".join(t for kind, t in parts if kind == "reasoning")
    content = "".join(t for kind, t in parts if kind == "content")
    if not splitter.saw_reasoning:
        return None, content
    return reasoning, content or None
