"""Tool calls in a language model's answer: the syntaxes models write them in, and one parser
that reads them from the answer's text as it streams (a whole answer is one delta).

Syntaxes (vLLM's `--tool-call-parser` names):

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one call per tag, several
  tags in a row for parallel calls, text before them (Qwen2.5, Hermes 2 Pro, and attnserve's
  generic tool prompt, service/tool_prompt.py);
- `llama3_json`: the answer is `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` or
  at its very start), several separated by `;` (Llama 3.1 and 3.2);
- `mistral`: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` after optional text
  (Mistral v0.3's tokenizer).

Either key, `arguments` or `parameters`, is read in every syntax. A call's `arguments` is the
JSON text the model wrote for them (so a stream's fragments concatenate to exactly the string
of the answer that was not streamed); arguments written as a JSON string holding an object are
that string.

The parser is a state machine over characters: text outside calls is content (whitespace next
to calls dropped; a tail that may be the start of a call marker is held back until the next
text rules that out), and inside a call region a small JSON scanner finds where the `name` and
`arguments` values of each call object lie, so that a call's name goes out as soon as it is
complete and its arguments as they grow. A region that turns out not to be calls (not JSON, no
name) ends parsing there: its text and everything after it is content. `parse_tool_calls` is
stricter, as vLLM is for a whole answer: any broken call and the whole answer is content.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class ToolSyntax:
    """How a model family writes tool calls."""

    name: str
    start: tuple[str, ...]  # markers that open a region of calls
    end: str | None = None  # the marker that closes a call (one object per region)
    leading_json: bool = False  # an answer starting with `{` is a region of calls
    array: bool = False  # the calls of a region are a JSON list (a bare object is read too)
    separator: str | None = None  # between the objects of a region
    arguments_key: str = "arguments"  # the key the model writes (grammars use it)
    id_length: int | None = None  # tool call ids the template checks (Mistral: 9 characters)

    @property
    def markers(self) -> tuple[str, ...]:
        return (*self.start, *((self.end,) if self.end else ()))


HERMES = ToolSyntax("hermes", start=("<tool_call>",), end="</tool_call>")
LLAMA3_JSON = ToolSyntax(
    "llama3_json",
    start=("<|python_tag|>",),
    leading_json=True,
    separator=";",
    arguments_key="parameters",
)
MISTRAL = ToolSyntax("mistral", start=("[TOOL_CALLS]",), array=True, id_length=9)
SYNTAXES = {s.name: s for s in (HERMES, LLAMA3_JSON, MISTRAL)}


def detect_syntax(template: str | None) -> ToolSyntax:
    """The syntax a chat template writes past tool calls in (its markers), Hermes by default
    (attnserve's generic tool prompt asks for it)."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return MISTRAL
    if "<tool_call>" in text:
        return HERMES
    if "<|python_tag|>" in text or re.search(r"[\"']parameters[\"']\s*:", text):
        return LLAMA3_JSON
    return HERMES


def new_call_id(syntax: ToolSyntax) -> str:
    """A fresh tool call id: `call_` and 24 random characters (OpenAI's shape), or the
    length the syntax's template checks."""
    alphabet = string.ascii_letters + string.digits
    if syntax.id_length is not None:
        return "".join(secrets.choice(alphabet) for _ in range(syntax.id_length))
    return "call_" + "".join(secrets.choice(alphabet) for _ in range(24))


@dataclass(frozen=True)
class CallStart:
    """A call's first event: its index among the answer's calls, id and name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    """More of a call's arguments (JSON text)."""

    index: int
    text: str


Event = str | CallStart | ArgumentsDelta  # a str: content


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False


class _Object:
    """One JSON object read a character at a time: where each of its keys' values lies
    (offsets into `text`; the end is None while the value is still being read)."""

    def __init__(self) -> None:
        self.text = ""
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.state = "open"  # open, key, key_string, colon, value, in_value, comma
        self.kind = ""  # of the value being read: string, container, primitive
        self.key = ""
        self.key_start = 0
        self.spans: dict[str, list[Any]] = {}  # key -> [start, end | None, kind]
        self.done = False
        self.error = False

    def feed(self, chunk: str) -> int:
        """Read characters of `chunk` until the object closes; how many were read."""
        for n, c in enumerate(chunk):
            self._char(c, len(self.text))
            self.text += c
            if self.error or self.done:
                return n + 1
        return len(chunk)

    def _end_value(self, end: int) -> None:
        self.spans[self.key][1] = end
        self.state = "comma"

    def _char(self, c: str, pos: int) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if self.depth == 1 and self.state == "key_string":
                    try:
                        self.key = json.loads(self.text[self.key_start :] + c)
                    except ValueError:
                        self.error = True
                    self.state = "colon"
                elif self.depth == 1 and self.state == "in_value" and self.kind == "string":
                    self._end_value(pos + 1)
            return
        if self.state == "open":
            if c == "{":
                self.depth, self.state = 1, "key"
            elif c not in _WHITESPACE:
                self.error = True
            return
        top = self.depth == 1
        if top and self.state == "in_value" and self.kind == "primitive":
            if c in _WHITESPACE or c in ",}":
                self._end_value(pos)
            else:
                return
        if c in _WHITESPACE:
            return
        if c == '"':
            self.in_string = True
            if top and self.state == "key":
                self.key_start, self.state = pos, "key_string"
            elif top and self.state == "value":
                self.spans[self.key] = [pos, None, "string"]
                self.state, self.kind = "in_value", "string"
            elif top:
                self.error = True
        elif c in "{[":
            if top and self.state == "value":
                self.spans[self.key] = [pos, None, "container"]
                self.state, self.kind = "in_value", "container"
            elif top:
                self.error = True
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 1 and self.state == "in_value":
                self._end_value(pos + 1)
            elif self.depth == 0:
                self.done = True
                self.error = c != "}" or self.state not in ("comma", "key")
        elif top and c == ":":
            self.error = self.state != "colon"
            self.state = "value"
        elif top and c == ",":
            self.error = self.state != "comma"
            self.state = "key"
        elif top and self.state == "value":
            self.spans[self.key] = [pos, None, "primitive"]
            self.state, self.kind = "in_value", "primitive"
        elif top:
            self.error = True

    def value(self, key: str) -> tuple[int, int | None, str] | None:
        span = self.spans.get(key)
        return None if span is None else (span[0], span[1], span[2])


class ToolCallParser:
    """Content and tool calls from an answer's text, fed as it grows."""

    def __init__(
        self,
        syntax: ToolSyntax,
        new_id: Callable[[], str] | None = None,
        max_calls: int | None = None,
    ) -> None:
        self.syntax = syntax
        self.new_id = new_id or (lambda: new_call_id(syntax))
        self.max_calls = max_calls  # further calls are dropped (parallel_tool_calls false)
        self.calls: list[ParsedCall] = []
        self.content = ""
        self.failed = False  # a region was not calls: parsing stopped there
        self._buffer = ""  # text read but not yet parsed into events
        self._held = ""  # whitespace held back (content unless calls follow)
        self._mode = "text"  # text, region, plain
        self._region = ""  # the current region's text not yet part of an emitted call
        self._step = "before"  # in a region: before (an object), object, after
        self._opened = False  # the region's list has opened (`[`)
        self._object: _Object | None = None
        self._current: ParsedCall | None = None
        self._streamed = 0  # characters of the current call's arguments sent
        self._leading = syntax.leading_json  # nothing but whitespace read yet
        self._after_calls = False  # whitespace starting the next content is dropped
        self._region_calls = 0  # calls completed in the current region
        self._events: list[Event] = []

    # -- input -------------------------------------------------------------------------------

    def feed(self, text: str) -> list[Event]:
        """The events that `text`, appended to the answer, makes certain."""
        self._buffer += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        """The events left at the end of the answer (a call cut short stays as it is; a
        region's missing end marker or closing bracket is forgiven)."""
        self._run(final=True)
        if self._mode == "region" and self._current is None:
            if self._step == "object" or not self._region_calls:
                self._fail()  # a region with no whole call in it
                self._run(final=True)
            else:
                self._end_region()
        if self._held and not self.calls:
            self._content(self._held)
        self._held = ""
        return self._take()

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _run(self, final: bool) -> None:
        while self._buffer:
            before = (self._mode, self._step, len(self._buffer))
            if self._mode == "plain":
                self._content(self._held + self._buffer)
                self._held = self._buffer = ""
            elif self._mode == "text":
                self._text(final)
            else:
                self._region_step(final)
            if (self._mode, self._step, len(self._buffer)) == before:
                return  # waiting for more text

    # -- content -----------------------------------------------------------------------------

    def _content(self, text: str) -> None:
        if text:
            self.content += text
            self._events.append(text)

    def _text(self, final: bool) -> None:
        buffer = self._buffer
        if self._leading:
            stripped = buffer.lstrip(_WHITESPACE)
            if not stripped:
                if final:
                    self._held += buffer
                    self._buffer = ""
                return
            self._leading = False
            if stripped.startswith("{") and self._open_allowed():
                self._buffer = stripped
                self._start_region(buffer[: len(buffer) - len(stripped)])
                return
        found = [(buffer.find(m), m) for m in self.syntax.start if m in buffer]
        if found:
            at, marker = min(found)
            self._emit_text(buffer[:at], before_call=True)
            self._buffer = buffer[at + len(marker) :]
            self._start_region(marker)
            return
        hold = _partial_marker(buffer, self.syntax.start)
        if final:  # the start of a marker that never came: text, or after calls the next
            hold = hold if self.calls else 0  # call cut short (dropped)
            self._emit_text(buffer[: len(buffer) - hold], before_call=False)
            self._buffer = ""
            return
        self._emit_text(buffer[: len(buffer) - hold], before_call=False)
        self._buffer = buffer[len(buffer) - hold :]

    def _emit_text(self, text: str, before_call: bool) -> None:
        """Content, holding back trailing whitespace (dropped if a call follows) and leaving
        out whitespace between calls."""
        text = self._held + text
        if self._after_calls:
            text = text.lstrip(_WHITESPACE)
            self._after_calls = not text
        body = text.rstrip(_WHITESPACE)
        self._held = "" if before_call else text[len(body) :]
        self._content(body)

    def _open_allowed(self) -> bool:
        return self.max_calls is None or len(self.calls) < self.max_calls

    # -- regions of calls --------------------------------------------------------------------

    def _start_region(self, marker: str) -> None:
        self._mode, self._step, self._region, self._opened = "region", "before", marker, False
        self._region_calls = 0

    def _end_region(self) -> None:
        self._mode, self._region = "text", ""
        self._after_calls = bool(self.calls)

    def _fail(self) -> None:
        """The region is not calls: its text not part of an emitted call, and everything
        after it, is content."""
        self.failed = True
        if self._current is None or self._current.complete:
            self._content(self._region)
        self._held, self._region, self._mode = "", "", "plain"
        self._current = None

    def _consume(self, n: int) -> None:
        self._region += self._buffer[:n]
        self._buffer = self._buffer[n:]

    def _region_step(self, final: bool) -> None:
        if self._step == "object":
            self._object_step()
            return
        self._consume(len(self._buffer) - len(self._buffer.lstrip(_WHITESPACE)))
        if not self._buffer:
            return
        c = self._buffer[0]
        if self._step == "before":
            if self.syntax.array and not self._opened and c == "[":
                self._opened = True
                self._consume(1)
            elif c == "{":
                self._step, self._object, self._streamed = "object", _Object(), 0
            else:
                self._fail()
            return
        # after an object
        syntax = self.syntax
        if syntax.end is not None:
            if self._buffer.startswith(syntax.end):
                self._consume(len(syntax.end))
                self._end_region()
            elif syntax.end.startswith(self._buffer) and not final:
                return  # maybe the end marker, still arriving
            else:
                self._end_region()  # no end marker: the call ends here anyway
        elif self._opened and c in ",]":
            self._consume(1)
            if c == "]":
                self._end_region()
            else:
                self._step = "before"
        elif syntax.separator is not None and c == syntax.separator:
            self._consume(1)
            self._step = "before"
        elif syntax.leading_json and c == "{":
            self._step = "before"
        else:
            self._end_region() if not self._opened else self._fail()

    def _object_step(self) -> None:
        obj = self._object
        assert obj is not None
        n = obj.feed(self._buffer)
        self._consume(n)
        if obj.error:
            self._fail()
            return
        self._stream_call(obj)
        if obj.done:
            self._complete_call(obj)

    def _stream_call(self, obj: _Object) -> None:
        """The call's name once it is whole, then its arguments as they grow."""
        if self._current is None:
            span = obj.value("name")
            if span is None or span[1] is None or span[2] != "string":
                return
            try:
                name = json.loads(obj.text[span[0] : span[1]])
            except ValueError:  # an escape JSON does not have
                return
            if not name or not self._open_allowed():
                return
            self._current = ParsedCall(self.new_id(), name)
            self.calls.append(self._current)
            self._region = ""
            self._events.append(CallStart(len(self.calls) - 1, self._current.id, name))
        args = next((obj.value(k) for k in ARGUMENT_KEYS if obj.value(k)), None)
        if args is not None and args[2] == "container":
            end = len(obj.text) if args[1] is None else args[1]
            self._arguments(obj.text[args[0] : end])

    def _arguments(self, text: str) -> None:
        call = self._current
        assert call is not None
        if len(text) > self._streamed and text.startswith(call.arguments):
            delta = text[self._streamed :]
            call.arguments, self._streamed = text, len(text)
            self._events.append(ArgumentsDelta(len(self.calls) - 1, delta))

    def _complete_call(self, obj: _Object) -> None:
        arguments = _arguments_of(obj)
        if arguments is None:
            self._fail()
            return
        if self._current is None:
            if not self._open_allowed():  # a call past max_calls: dropped
                self._region, self._step, self._object = "", "after", None
                return
            self._stream_call(obj)  # the name came after the arguments
            if self._current is None:
                self._fail()
                return
        self._arguments(arguments)
        self._current.complete = True
        self._region_calls += 1
        self._current, self._object, self._step, self._region = None, None, "after", ""


def _arguments_of(obj: _Object) -> str | None:
    """A finished call object's arguments as JSON text: the object the model wrote, the
    object a JSON string held, `{}` when it wrote none; None when the object is not a call
    (no name) or its arguments are not an object."""
    try:
        call = json.loads(obj.text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    key = next((k for k in ARGUMENT_KEYS if k in call), None)
    if key is None:
        return "{}"
    value = call[key]
    span = obj.value(key)
    if isinstance(value, dict) and span is not None and span[1] is not None:
        return obj.text[span[0] : span[1]]
    if isinstance(value, str):
        try:
            inner = json.loads(value)
        except ValueError:
            return None
        return value if isinstance(inner, dict) else None
    return None


def _partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest tail of `text` that a marker starts with."""
    hold = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), hold, -1):
            if text.endswith(marker[:k]):
                hold = k
                break
    return hold


@dataclass
class ParsedAnswer:
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


def parse_tool_calls(
    text: str,
    syntax: ToolSyntax,
    new_id: Callable[[], str] | None = None,
    max_calls: int | None = None,
) -> ParsedAnswer:
    """A whole answer's content (None: only calls) and calls; an answer with any call that
    does not parse (or was cut short) is all content, no calls."""
    parser = ToolCallParser(syntax, new_id, max_calls)
    parser.feed(text)
    parser.finish()
    if parser.failed or not parser.calls or not all(c.complete for c in parser.calls):
        return ParsedAnswer(text)
    return ParsedAnswer(parser.content or None, parser.calls)
