"""Tool calling on /v1/chat/completions: a request's tools checked, the chat rendered with
them, the grammar that holds a required or named call to its schema, and the model's calls
read back from its answer (whole or streamed).

A chat is rendered by the model's own template when the template has a tools section (it
reads `tools`): tools as transformers passes them, past calls with their arguments as objects
(as vLLM hands them to Hugging Face templates), results as `tool` messages. Otherwise the
generic prompt of tool_prompt.py stands in. The call syntax (tool_parsers.py) is the one the
template writes (`Settings.tool_call_parser` overrides it), Hermes' for the generic prompt.

`tool_choice`: "auto" (the default with tools) parses calls out of whatever the model writes
(an answer that does not parse is its text, as vLLM answers); "required" and a named function
constrain decoding to calls (`guided_grammar`); "none" neither shows the tools to the model
nor parses its answer. `parallel_tool_calls: false` (and a named function) keeps one call.

What a client sends is data: names are OpenAI's `[A-Za-z0-9_-]{1,64}`, and a tool definition
or past call holding the text of one of the model's special tokens is refused (400), so that
tool JSON never turns into control tokens when the rendered chat is encoded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from attnserve.engine.generator import StopStrings
from attnserve.engine.search import Hypothesis as EngineHypothesis
from attnserve.service.errors import ApiError, shown
from attnserve.service.generation import EngineRun, start_lm
from attnserve.service.guided import requested
from attnserve.service.models import ServedModel
from attnserve.service.openai_schemas import (
    ChatCompletionMessage,
    ChatCompletionRequest,
    NamedToolChoice,
    ToolCall,
    ToolCallFunction,
)
from attnserve.service.prompts import chat_ids
from attnserve.service.schemas import ChatMessage, GenerateRequest
from attnserve.service.state import ServiceState
from attnserve.service.tool_grammar import tool_grammar
from attnserve.service.tool_parsers import (
    HERMES,
    SYNTAXES,
    ArgumentsDelta,
    CallStart,
    Event,
    ToolCallParser,
    ToolSyntax,
    detect_syntax,
    new_call_id,
    parse_tool_calls,
)
from attnserve.service.tool_prompt import generic_messages, tools_section

TOOL_CALL_PARSERS = ("auto", *SYNTAXES)
Choice = Literal["none", "auto", "required", "function"]


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses tools."""

    functions: list[dict[str, Any]]  # {"name", "description"?, "parameters"?, "strict"?}
    choice: Choice
    function: str | None  # the named function (choice "function")
    parallel: bool
    syntax: ToolSyntax
    native: bool  # the model's template renders the tools (else the generic prompt)

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The tools as a template takes them (transformers' `tools=`)."""
        return [{"type": "function", "function": f} for f in self.functions]

    @property
    def parses(self) -> bool:
        """The answer is read for tool calls."""
        return self.choice != "none" and bool(self.functions)

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel and self.choice != "function" else 1


def _uses_tools(body: ChatCompletionRequest) -> bool:
    return bool(body.tools) or any(m.tool_calls or m.role == "tool" for m in body.messages)


def plan_tools(body: ChatCompletionRequest, model: ServedModel, parser: str) -> ToolPlan | None:
    """The request's tools and tool_choice, checked (400 naming the field); None for a chat
    without tools, tool calls or tool results (rendered as before tools existed)."""
    choice = body.tool_choice
    if not _uses_tools(body) and choice in (None, "none", "auto"):
        return None
    functions: list[dict[str, Any]] = []
    for i, tool in enumerate(body.tools or []):
        if tool.type != "function":
            raise ApiError(
                400, f"tools[{i}].type {shown(tool.type)} is not supported", param="tools"
            )
        if tool.function is None:
            raise ApiError(400, f"tools[{i}].function is missing", param="tools")
        functions.append(_checked_function(tool.function.model_dump(exclude_none=True), i))
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools: two functions share a name", param="tools")
    _check_text(json.dumps(functions, ensure_ascii=False), model, "tools")
    kind: Choice
    function = None
    if isinstance(choice, NamedToolChoice):
        kind, function = "function", choice.function.name
        if function not in names:
            raise ApiError(
                400, f"tool_choice names {shown(function)}, not in tools", param="tool_choice"
            )
    else:
        kind = choice or ("auto" if functions else "none")
    if kind == "required" and not functions:
        raise ApiError(400, "tool_choice required needs tools", param="tool_choice")
    tokenizer = model.tokenizer
    native = bool(tokenizer.renders_tools)
    if not native:
        syntax = HERMES
    elif parser != "auto":
        syntax = SYNTAXES[parser]
    else:
        syntax = detect_syntax(tokenizer.chat_template)
    parallel = body.parallel_tool_calls is not False
    return ToolPlan(functions, kind, function, parallel, syntax, native)


def _checked_function(function: dict[str, Any], i: int) -> dict[str, Any]:
    from jsonschema import Draft202012Validator, SchemaError

    parameters = function.get("parameters")
    if parameters is not None:
        where = f"tools[{i}].function.parameters"
        if parameters.get("type", "object") != "object":
            raise ApiError(400, f"{where} must be the schema of an object", param="tools")
        try:
            Draft202012Validator.check_schema(parameters)
        except SchemaError as exc:
            message = f"{where} is not a JSON schema: {exc.message}"
            raise ApiError(400, message, param="tools") from exc
        except RecursionError as exc:
            raise ApiError(400, f"{where} is nested too deeply", param="tools") from exc
    return function


def _check_text(text: str, model: ServedModel, where: str) -> None:
    """400 when `text` holds one of the model's special tokens."""
    for token in model.tokenizer.added_tokens(special_only=True):
        if token in text:
            raise ApiError(400, f"{where} holds the model's special token {token!r}", param=where)


# -- the chat ---------------------------------------------------------------------------------


def _call_id(call_id: str, syntax: ToolSyntax) -> str:
    """A client's tool call id as the template takes it (Mistral's: 9 letters and digits)."""
    if syntax.id_length is None or (len(call_id) == syntax.id_length and call_id.isalnum()):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[: syntax.id_length]


def template_messages(
    messages: Sequence[ChatCompletionMessage],
    plain: Sequence[ChatMessage],
    plan: ToolPlan,
    model: ServedModel,
) -> list[dict[str, Any]]:
    """The chat as a template takes it: `plain` (the roles and text contents), with each
    assistant's `tool_calls` (arguments parsed into objects) and each tool result's
    `tool_call_id` and function `name`; 400 for calls and results that do not fit."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> function name
    for i, (message, text) in enumerate(zip(messages, plain, strict=True)):
        where = f"messages[{i}]"
        entry: dict[str, Any] = {"role": text.role, "content": text.content}
        if message.tool_calls:
            if message.role != "assistant":
                raise ApiError(
                    400, f"{where}: only assistant messages have tool_calls", param="messages"
                )
            calls = []
            for j, call in enumerate(message.tool_calls):
                if call.type != "function":
                    raise ApiError(
                        400, f"{where}.tool_calls[{j}].type must be function", param="messages"
                    )
                arguments = _arguments(call.function.arguments, f"{where}.tool_calls[{j}]")
                call_id = call.id or f"call_{i}_{j}"
                _check_text(
                    json.dumps([call.function.name, arguments], ensure_ascii=False),
                    model,
                    "messages",
                )
                names[call_id] = call.function.name
                calls.append(
                    {
                        "id": _call_id(call_id, plan.syntax),
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": arguments},
                    }
                )
            entry["tool_calls"] = calls
        elif message.role == "tool":
            if not message.tool_call_id:
                raise ApiError(400, f"{where}: a tool result needs tool_call_id", param="messages")
            if message.tool_call_id not in names:
                raise ApiError(
                    400,
                    f"{where}.tool_call_id {shown(message.tool_call_id)} answers no earlier "
                    "tool call",
                    param="messages",
                )
            entry["tool_call_id"] = _call_id(message.tool_call_id, plan.syntax)
            entry["name"] = names[message.tool_call_id]
        out.append(entry)
    return out


def _arguments(arguments: str | dict[str, Any], where: str) -> dict[str, Any]:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as exc:
            raise ApiError(
                400, f"{where}.function.arguments is not JSON: {exc}", param="messages"
            ) from exc
    if not isinstance(arguments, dict):
        raise ApiError(400, f"{where}.function.arguments is not a JSON object", param="messages")
    return arguments


async def chat_prompt(
    plan: ToolPlan,
    messages: list[dict[str, Any]],
    model: ServedModel,
    service: ServiceState,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of the chat and its tools, rendered by the template or the generic prompt
    (`template_kwargs`: the request's chat_template_kwargs), off the event loop when long; 400
    for a chat the template refuses or one over the model's input limit."""
    tools = plan.tools if plan.choice != "none" else []
    settings = service.settings
    if plan.native:
        return await chat_ids(
            model, settings, messages, tools=tools or None, template_kwargs=template_kwargs
        )
    section = None
    if tools:
        section = tools_section(plan.tools, plan.choice == "required", plan.function)
    chat = generic_messages(messages, section)
    return await chat_ids(model, settings, chat, template_kwargs=template_kwargs)


def constrain(
    plan: ToolPlan, body: ChatCompletionRequest, model: ServedModel, fields: dict[str, Any]
) -> None:
    """For a required or named call, the native request's `guided_grammar` (service/guided.py
    compiles it for the engine); 400 when the request asks for a structured output too."""
    if not plan.constrained:
        return
    if requested(body) is not None:
        message = "a required or named tool call cannot follow response_format or guided_* too"
        raise ApiError(400, message, param="tool_choice")
    functions = plan.functions
    if plan.function is not None:
        functions = [f for f in functions if f["name"] == plan.function]
    try:
        text = tool_grammar(
            functions, plan.syntax, model.tokenizer.added_tokens(), parallel=plan.max_calls is None
        )
    except RecursionError as exc:
        raise ApiError(400, "tools: a schema is nested too deeply", param="tools") from exc
    fields["guided_grammar"] = text


async def start(
    native: GenerateRequest,
    service: ServiceState,
    model: ServedModel,
    plan: ToolPlan,
    prompt: Sequence[int],
) -> EngineRun:
    """start_lm for a chat with tools; a call grammar the model cannot follow is the tools'
    400 (the client sent no guided_grammar)."""
    try:
        param = "tool_choice" if plan.constrained else None  # else the client's own grammar
        return await start_lm(native, service, model, prompt, grammar_param=param)
    except ApiError as exc:
        if not plan.constrained or exc.param != "guided_grammar":
            raise
        reason = exc.message.removeprefix("guided_grammar: ")
        message = f"tool_choice: the calls cannot be constrained for this model: {reason}"
        raise ApiError(400, message, param="tool_choice") from exc


# -- the answer -------------------------------------------------------------------------------


def decoder(model: ServedModel, syntax: ToolSyntax) -> Callable[[Sequence[int]], str]:
    """Token ids -> text with the syntax's call markers kept where they are special tokens
    (`[TOOL_CALLS]`, `<|python_tag|>`) and every other special token left out."""
    tokenizer = model.tokenizer
    markers = set(syntax.markers)
    drop = {i for t, i in tokenizer.added_tokens(special_only=True).items() if t not in markers}

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode([i for i in ids if i not in drop], skip_special_tokens=False))

    return decode


def answer_text(
    decode: Callable[[Sequence[int]], str], hyp: EngineHypothesis, stopper: StopStrings | None
) -> str:
    text = decode(hyp.tokens)
    return stopper.truncate(text) if hyp.stopped and stopper is not None else text


def tool_answer(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """An answer's content and tool calls."""
    parsed = parse_tool_calls(text, plan.syntax, lambda: new_call_id(plan.syntax), plan.max_calls)
    calls = [
        ToolCall(id=c.id, function=ToolCallFunction(name=c.name, arguments=c.arguments))
        for c in parsed.calls
    ]
    return parsed.content, calls


class ToolStream:
    """A streamed answer's deltas: content, and tool calls as OpenAI streams them (a call's
    first delta has its index, id, type, name and empty arguments; then fragments of its
    arguments)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.parser = ToolCallParser(plan.syntax, max_calls=plan.max_calls)

    @property
    def called(self) -> bool:
        return bool(self.parser.calls)

    def feed(self, text: str) -> list[dict[str, Any]]:
        return [_delta(e) for e in self.parser.feed(text)]

    def finish(self) -> list[dict[str, Any]]:
        return [_delta(e) for e in self.parser.finish()]


def _delta(event: Event) -> dict[str, Any]:
    if isinstance(event, CallStart):
        function = {"name": event.name, "arguments": ""}
        call = {"index": event.index, "id": event.id, "type": "function", "function": function}
        return {"tool_calls": [call]}
    if isinstance(event, ArgumentsDelta):
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
    return {"content": event}
