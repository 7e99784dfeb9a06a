"""Tool calling through real clients against a real server: the `openai` client (tool_choice
auto, none, required and named; parallel calls; streamed calls reassembled; a chat carrying
past calls and their results), LangChain's ChatOpenAI with bound tools, and an OpenAI Agents
SDK run that calls a tool and then answers; and each kind of bad tool input as a 400.

The models are the scripted stand-in of tool_model.py (a message's `SAY«...»` is the answer),
behind three chat templates: SmolLM2's (no tools section: the generic tool prompt), Qwen2.5's
(its own tools section; `<tool_call>` an added token) and Mistral v0.3's (`[TOOL_CALLS]` a
special token, 9-character call ids)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.service.helpers import LiveServer, make_settings
from tests.service.tool_model import say, scripted_factory, write_tool_lm

GENERIC, QWEN, MISTRAL = "smol-tools", "qwen-tools", "mistral-tools"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}
PARIS = '{"city": "Paris"}'
IMPOSSIBLE = {
    "type": "object",
    "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 2}},
    "required": ["a"],
}


def hermes(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    base = tmp_path_factory.mktemp("tools")
    models = [
        write_tool_lm(base / GENERIC, "smollm2.jinja"),
        write_tool_lm(base / QWEN, "qwen2.5.jinja", added=["<tool_call>", "</tool_call>"]),
        write_tool_lm(base / MISTRAL, "mistral-v3.jinja", special=["[TOOL_CALLS]"]),
    ]
    settings = make_settings(models[0], models=[str(m) for m in models])
    with LiveServer(settings, backend_factory=scripted_factory) as live:
        yield live


@pytest.fixture(scope="module")
def oa(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def ask(oa: openai.OpenAI, text: str, model: str = GENERIC, **kwargs: Any) -> Any:
    kwargs.setdefault("tools", [WEATHER, TIME])
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 300)
    messages = kwargs.pop("messages", [{"role": "user", "content": text}])
    return oa.chat.completions.create(model=model, messages=messages, **kwargs)


def calls_of(message: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("model", [GENERIC, QWEN])
def test_auto_returns_the_calls_the_model_writes(oa: openai.OpenAI, model: str) -> None:
    answer = ask(oa, say("Let me see.\n" + hermes("get_weather", PARIS)), model)
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me see."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris"})]
    # an answer without calls is text, as without tools
    text = ask(oa, say("It is sunny."), model).choices[0]
    assert (text.message.content, text.message.tool_calls, text.finish_reason) == (
        "It is sunny.",
        None,
        "stop",
    )


def test_mistral_calls_and_ids(oa: openai.OpenAI) -> None:
    answer = ask(
        oa, say('[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}]'), MISTRAL
    )
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {
        "zone": "UTC"
    }
    assert len(call.id) == 9 and call.id.isalnum()  # what its template checks in the history
    # a history with the client's own (OpenAI-style) ids: mapped to ids the template takes
    history = [
        {"role": "user", "content": "What time is it?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [tool_call("call_abcdefghijklmnop", "get_time", '{"zone": "UTC"}')],
        },
        {"role": "tool", "tool_call_id": "call_abcdefghijklmnop", "content": say("It is noon.")},
    ]
    assert ask(oa, "", MISTRAL, messages=history).choices[0].message.content == "It is noon."


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_parallel_calls_and_parallel_tool_calls_false(oa: openai.OpenAI) -> None:
    two = say(hermes("get_weather", PARIS) + "\n" + hermes("get_time", '{"zone": "UTC"}'))
    both = ask(oa, two).choices[0]
    assert calls_of(both.message) == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "UTC"}),
    ]
    assert both.message.content is None and both.finish_reason == "tool_calls"
    assert len({c.id for c in both.message.tool_calls}) == 2
    one = ask(oa, two, parallel_tool_calls=False).choices[0]
    assert calls_of(one.message) == [("get_weather", {"city": "Paris"})]


def test_none_hides_the_tools_and_reads_no_calls(oa: openai.OpenAI) -> None:
    text = say(hermes("get_weather", PARIS))
    auto = ask(oa, text)
    none = ask(oa, text, tool_choice="none")
    (choice,) = none.choices
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content == hermes("get_weather", PARIS)
    # the tools section is left out of the prompt
    assert none.usage.prompt_tokens < auto.usage.prompt_tokens - 100


def test_required_and_named_calls(oa: openai.OpenAI) -> None:
    """(The scripted model writes the call it is told to; that decoding holds an unwilling
    model to the schema is test_constrained_calls_of_a_random_model's.)"""
    required = ask(oa, say(hermes("get_weather", PARIS)), tool_choice="required").choices[0]
    assert calls_of(required.message) == [("get_weather", {"city": "Paris"})]
    named = ask(
        oa,
        say(hermes("get_time", '{"zone": "UTC"}')),
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    ).choices[0]
    assert calls_of(named.message) == [("get_time", {"zone": "UTC"})]


@pytest.mark.parametrize("model", [GENERIC, QWEN, MISTRAL])
def test_streamed_calls_reassemble_to_the_answer(oa: openai.OpenAI, model: str) -> None:
    tokyo = '{"zone": "Asia/Tokyo"}'
    calls = hermes("get_weather", PARIS) + "\n" + hermes("get_time", tokyo)
    if model == MISTRAL:
        weather = f'{{"name": "get_weather", "arguments": {PARIS}}}'
        calls = f'[TOOL_CALLS] [{weather}, {{"name": "get_time", "arguments": {tokyo}}}]'
    text = say("Checking both. " + calls)
    plain = ask(oa, text, model).choices[0]
    chunks = list(ask(oa, text, model, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == plain.message.content == "Checking both."
    got: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.index not in got:  # a call's first delta: id, type, name, no arguments
                assert delta.id and delta.type == "function" and delta.function.name
                assert delta.function.arguments == ""
                got[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            else:
                assert delta.id is None and delta.function.name is None
                got[delta.index]["arguments"] += delta.function.arguments
    assert [(c["name"], c["arguments"]) for c in got.values()] == [
        (c.function.name, c.function.arguments) for c in plain.message.tool_calls
    ]
    assert len(chunks[-1].choices) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert sum(len(c.choices[0].delta.tool_calls or []) for c in chunks) > 4  # fragments


@pytest.mark.parametrize("model", [GENERIC, QWEN])
def test_a_chat_with_past_calls_and_results(oa: openai.OpenAI, model: str) -> None:
    history = [
        {"role": "system", "content": "You help with the weather."},
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                tool_call("call_1", "get_weather", PARIS),
                tool_call("call_2", "get_weather", '{"city": "Lyon"}'),
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": say("Paris 21 C, Lyon 18 C.")},
    ]
    answer = ask(oa, "", model, messages=history).choices[0]
    assert answer.message.content == "Paris 21 C, Lyon 18 C." and answer.finish_reason == "stop"


def test_langchain_bound_tools(server: LiveServer) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")

    def get_weather(city: str) -> str:
        """The weather in a city now.

        Args:
            city: The city's name.
        """
        return "sunny"

    chat = langchain_openai.ChatOpenAI(
        model=GENERIC, base_url=server.url + "/v1", api_key="unused", temperature=0, max_retries=0
    )
    bound = chat.bind_tools([get_weather], tool_choice="get_weather")
    message = bound.invoke(say(hermes("get_weather", '{"city": "Lyon"}')))
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [
        ("get_weather", {"city": "Lyon"})
    ]
    assert message.tool_calls[0]["id"].startswith("call_")


def test_agents_sdk_run_calls_the_tool_then_answers(server: LiveServer) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        seen.append(city)
        return say(f"It is sunny in {city}.")  # what the model answers next

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    agent = agents.Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        model=agents.OpenAIChatCompletionsModel(model=GENERIC, openai_client=client),
        model_settings=agents.ModelSettings(temperature=0, max_tokens=300),
        tools=[get_weather],
    )
    prompt = say(hermes("get_weather", '{"city": "Oslo"}'))
    result = asyncio.run(agents.Runner.run(agent, prompt, max_turns=4))
    assert seen == ["Oslo"]
    assert result.final_output == "It is sunny in Oslo."


def post(server: LiveServer, body: dict[str, Any], path: str = "/v1/chat/completions") -> Any:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_bad_tool_input_is_a_bad_request(server: LiveServer) -> None:
    user = [{"role": "user", "content": "hi"}]
    call = tool_call("call_1", "get_weather", PARIS)
    bad: list[tuple[dict[str, Any], str]] = [
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "tools",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": 5},
                        },
                    }
                ]
            },
            "tools",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "description": "ends <|im_end|>"},
                    }
                ]
            },
            "tools",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "functions": [{"name": "f"}]}, "functions"),
        # a required call already constrains the answer: no other structured output beside it
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        # a schema no call can satisfy (the grammar allows no text)
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": IMPOSSIBLE}}
                ],
                "tool_choice": "required",
            },
            "tool_choice",
        ),
        (
            {
                "messages": [
                    *user,
                    {"role": "assistant", "tool_calls": [tool_call("c", "f", "{oops")]},
                ]
            },
            "messages",
        ),
        (
            {
                "messages": [
                    *user,
                    {"role": "assistant", "tool_calls": [tool_call("c", "f", "[1]")]},
                ]
            },
            "messages",
        ),
        (
            {
                "messages": [
                    *user,
                    {"role": "assistant", "tool_calls": [call]},
                    {"role": "tool", "content": "x"},
                ]
            },
            "messages",
        ),
        (
            {"messages": [*user, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
            "messages",
        ),
        ({"messages": [{"role": "user", "content": "hi", "tool_calls": [call]}]}, "messages"),
    ]
    for extra, param in bad:
        body = {"model": GENERIC, "messages": user, "max_tokens": 4, **extra}
        answer = post(server, body)
        assert answer.status_code == 400, (extra, answer.text)
        assert answer.json()["error"]["param"] == param, (extra, answer.text)
    answer = post(server, {"model": GENERIC, "prompt": "hi", "tools": [WEATHER]}, "/v1/completions")
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tools"
    # a template that refuses the chat (Mistral's: roles must alternate) is a 400, not a 500
    body = {"model": MISTRAL, "messages": [*user, *user], "tools": [WEATHER], "max_tokens": 4}
    answer = post(server, body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"
    assert 'status="500"' not in server.metrics()
