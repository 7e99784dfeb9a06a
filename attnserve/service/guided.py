"""Structured outputs: a request's `response_format` / `guided_*` / `structured_outputs` as the
grammar its answer follows (engine/constraints.py decodes under it).

Each form becomes llguidance grammar text: a JSON schema (checked first with `jsonschema`
against its own metaschema, so a malformed schema is named as such), any JSON object, a regex,
a choice among strings, or a grammar in Lark (llguidance's dialect, `%json {...}` inside it
included) or GBNF (llama.cpp's, converted to Lark). Compiling it against the model's tokens
(`Vocabulary`, built once per model on first use) finds what llguidance cannot use, an
unsupported keyword, a regex that matches nothing: all are 422s on the native API (400s on
OpenAI's) naming the field. JSON is written compactly (no free whitespace between tokens: a
small model otherwise fills its budget with newlines), unless the schema's own `x-guidance`
options say otherwise.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool

from attnserve.engine.constraints import Constraint, GrammarError, Vocabulary
from attnserve.service.errors import ApiError
from attnserve.service.models import ServedModel
from attnserve.service.schemas import Guided

# llguidance's JSON options: no whitespace the schema does not need.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
MAX_CHOICES = 1024

_vocabularies: dict[Path, Vocabulary] = {}
_lock = threading.Lock()


def _llguidance() -> Any:
    import llguidance

    return llguidance


def requested(body: Guided) -> tuple[str, str] | None:
    """(llguidance grammar text, the field that asked for it), or None for free text; 422
    for a request that asks for two, or for a malformed schema or choice list."""
    llg = _llguidance()
    forms: list[tuple[str, str]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            forms.append((json_grammar({"type": "object"}), "response_format"))
        else:
            spec = fmt.json_schema
            if spec is None:
                raise ApiError(
                    422,
                    "response_format: json_schema needs a json_schema object",
                    param="response_format",
                )
            schema = spec.schema_ if spec.schema_ is not None else {"type": "object"}
            forms.append((json_grammar(_checked(schema, "response_format")), "response_format"))
    if body.guided_json is not None:
        forms.append((json_grammar(_checked(body.guided_json, "guided_json")), "guided_json"))
    if body.guided_regex is not None:
        forms.append((llg.LLMatcher.grammar_from_regex(body.guided_regex), "guided_regex"))
    if body.guided_choice is not None:
        forms.append((_choice_grammar(body.guided_choice, "guided_choice"), "guided_choice"))
    if body.guided_grammar is not None:
        forms.append((_lark(body.guided_grammar, "guided_grammar"), "guided_grammar"))
    outputs = body.structured_outputs
    if outputs is not None:
        name = "structured_outputs"
        if outputs.json_ is not None:
            forms.append((json_grammar(_checked(outputs.json_, name)), name))
        if outputs.json_object:
            forms.append((json_grammar({"type": "object"}), name))
        if outputs.regex is not None:
            forms.append((llg.LLMatcher.grammar_from_regex(outputs.regex), name))
        if outputs.choice is not None:
            forms.append((_choice_grammar(outputs.choice, name), name))
        if outputs.grammar is not None:
            forms.append((_lark(outputs.grammar, name), name))
    if len(forms) > 1:
        names = ", ".join(sorted({param for _, param in forms}))
        raise ApiError(
            422, f"give one structured output form, not several ({names})", param=forms[1][1]
        )
    return forms[0] if forms else None


def _checked(schema: dict[str, Any] | str, param: str) -> dict[str, Any]:
    """A JSON schema as a dict, valid under its metaschema (jsonschema); else 422."""
    import jsonschema

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except RecursionError as exc:
            raise ApiError(422, f"{param}: the schema is nested too deeply", param=param) from exc
        except ValueError as exc:
            raise ApiError(422, f"{param}: the schema is not JSON: {exc}", param=param) from exc
    if not isinstance(schema, dict):
        raise ApiError(422, f"{param}: a JSON schema is an object", param=param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except RecursionError as exc:
        raise ApiError(422, f"{param}: the schema is nested too deeply", param=param) from exc
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "the top level"
        raise ApiError(
            422, f"{param}: invalid JSON schema at {where}: {exc.message}", param=param
        ) from exc
    return schema


def json_grammar(schema: dict[str, Any]) -> str:
    """llguidance grammar text for a JSON schema, written compactly (`JSON_OPTIONS`)."""
    return str(_llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))


def _choice_grammar(choices: list[str], param: str) -> str:
    if not choices or len(choices) > MAX_CHOICES:
        raise ApiError(422, f"{param}: give 1 to {MAX_CHOICES} choices", param=param)
    # Lark string literals take JSON's escapes
    alternatives = " | ".join(json.dumps(choice) if choice else '""' for choice in choices)
    return str(_llguidance().LLMatcher.grammar_from_lark(f"start: {alternatives}\n"))


def _lark(grammar: str, param: str) -> str:
    """Lark text as llguidance's grammar; GBNF (rules with `::=`) converted to Lark first."""
    llg = _llguidance()
    if "::=" in grammar:
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            grammar = gbnf_to_lark(grammar)
        except Exception as exc:  # the converter's own parse errors
            raise ApiError(422, f"{param}: invalid GBNF grammar: {exc}", param=param) from exc
    return str(llg.LLMatcher.grammar_from_lark(grammar))


def vocabulary(model: ServedModel) -> Vocabulary:
    """The model's tokens as llguidance sees them (built on first use, then kept)."""
    with _lock:
        found = _vocabularies.get(model.directory)
        if found is None:
            spec = model.backend.spec
            found = Vocabulary(
                model.tokenizer.tokenizer.to_str(), sorted(spec.stops), spec.vocab_size
            )
            _vocabularies[model.directory] = found
        return found


async def constraint_for(
    body: Guided, model: ServedModel, decoding_param: str | None = None
) -> Constraint | None:
    """The request's compiled grammar (None for free text), compiled off the event loop;
    422 naming the field for a grammar llguidance cannot use or a translation model;
    `decoding_param`: the field a limit passed while decoding names (default: the grammar's)."""
    asked = requested(body)
    if asked is None:
        return None
    grammar, param = asked
    if not model.generates:
        raise ApiError(
            422,
            f"{param}: structured outputs need a language model; {model.name} translates",
            param=param,
        )

    def compile_() -> Constraint:
        return vocabulary(model).compile(grammar)

    try:
        constraint = await run_in_threadpool(compile_)
    except GrammarError as exc:
        raise ApiError(422, f"{param}: {exc}", param=param) from exc
    constraint.param = decoding_param or param  # a limit passed while decoding: its 422
    return constraint
