"""Fifty JSON schemas of varied shapes (nested objects, arrays with bounds, enums, numbers with
bounds, optional fields, $defs and $ref, anyOf, const, string patterns and formats) given to
SmolLM2-135M-Instruct as the grammar of its answer: every answer, with greedy, sampling and
beam search, all decoded in one batch, parses and validates against its schema (jsonschema).
Slow; skipped without the model's wheel."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import pytest

from attnserve.engine.constraints import Vocabulary
from attnserve.engine.options import DecodingOptions
from attnserve.engine.scheduler import Outcome, Scheduler, SchedulerLimits, lm_request
from attnserve.engine.torch_lm import TorchLMBackend
from attnserve.model.text_tokenizer import TextTokenizer

pytestmark = pytest.mark.slow

NAME = {"type": "string", "minLength": 1, "maxLength": 40}


def obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> Any:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


ADDRESS = obj({"street": NAME, "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})
SCHEMAS: list[tuple[str, Any]] = [
    ("a person", obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a city", obj({"city": NAME, "country": NAME})),
    ("a yes or no answer", obj({"answer": {"enum": ["yes", "no"]}})),
    ("a color", obj({"color": {"enum": ["red", "green", "blue", "yellow"]}})),
    ("a temperature reading", obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60}})),
    (
        "a book",
        obj(
            {
                "title": NAME,
                "author": NAME,
                "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
            }
        ),
    ),
    ("a boolean flag", obj({"enabled": {"type": "boolean"}})),
    (
        "three fruits",
        obj({"fruits": {"type": "array", "items": NAME, "minItems": 3, "maxItems": 3}}),
    ),
    (
        "a list of up to four numbers",
        obj(
            {
                "numbers": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 1000},
                    "maxItems": 4,
                }
            }
        ),
    ),
    ("an address", ADDRESS),
    ("a person with an address", obj({"name": NAME, "address": ADDRESS})),
    (
        "a product",
        obj(
            {
                "name": NAME,
                "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
                "in_stock": {"type": "boolean"},
            }
        ),
    ),
    (
        "a movie with an optional rating",
        obj({"title": NAME, "rating": {"type": "number", "minimum": 0, "maximum": 10}}, ["title"]),
    ),
    (
        "a user with optional email",
        obj(
            {
                "username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"},
                "email": {"type": "string", "format": "email"},
            },
            ["username"],
        ),
    ),
    ("a date", obj({"date": {"type": "string", "format": "date"}})),
    ("an event", obj({"name": NAME, "when": {"type": "string", "format": "date-time"}})),
    ("a country code", obj({"code": {"type": "string", "pattern": "^[A-Z]{2}$"}})),
    ("a phone number", obj({"phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"}})),
    ("a point", obj({"x": {"type": "number"}, "y": {"type": "number"}})),
    (
        "a line of two points",
        obj(
            {
                "start": obj({"x": {"type": "integer"}, "y": {"type": "integer"}}),
                "end": obj({"x": {"type": "integer"}, "y": {"type": "integer"}}),
            }
        ),
    ),
    (
        "a team",
        obj(
            {
                "team": NAME,
                "members": {
                    "type": "array",
                    "items": obj({"name": NAME, "role": {"enum": ["lead", "dev", "qa"]}}),
                    "minItems": 1,
                    "maxItems": 3,
                },
            }
        ),
    ),
    (
        "a recipe",
        obj(
            {
                "dish": NAME,
                "ingredients": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 5},
                "minutes": {"type": "integer", "minimum": 1, "maximum": 600},
            }
        ),
    ),
    (
        "a weather report",
        obj(
            {
                "city": NAME,
                "condition": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                "high": {"type": "integer", "minimum": -40, "maximum": 50},
            }
        ),
    ),
    (
        "a grade",
        obj({"student": NAME, "grade": {"type": "string", "enum": ["A", "B", "C", "D", "F"]}}),
    ),
    ("a percentage", obj({"percent": {"type": "number", "minimum": 0, "maximum": 100}})),
    (
        "an API status",
        obj({"status": {"const": "ok"}, "code": {"type": "integer", "enum": [200, 201, 204]}}),
    ),
    (
        "a tag list",
        obj(
            {
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "pattern": "^[a-z]{2,10}$"},
                    "maxItems": 5,
                }
            }
        ),
    ),
    (
        "a key-value pair",
        obj(
            {
                "key": NAME,
                "value": {"anyOf": [{"type": "string", "maxLength": 30}, {"type": "integer"}]},
            }
        ),
    ),
    (
        "a shape",
        {
            "anyOf": [
                obj(
                    {
                        "kind": {"const": "circle"},
                        "radius": {"type": "number", "minimum": 0, "maximum": 100},
                    }
                ),
                obj(
                    {
                        "kind": {"const": "square"},
                        "side": {"type": "number", "minimum": 0, "maximum": 100},
                    }
                ),
            ]
        },
    ),
    (
        "a tree node with $defs",
        {
            "$defs": {"leaf": obj({"value": {"type": "integer", "minimum": 0, "maximum": 9}})},
            **obj({"left": {"$ref": "#/$defs/leaf"}, "right": {"$ref": "#/$defs/leaf"}}),
        },
    ),
    (
        "an employee with $defs",
        {
            "$defs": {"name": NAME},
            **obj({"first": {"$ref": "#/$defs/name"}, "last": {"$ref": "#/$defs/name"}}),
        },
    ),
    (
        "a nullable middle name",
        obj({"first": NAME, "middle": {"type": ["string", "null"], "maxLength": 20}}),
    ),
    (
        "a list of people",
        {"type": "array", "items": obj({"name": NAME}), "minItems": 1, "maxItems": 3},
    ),
    ("a list of words", {"type": "array", "items": NAME, "minItems": 2, "maxItems": 4}),
    ("a single integer", {"type": "integer", "minimum": 1, "maximum": 10}),
    ("a single word", {"type": "string", "pattern": "^[A-Za-z]{1,12}$"}),
    ("an enum value", {"enum": ["north", "south", "east", "west"]}),
    (
        "a coordinate pair",
        {
            "type": "array",
            "prefixItems": [
                {"type": "number", "minimum": -90, "maximum": 90},
                {"type": "number", "minimum": -180, "maximum": 180},
            ],
            "items": False,
            "minItems": 2,
        },
    ),
    (
        "a version string",
        obj({"version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"}}),
    ),
    (
        "a rectangle",
        obj(
            {
                "width": {"type": "integer", "minimum": 1, "maximum": 100},
                "height": {"type": "integer", "minimum": 1, "maximum": 100},
            }
        ),
    ),
    (
        "an order",
        obj(
            {
                "id": {"type": "integer", "minimum": 1},
                "items": {
                    "type": "array",
                    "items": obj(
                        {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                        }
                    ),
                    "minItems": 1,
                    "maxItems": 2,
                },
            }
        ),
    ),
    (
        "a sentiment",
        obj(
            {
                "text": NAME,
                "sentiment": {"enum": ["positive", "negative", "neutral"]},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
            }
        ),
    ),
    ("a language", obj({"language": NAME, "iso": {"type": "string", "pattern": "^[a-z]{2}$"}})),
    (
        "a settings object",
        obj(
            {
                "theme": {"enum": ["light", "dark"]},
                "font_size": {"type": "integer", "minimum": 8, "maximum": 32},
                "notifications": {"type": "boolean"},
            }
        ),
    ),
    (
        "a review",
        obj(
            {
                "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                "comment": {"type": "string", "maxLength": 60},
            }
        ),
    ),
    (
        "a timer",
        obj(
            {
                "hours": {"type": "integer", "minimum": 0, "maximum": 23},
                "minutes": {"type": "integer", "minimum": 0, "maximum": 59},
            }
        ),
    ),
    (
        "a pet with optional fields",
        obj(
            {
                "name": NAME,
                "species": {"enum": ["dog", "cat", "bird"]},
                "age": {"type": "integer", "minimum": 0, "maximum": 30},
                "vaccinated": {"type": "boolean"},
            },
            ["name", "species"],
        ),
    ),
    (
        "a matrix",
        obj(
            {
                "rows": {
                    "type": "array",
                    "items": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0, "maximum": 9},
                        "minItems": 2,
                        "maxItems": 2,
                    },
                    "minItems": 2,
                    "maxItems": 2,
                }
            }
        ),
    ),
    (
        "an invoice total",
        obj(
            {
                "currency": {"enum": ["EUR", "USD"]},
                "total": {"type": "number", "minimum": 0, "maximum": 100000},
            }
        ),
    ),
    (
        "a flight",
        obj(
            {
                "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "seats": {"type": "integer", "minimum": 1, "maximum": 9},
            }
        ),
    ),
]
VARIANTS = {
    "greedy": DecodingOptions(max_new_tokens=160),
    "sampling": DecodingOptions(max_new_tokens=160, sampling=True, temperature=0.7, seed=11),
    "beam": DecodingOptions(max_new_tokens=160, beam_size=2),
}


def test_there_are_fifty_schemas_and_each_is_valid() -> None:
    assert len(SCHEMAS) == 50
    for _, schema in SCHEMAS:
        jsonschema.validators.validator_for(schema).check_schema(schema)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_answer_validates_against_its_schema(smollm2_dir: Path, variant: str) -> None:
    tokenizer = TextTokenizer.load(smollm2_dir)
    backend = TorchLMBackend.from_dir(smollm2_dir, stop_ids=tokenizer.stop_ids)
    vocabulary = Vocabulary(
        tokenizer.tokenizer.to_str(), sorted(backend.spec.stops), backend.spec.vocab_size
    )
    scheduler = Scheduler(backend, SchedulerLimits(max_new_tokens=160, max_batch_rows=256))
    requests = []
    for i, (what, schema) in enumerate(SCHEMAS):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        prompt = tokenizer.encode_chat(
            [
                {
                    "role": "user",
                    "content": f"Reply with JSON for {what}. Schema: {json.dumps(schema)}",
                }
            ]
        )
        request = lm_request(
            f"s{i}", prompt, VARIANTS[variant], constraint=vocabulary.compile(grammar)
        )
        scheduler.submit(request)
        requests.append(request)
    while scheduler.has_work:
        scheduler.step()
    for request, (what, schema) in zip(requests, SCHEMAS, strict=True):
        assert request.outcome is Outcome.DONE, (what, request.error)
        best = request.hypotheses[0]
        text = tokenizer.decode(best.tokens)
        assert best.ended_with_eos, (what, text)
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
