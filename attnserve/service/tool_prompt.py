"""attnserve's generic tool prompt, for a chat template without a tools section (SmolLM2's
has none): the tools and how to call them in a system message, and the chat's tool calls and
results as plain messages any template renders.

The format is Hermes' (Qwen2.5 and Hermes 2 Pro write it; small instruction-tuned models have
seen it): the tools as JSON between `<tools>` and `</tools>`, each call a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, and tool results
between `<tool_response>` and `</tool_response>`. The section is appended to the first system
message (or is one, placed first). A past assistant turn's calls become its text, in the same
syntax; tool results become a user message (consecutive results share one), since a template
without tools may refuse a `tool` role or enforce alternating user and assistant turns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

INSTRUCTIONS = (
    "# Tools\n\n"
    "You may call one or more functions to help with the user's request. The functions are "
    "listed as JSON schemas between <tools> and </tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with a JSON object holding its name and arguments between "
    "<tool_call> and </tool_call>, one block per call:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <arguments-json-object>}}\n'
    "</tool_call>"
)
REQUIRED = "\n\nAnswer with at least one function call."
NAMED = "\n\nAnswer with a call of the function {name}."


def tools_section(
    tools: Sequence[Mapping[str, Any]], required: bool = False, function: str | None = None
) -> str:
    """The system prompt's tools section; `required` / `function`: a call must follow."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    text = INSTRUCTIONS.format(tools=listed)
    if function is not None:
        text += NAMED.format(name=function)
    elif required:
        text += REQUIRED
    return text


def call_text(name: str, arguments: Any) -> str:
    """One call as the model is asked to write it."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


def generic_messages(
    messages: Sequence[Mapping[str, Any]], section: str | None
) -> list[dict[str, Any]]:
    """`messages` (assistant `tool_calls` with arguments as dicts, `tool` results) as plain
    role and content messages, with the tools `section` in the system prompt."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            result = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "tool_results": True})
            continue
        if message.get("tool_calls"):
            calls = [
                call_text(c["function"]["name"], c["function"]["arguments"])
                for c in message["tool_calls"]
            ]
            content = "\n".join([content, *calls] if content else calls)
        out.append({"role": role, "content": content})
    for message in out:
        message.pop("tool_results", None)
    if section is not None:
        if out and out[0]["role"] == "system":
            first = out[0]["content"]
            out[0]["content"] = f"{first}\n\n{section}" if first else section
        else:
            out.insert(0, {"role": "system", "content": section})
    return out
