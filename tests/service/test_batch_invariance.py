"""Through a real server on the int8 variant, a request's answer does not depend on its batch.

N requests sent one by one, the same N at once, and the same N joining a batch that is already
decoding a long request give identical texts and token ids. int8 activations are quantized per
row, so no other request can change a row's scales or its integer products. Scores agree to
1e-4 per output token, not bit for bit: attention sums run over the batch's padded width, which
moves a row's values by float rounding (~1e-7), and a value that lands on a quantization step's
edge can round the other way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import SYLLABLES, make_sentences
from tests.service.helpers import LiveServer, make_settings

TEXTS = make_sentences(23, SYLLABLES, n=8)
LONG = make_sentences(5, SYLLABLES, n=1)[0]
LONG_DECODE = {"max_new_tokens": 48, "min_new_tokens": 40}  # decodes for 40+ steps
PER_TOKEN = 1e-4  # score tolerance per output token (see above)
MODES: dict[str, dict[str, Any]] = {
    "greedy": {"beam_size": 1},
    "beam4": {"beam_size": 4, "num_hypotheses": 2},
    "sampling": {"sampling": True, "temperature": 1.3, "top_k": 30},
}


@pytest.fixture(scope="module")
def int8_server(model_dir: Path) -> Iterator[LiveServer]:
    with LiveServer(make_settings(model_dir, variant="int8", max_batch_rows=64)) as server:
        yield server


def answer(server: LiveServer, text: str, mode: str, seed: int, **extra: Any) -> dict[str, Any]:
    body = {"text": text, "target_lang": "de", "return_scores": True, "seed": seed}
    body |= MODES[mode] | extra
    response = httpx.post(server.url + "/v1/generate", json=body, timeout=120.0)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()["translations"][0]
    return out


def same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert [x["text"] for x in a] == [y["text"] for y in b]
    assert [x["token_ids"] for x in a] == [y["token_ids"] for y in b]
    for x, y in zip(a, b, strict=True):
        tolerance = PER_TOKEN * max(y["output_tokens"], 1)
        assert x["score"] == pytest.approx(y["score"], rel=0, abs=tolerance)
        got, want = x.get("hypotheses") or [], y.get("hypotheses") or []
        assert [h["text"] for h in got] == [h["text"] for h in want]
        for h, w in zip(got, want, strict=True):
            assert h["score"] == pytest.approx(w["score"], rel=0, abs=tolerance)


@pytest.mark.parametrize("mode", list(MODES))
def test_one_by_one_at_once_and_joining_mid_way_agree(int8_server: LiveServer, mode: str) -> None:
    numbered = list(enumerate(TEXTS))  # (seed, text)
    alone = [answer(int8_server, t, mode, seed=i) for i, t in numbered]
    with ThreadPoolExecutor(len(TEXTS)) as pool:
        together = list(
            pool.map(lambda it: answer(int8_server, it[1], mode, it[0]), enumerate(TEXTS))
        )
    same(together, alone)

    # A long request decodes first; the others join its batch a few steps in.
    long_answer: dict[str, Any] = {}

    def long_request() -> None:
        long_answer.update(answer(int8_server, LONG, "beam4", seed=99, **LONG_DECODE))

    runner = threading.Thread(target=long_request)
    runner.start()
    time.sleep(0.05)
    with ThreadPoolExecutor(len(TEXTS)) as pool:
        joined = list(
            pool.map(lambda it: answer(int8_server, it[1], mode, it[0]), enumerate(TEXTS))
        )
    runner.join(120)
    same(joined, alone)
    long_alone = answer(int8_server, LONG, "beam4", seed=99, **LONG_DECODE)
    same([long_answer], [long_alone])


@pytest.mark.parametrize("mode", list(MODES))
def test_a_document_is_its_sentences_alone_in_every_mode(
    int8_server: LiveServer, mode: str
) -> None:
    sentences = [f"{t.capitalize()}." for t in TEXTS[:5]]
    alone = [answer(int8_server, s, mode, seed=7) for s in sentences]
    document = f"{sentences[0]} {sentences[1]}\n\n{sentences[2]}  {sentences[3]}\n{sentences[4]}"
    with ThreadPoolExecutor(3) as pool:  # beside other requests
        others = [pool.submit(answer, int8_server, t, mode, seed=1) for t in TEXTS[5:7]]
        doc = answer(int8_server, document, mode, seed=7)
        [f.result() for f in others]
    parts = doc["sentences"]
    assert [p["text"] for p in parts] == [a["text"] for a in alone]
    assert doc["token_ids"] == [t for a in alone for t in a["token_ids"]]
    tolerance = PER_TOKEN * max(doc["output_tokens"], 1)
    for part, one in zip(parts, alone, strict=True):
        assert part["score"] == pytest.approx(one["score"], rel=0, abs=tolerance)
    texts = [a["text"] for a in alone]
    assert doc["text"] == f"{texts[0]} {texts[1]}\n\n{texts[2]}  {texts[3]}\n{texts[4]}"
