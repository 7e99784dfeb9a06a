"""The grammar that constrains an answer to tool calls (`tool_choice` "required" or a named
function): a Lark grammar in llguidance's syntax, in the model's own call syntax, each call's
JSON held to its tool's parameters schema (`%json`), for the engine's `guided_grammar`.

A call marker that is one token of the vocabulary (an added token, such as Qwen's
`<tool_call>` or Mistral's `[TOOL_CALLS]`) is written as that token (`<[id]>`: llguidance
treats every added token as special, and its bytes would never match a text literal); one that
is not (SmolLM2 writes `<tool_call>` as text) is a text literal. The JSON is written as
`json.dumps` writes it (`", "` and `": "`, no other whitespace: the shape the templates show
the model, and no room for a small model to emit spaces forever). Schema keywords llguidance
cannot enforce are ignored (`lenient`), never refused. An object schema that does not say
whether other properties are allowed allows none (`additionalProperties: false`, as OpenAI's
strict mode and xgrammar's strict mode, vLLM's default, read it): a model held to a schema
would otherwise be free to invent keys without end.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from attnserve.service.tool_parsers import HERMES, LLAMA3_JSON, MISTRAL, ToolSyntax

# Compact JSON as json.dumps writes it, and schema features llguidance lacks ignored.
JSON_STYLE = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": True,
}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


# Where a schema holds schemas: a dict of them, a list of them, or one.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed(schema: Any) -> Any:
    """`schema` with every object schema that leaves other properties open closed
    (`additionalProperties: false`); `allOf` branches are left as they are (closing each
    would refuse the properties of the others)."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and not any(key in out for key in _OPEN):
        out["additionalProperties"] = False
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    for key in _SCHEMAS:
        if isinstance(out.get(key), Mapping):
            out[key] = closed(out[key])
    return out


def call_schema(function: Mapping[str, Any], arguments_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call of `function` ({"name", "parameters", ...}): its name,
    then arguments that follow its parameters schema (closed). The parameters' `$defs` move
    to the root so that their `#/$defs/...` references still resolve."""
    parameters = closed(function.get("parameters") or NO_ARGUMENTS)
    hoisted = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    return {
        "x-guidance": JSON_STYLE,
        "type": "object",
        "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
        **hoisted,
    }


def _marker(text: str, added_tokens: Mapping[str, int]) -> str:
    token = added_tokens.get(text)
    return f"<[{token}]>" if token is not None else json.dumps(text, ensure_ascii=False)


def tool_grammar(
    functions: Sequence[Mapping[str, Any]],
    syntax: ToolSyntax,
    added_tokens: Mapping[str, int],
    *,
    parallel: bool,
) -> str:
    """A Lark grammar for an answer of one call (or, `parallel`, one or more) to any of
    `functions`, written in `syntax`; `added_tokens`: the vocabulary's added tokens."""
    if not functions:
        raise ValueError("a tool call grammar needs at least one function")
    rules = [f"body: {' | '.join(f'tool_{i}' for i in range(len(functions)))}"]
    for i, function in enumerate(functions):
        schema = call_schema(function, syntax.arguments_key)
        rules.append(f"tool_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    if syntax is MISTRAL:
        marker = _marker(syntax.start[0], added_tokens)
        more = ' (", " body)*' if parallel else ""
        start = f'start: {marker} " [" body{more} "]"'
    elif syntax is LLAMA3_JSON:
        start = 'start: body ("; " body)*' if parallel else "start: body"
    else:
        if syntax is not HERMES and syntax.end is None:
            raise ValueError(f"no grammar for tool call syntax {syntax.name}")
        opening, closing = (_marker(m, added_tokens) for m in syntax.markers)
        rules.insert(0, f'call: {opening} "\\n" body "\\n" {closing}')
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
    # `::=` (inside a schema's strings) would read as GBNF to service/guided.py: escaped
    return "\n".join([start, *rules]).replace("::=", "\\u003a\\u003a=") + "\n"
