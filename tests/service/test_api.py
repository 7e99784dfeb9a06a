"""The API against references: the offline Translator, non-streaming greedy, the tokenizer.

The shared server runs the fp32 graphs, the closest to the torch reference; the int8 variant's
batch invariance is tested through its own server in test_batch_invariance.py.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from attnserve.engine.options import DecodingOptions
from attnserve.engine.translator import Translator
from tests.conftest import SYLLABLES, make_sentences
from tests.service.helpers import LiveServer, make_settings, metric_value

TEXTS = make_sentences(11, SYLLABLES, n=12)
DESIGN_METRICS = [
    "requests_total",
    "request_duration_seconds",
    "queue_wait_seconds",
    "time_to_first_token_seconds",
    "time_per_output_token_seconds",
    "input_tokens_total",
    "output_tokens_total",
    "batch_rows",
    "decode_step_seconds",
    "requests_running",
    "requests_waiting",
    "rejected_total",
    "model_info",
]


@pytest.fixture(scope="module")
def translator(model_dir: Path) -> Translator:
    return Translator.from_model_dir(
        model_dir, backend="onnx", variant="fp32", provider="cpu", threads=1
    )


def post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60.0)


def sse_events(response: httpx.Response) -> list[Any]:
    events = []
    for block in response.text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.mark.parametrize("beam_size", [None, 1], ids=["model-default-beam", "greedy"])
def test_concurrent_requests_match_offline_translator_one_by_one(
    live: LiveServer, translator: Translator, beam_size: int | None
) -> None:
    options = translator.defaults.replace(beam_size=beam_size or translator.defaults.beam_size)
    expected = [translator.translate([t], options, target_lang="de")[0] for t in TEXTS]
    extra = {} if beam_size is None else {"beam_size": beam_size}
    bodies = [{"text": t, "target_lang": "de", "return_scores": True, **extra} for t in TEXTS[:8]]
    bodies.append({"text": TEXTS[8:], "target_lang": "de", "return_scores": True, **extra})
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda b: post(live, "/v1/translate", b), bodies))
    got = []
    for response in responses:
        assert response.status_code == 200, response.text
        got.extend(response.json()["translations"])
    assert [g["text"] for g in got] == [e.text for e in expected]
    assert [g["output_tokens"] for g in got] == [e.output_tokens for e in expected]
    assert [g["score"] for g in got] == pytest.approx([e.score for e in expected], rel=1e-4)
    assert isinstance(options, DecodingOptions)


@pytest.mark.parametrize(
    "limits",
    [
        {"batching": "continuous", "max_batch_rows": 8, "join_rows": 4, "max_join_steps": 3},
        {"batching": "continuous", "max_batch_rows": 12, "max_cohorts": 3, "max_join_padding": 0},
        {"batching": "request", "max_batch_rows": 8},
    ],
    ids=["continuous-saturated", "continuous-3-cohorts", "request-level"],
)
def test_saturated_batches_give_the_offline_outputs(
    model_dir: Path, translator: Translator, limits: dict[str, Any]
) -> None:
    """Twelve beam-4 requests through 8 or 12 rows: they queue, join in groups or start
    cohorts (continuous) or wait for the batch to end (request-level); every output is the
    one-by-one output."""
    settings = make_settings(model_dir, variant="fp32", **limits)
    expected = [translator.translate([t], target_lang="de")[0] for t in TEXTS]
    with LiveServer(settings) as server, ThreadPoolExecutor(len(TEXTS)) as pool:
        bodies = [{"text": t, "target_lang": "de", "beam_size": 4} for t in TEXTS]
        responses = list(pool.map(lambda b: post(server, "/v1/translate", b), bodies))
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        got = [r.json()["translations"][0]["text"] for r in responses]
    assert got == [e.text for e in expected]


def test_requests_that_share_an_x_request_id_get_their_own_answers(
    live: LiveServer, translator: Translator
) -> None:
    """A client's X-Request-ID names its request in the logs; two in flight may share one (a
    gateway's retries), and each must still get its own translation."""
    expected = [translator.translate([t], target_lang="de")[0].text for t in TEXTS[:8]]

    def send(text: str) -> httpx.Response:
        body = {"text": text, "target_lang": "de"}
        headers = {"X-Request-ID": "shared-id"}
        return httpx.post(live.url + "/v1/translate", json=body, headers=headers, timeout=60.0)

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(send, TEXTS[:8]))
    assert [r.status_code for r in responses] == [200] * 8
    assert [r.json()["translations"][0]["text"] for r in responses] == expected
    assert {r.headers["x-request-id"] for r in responses} == {"shared-id"}


def test_usage_and_response_shape(live: LiveServer, translator: Translator) -> None:
    response = post(live, "/v1/translate", {"text": TEXTS[:2], "target_lang": "de"})
    body = response.json()
    assert body["model"] == live.service.registry.default.name
    assert set(body["translations"][0]) == {"text", "output_tokens", "finish_reason"}
    sources = [translator.encode(t, "de") for t in TEXTS[:2]]
    assert body["usage"]["input_tokens"] == sum(len(s) for s in sources)
    assert body["usage"]["output_tokens"] == sum(t["output_tokens"] for t in body["translations"])


def test_streaming_yields_the_tokens_of_non_streaming_greedy(live: LiveServer) -> None:
    for text in TEXTS[:4]:
        body = {"text": text, "target_lang": "de", "max_new_tokens": 20}
        plain = post(live, "/v1/generate", body).json()["translations"][0]
        with httpx.stream(
            "POST", live.url + "/v1/generate", json={**body, "stream": True}, timeout=60
        ) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            response.read()
        events = sse_events(response)
        assert events[-1] == "[DONE]"
        final, tokens = events[-2], events[:-2]
        assert [e["token_id"] for e in tokens] == plain["token_ids"]
        assert [e["index"] for e in tokens] == list(range(len(tokens)))
        assert "".join(e["text"] for e in tokens) == final["text"] == plain["text"]
        assert final["output_tokens"] == plain["output_tokens"]
        assert final["finish_reason"] == plain["finish_reason"]


def test_sampling_with_a_seed_is_reproducible(live: LiveServer) -> None:
    body = {"text": TEXTS[0], "target_lang": "de", "sampling": True, "temperature": 1.5}
    body |= {"top_k": 20, "seed": 3}
    first, second = (post(live, "/v1/generate", body).json() for _ in range(2))
    assert first["translations"][0]["token_ids"] == second["translations"][0]["token_ids"]


def test_n_best_list(live: LiveServer) -> None:
    body = {"text": TEXTS[1], "target_lang": "nl", "beam_size": 4, "num_hypotheses": 3}
    body["return_scores"] = True
    translation = post(live, "/v1/translate", body).json()["translations"][0]
    scores = [h["score"] for h in translation["hypotheses"]]
    assert len(scores) == 3 and scores == sorted(scores, reverse=True)
    assert translation["hypotheses"][0]["text"] == translation["text"]
    assert translation["score"] == scores[0]


def test_models_health_and_readiness(live: LiveServer, model_dir: Path) -> None:
    listing = httpx.get(live.url + "/v1/models").json()
    assert listing["object"] == "list"
    models = listing["data"]
    assert [(m["id"], m["object"], m["owned_by"]) for m in models] == [
        (model_dir.name, "model", "attnserve")
    ]
    assert models[0]["default"] and models[0]["variant"] == "fp32"
    assert models[0]["target_languages"] == ["de", "nl"]
    assert httpx.get(live.url + "/healthz").json() == {"status": "ok", "detail": None}
    ready = httpx.get(live.url + "/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"


def test_request_ids(live: LiveServer) -> None:
    given = httpx.get(live.url + "/v1/models", headers={"X-Request-ID": "trace-42"})
    assert given.headers["x-request-id"] == "trace-42"
    generated = httpx.get(live.url + "/v1/models").headers["x-request-id"]
    assert len(generated) == 32
    bad = httpx.get(live.url + "/v1/models", headers={"X-Request-ID": "no spaces allowed"})
    assert bad.headers["x-request-id"] != "no spaces allowed"
    error = post(live, "/v1/translate", {"text": ""})
    assert error.json()["error"]["request_id"] == error.headers["x-request-id"]


def test_metrics_names_and_counts(live: LiveServer, model_dir: Path) -> None:
    post(live, "/v1/translate", {"text": TEXTS[0], "target_lang": "de"})
    text = live.metrics()
    for name in DESIGN_METRICS:
        assert f"# TYPE attnserve_{name} " in text, name
    labels = {"model": model_dir.name, "variant": "fp32", "provider": "CPUExecutionProvider"}
    assert metric_value(text, "attnserve_model_info", **labels) == 1.0
    assert metric_value(text, "attnserve_requests_total", route="/v1/translate", status="200") > 0
    assert metric_value(text, "attnserve_output_tokens_total", model=model_dir.name) > 0
    assert metric_value(text, "attnserve_batch_rows_count", model=model_dir.name) > 0


def test_openapi_has_examples(live: LiveServer) -> None:
    schema = httpx.get(live.url + "/openapi.json").json()
    translate = schema["components"]["schemas"]["TranslateRequest"]
    assert translate["examples"] and translate["additionalProperties"] is False
    assert httpx.get(live.url + "/docs").status_code == 200
    # every route that streams with stream=true documents both of its 200 answers
    for path in ("/v1/generate", "/v1/completions", "/v1/chat/completions"):
        content = schema["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}, path


def test_two_models_are_served_and_chosen_by_name(model_dir: Path, tmp_path: Path) -> None:
    """The first model is the default; `model` picks another; a server-wide default timeout
    applies when a request gives none."""
    second = tmp_path / "second-model"
    shutil.copytree(model_dir, second)
    settings = make_settings(model_dir, variant="fp32", default_timeout_ms=60_000)
    settings = settings.model_copy(update={"models": [str(model_dir), str(second)]})
    body = {"text": TEXTS[0], "target_lang": "de", "beam_size": 1}
    with LiveServer(settings) as server:
        models = httpx.get(server.url + "/v1/models").json()["data"]
        assert [(m["id"], m["default"]) for m in models] == [
            (model_dir.name, True),
            ("second-model", False),
        ]
        default = post(server, "/v1/translate", body).json()
        chosen = post(server, "/v1/translate", {**body, "model": "second-model"}).json()
    assert default["model"] == model_dir.name and chosen["model"] == "second-model"
    assert chosen["translations"] == default["translations"]  # the same weights


def test_the_default_timeout_applies_when_a_request_gives_none(model_dir: Path) -> None:
    settings = make_settings(model_dir, variant="fp32", default_timeout_ms=1)
    body = {"text": TEXTS[0], "target_lang": "de", "min_new_tokens": 40, "max_new_tokens": 40}
    with LiveServer(settings) as server:
        late = post(server, "/v1/generate", body)
        assert late.status_code == 504, late.text
        assert late.json()["error"]["type"] == "deadline_exceeded"
        assert post(server, "/v1/generate", {**body, "timeout_ms": 60_000}).status_code == 200
