"""LangChain's ChatOpenAI against a real attnserve server: `with_structured_output` with a
pydantic model (method json_schema, strict) and with a JSON schema in JSON mode. The tiny
random model's answers are forced into the schema, so LangChain parses them."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from tests.service.helpers import LiveServer

langchain_openai = pytest.importorskip("langchain_openai")


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=8, description="first name")
    age: int = Field(ge=0, le=99)


def chat(server: LiveServer, **kwargs: object) -> object:
    return langchain_openai.ChatOpenAI(
        model="tiny-byte-lm",
        base_url=server.url + "/v1",
        api_key="none",
        temperature=0,
        max_tokens=80,
        timeout=120,
        max_retries=0,
        **kwargs,
    )


def test_with_structured_output_json_schema_parses_into_the_model(byte_lm: LiveServer) -> None:
    structured = chat(byte_lm).with_structured_output(Person, method="json_schema", strict=True)  # type: ignore[attr-defined]
    person = structured.invoke("Who is the oldest person you know?")
    assert isinstance(person, Person)
    assert 0 <= person.age <= 99 and len(person.name) <= 8


def test_with_structured_output_json_mode(byte_lm: LiveServer) -> None:
    schema = {
        "title": "Answer",
        "description": "An answer.",
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
    }
    structured = chat(byte_lm).with_structured_output(schema, method="json_mode")  # type: ignore[attr-defined]
    answer = structured.invoke("Reply in JSON.")
    assert isinstance(answer, dict)
