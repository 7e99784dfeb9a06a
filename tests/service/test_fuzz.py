"""Property-based fuzzing of the OpenAPI schema (schemathesis) against the running server.

Valid and invalid requests for every operation: no 5xx, every response (status, content type,
body, headers) conforms to the schema, and schema-invalid requests are rejected.

Not checked: `positive_data_acceptance` (every schema-valid request is a 2xx). Some limits are
server settings or properties of the model and the text (texts per request, input tokens,
max_new_tokens, beam_size), and some rules cross fields (num_hypotheses <= beam_size, sampling
with beam_size 1): the schema cannot state them, so valid-looking requests get a documented 422.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.service.helpers import LiveServer

MAX_EXAMPLES = 150


@pytest.mark.slow
def test_openapi_schema_fuzzing(live: LiveServer) -> None:
    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    cases = st.one_of(
        schema.as_strategy(GenerationMode.POSITIVE),
        schema.as_strategy(GenerationMode.NEGATIVE),
    )

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases)
    def check(case: schemathesis.Case) -> None:
        case.call_and_validate(
            base_url=live.url, timeout=30, excluded_checks=[positive_data_acceptance]
        )

    check()
    assert 'status="500"' not in live.metrics()


@pytest.mark.slow
def test_openai_routes_fuzzed_against_a_language_model(both: LiveServer) -> None:
    """The OpenAI routes and vLLM's tokenizer routes with a language model served (the
    shared server above has only the translation model): valid and invalid bodies, no 5xx,
    answers as the schema says. The model is pinned to the language model so that generation
    (and its tokenizer) runs."""
    schema = schemathesis.openapi.from_url(f"{both.url}/openapi.json").include(
        path_regex=r"^(/v1/(chat/)?completions|/(de)?tokenize)$"
    )
    cases = st.one_of(
        schema.as_strategy(GenerationMode.POSITIVE),
        schema.as_strategy(GenerationMode.NEGATIVE),
    )

    @settings(
        max_examples=MAX_EXAMPLES // 2,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases)
    def check(case: schemathesis.Case) -> None:
        if isinstance(case.body, dict):
            # the deadline is not what is fuzzed here (1 ms is a documented 504)
            case.body = {**case.body, "model": "tiny-lm", "timeout_ms": 20_000}
            if isinstance(case.body.get("max_tokens"), int):
                case.body["max_tokens"] = min(case.body["max_tokens"], 16)
        case.call_and_validate(
            base_url=both.url, timeout=30, excluded_checks=[positive_data_acceptance]
        )

    check()
    assert 'status="500"' not in both.metrics()
