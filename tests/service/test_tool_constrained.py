"""Required and named tool calls of a model that does not want to call anything: a tiny
random-weight Llama (byte-level vocabulary, SmolLM2's template: the generic tool prompt) whose
answers are held to the call grammar by the engine's constrained decoding. Its calls must
parse and validate against their schemas, streamed or not, through the `openai` client,
LangChain and an Agents SDK run (tool_choice "required" for the first turn; the SDK resets
it to auto after the tool runs, and the model's next answer, text, ends the run).

Skipped while the engine does not decode under `guided_grammar` (the probe asks the server
to write an answer only a grammar would give)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest

from tests.service.helpers import LiveServer, make_settings
from tests.service.tool_model import write_tool_lm

MODEL = "random-tools"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Lyon", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
PING = {"type": "function", "function": {"name": "ping", "description": "Is anyone there?"}}
SCHEMAS = {
    "get_weather": WEATHER["function"]["parameters"],
    "ping": {"type": "object", "additionalProperties": False},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = write_tool_lm(tmp_path_factory.mktemp("constrained") / MODEL, "smollm2.jinja")
    with LiveServer(make_settings(model, backend="torch")) as live:
        probe = {"text": "Hello", "guided_grammar": 'start: "yes!"', "max_new_tokens": 8}
        answer = httpx.post(live.url + "/v1/generate", json=probe, timeout=60)
        if answer.status_code != 200 or answer.json()["translations"][0]["text"] != "yes!":
            pytest.skip("the engine does not decode under guided_grammar yet")
        yield live


@pytest.fixture(scope="module")
def oa(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def ask(oa: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", [{"role": "user", "content": "What is the weather in Oslo?"}])
    kwargs.setdefault("tools", [WEATHER, PING])
    kwargs.setdefault("max_tokens", 200)
    return oa.chat.completions.create(model=MODEL, **kwargs)


def valid_calls(message: Any) -> list[str]:
    """The calls' names, each call's arguments checked against its schema."""
    assert message.tool_calls, message
    for call in message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [c.function.name for c in message.tool_calls]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_calls_parse_and_validate(oa: openai.OpenAI, seed: int) -> None:
    answer = ask(oa, tool_choice="required", seed=seed, temperature=1.0)
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert set(valid_calls(choice.message)) <= {"get_weather", "ping"}
    one = ask(oa, tool_choice="required", seed=seed, temperature=1.0, parallel_tool_calls=False)
    assert len(valid_calls(one.choices[0].message)) == 1


def test_a_named_call_is_that_function(oa: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for temperature in (0.0, 1.0):
        answer = ask(oa, tool_choice=named, temperature=temperature, seed=3)
        assert valid_calls(answer.choices[0].message) == ["get_weather"]


def test_a_streamed_required_call_is_the_plain_one(oa: openai.OpenAI) -> None:
    # one call: greedy decoding of a random model may repeat parallel calls to the limit
    one: dict[str, Any] = {
        "tool_choice": "required",
        "temperature": 0,
        "parallel_tool_calls": False,
    }
    plain = ask(oa, **one).choices[0].message
    chunks = list(ask(oa, **one, stream=True))
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta.index, [delta.function.name or "", ""])
            entry[1] += delta.function.arguments or ""
    assert list(calls.values()) == [
        [c.function.name, c.function.arguments] for c in plain.tool_calls
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_langchain_named_tool(server: LiveServer) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")

    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city now.

        Args:
            city: The city's name.
        """
        return "sunny"

    chat = langchain_openai.ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="unused", temperature=0, max_retries=0
    )
    message = chat.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Oslo?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Oslo")


def test_agents_sdk_run_ends(server: LiveServer) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city now."""
        cities.append(city)
        return "sunny"

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    agent = agents.Agent(
        name="weather",
        instructions="Answer questions about the weather.",
        model=agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        # the first turn must call the tool (once: greedy decoding of a random model would
        # repeat parallel calls to the limit); after it the SDK resets tool_choice to auto
        # (reset_tool_choice), and the random model's text is the final answer
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=200
        ),
        tools=[get_weather],
    )
    result = asyncio.run(agents.Runner.run(agent, "Weather in Oslo?", max_turns=4))
    assert len(cities) == 1 and cities[0] in ("Paris", "Oslo")
    assert isinstance(result.final_output, str)
