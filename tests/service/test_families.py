"""NLLB-style and T5 models served beside the Marian one: languages by code or ISO name, T5's
task prefixes, one running batch decoding into several target languages and across families,
each request answered as it is alone.

The NLLB and T5 directories are built and imported here (tiny random weights, tokenizers trained
in the test, the families' language codes and task prefixes), then exported to int8 by the
server's first start.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from attnserve.convert import import_model
from attnserve.model.tokenizer import Tokenizer
from tests.conftest import train_spm
from tests.convert.test_fairseq_tokenizer import hf_tokenizer, tiny_model, training_text
from tests.service.helpers import LiveServer, make_settings

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
TEXTS = training_text()[:6]


@pytest.fixture(scope="module")
def nllb_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny NLLB-style model imported into a model directory named `nllb`."""
    spm_model = train_spm(
        training_text(), 400, model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1
    )
    hf_dir = tmp_path_factory.mktemp("hf") / "nllb-hf"
    hf_tokenizer("nllb", hf_dir, spm_model)
    vocab = max(Tokenizer.from_fairseq(hf_dir).max_ids) + 4
    tiny_model("nllb", vocab).save_pretrained(hf_dir)
    out = tmp_path_factory.mktemp("served") / "nllb"
    import_model(hf_dir, out)
    return out


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny T5 v1.1 with translation prefixes, imported into a directory named `t5`. Its
    weights are drawn small enough for int8 to pass the export gate (at std 0.2 the tiny
    random model's unscaled attention saturates: top-1 agreement 0.71)."""
    from tests.convert.test_t5 import write_t5_dir

    hf_dir = tmp_path_factory.mktemp("hf") / "t5-hf"
    write_t5_dir(hf_dir, std=0.1)
    out = tmp_path_factory.mktemp("served") / "t5"
    import_model(hf_dir, out)
    return out


@pytest.fixture(scope="module")
def madlad_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny T5 whose targets are MADLAD-400's `<2xx>` tokens, in a directory named `madlad`."""
    from tests.convert.test_t5 import write_t5_dir

    hf_dir = tmp_path_factory.mktemp("hf") / "madlad-hf"
    write_t5_dir(hf_dir, std=0.1, language_tags=("<2de>", "<2fr>"))
    out = tmp_path_factory.mktemp("served") / "madlad"
    import_model(hf_dir, out)
    return out


@pytest.fixture(scope="module")
def server(
    nllb_dir: Path,
    t5_dir: Path,
    madlad_dir: Path,
    model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LiveServer]:
    from attnserve.service.launch import check_models

    marian = tmp_path_factory.mktemp("served") / "marian"
    shutil.copytree(model_dir, marian)
    models = [str(marian), str(nllb_dir), str(t5_dir), str(madlad_dir)]
    settings = make_settings(marian, models=models, variant="int8", max_batch_rows=64)
    check_models(settings)  # exports the NLLB model's int8 graphs (as `attnserve serve`)
    with LiveServer(settings) as live:
        yield live


def translate(server: LiveServer, text: str | list[str], **fields: Any) -> httpx.Response:
    body = {"model": "nllb", "text": text, "beam_size": 3, "return_scores": True}
    body |= {"max_new_tokens": 12} | fields
    return httpx.post(server.url + "/v1/translate", json=body, timeout=120.0)


def ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()["translations"][0]
    return out


def test_models_list_the_languages(server: LiveServer) -> None:
    entries = httpx.get(server.url + "/v1/models").json()["data"]
    nllb = next(e for e in entries if e["id"] == "nllb")
    assert {"eng_Latn", "deu_Latn", "zho_Hans"} <= set(nllb["target_languages"])
    assert nllb["source_lang"] == "eng_Latn"
    t5 = next(e for e in entries if e["id"] == "t5")
    assert t5["target_languages"] == ["de", "fr"] and t5["source_lang"] == "en"


def test_t5_takes_its_task_prefix_from_the_target_language(server: LiveServer) -> None:
    by_language = ok(translate(server, TEXTS[0], model="t5", target_lang="de"))
    in_the_text = ok(translate(server, "translate English to German: " + TEXTS[0], model="t5"))
    assert by_language == in_the_text
    french = ok(translate(server, TEXTS[0], model="t5", target_lang="fr"))
    assert french["text"] != by_language["text"] or french["score"] != by_language["score"]
    response = translate(server, TEXTS[0], model="t5", target_lang="ro")
    assert response.status_code == 422 and response.json()["error"]["param"] == "target_lang"


def test_a_language_token_typed_in_the_text_names_the_target(server: LiveServer) -> None:
    """Marian's `>>de<<` and MADLAD-400's `<2de>` at the start of a text stand for target_lang;
    a multi-target model's text that names no target, or an unknown one, is a 422."""
    for model, token in (("marian", ">>de<<"), ("madlad", "<2de>")):
        typed = ok(translate(server, f"{token} {TEXTS[2]}", model=model))
        assert typed == ok(translate(server, TEXTS[2], model=model, target_lang="de")), model
        response = translate(server, TEXTS[2], model=model)
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["param"] == "target_lang" and f"({token}, ...)" in error["message"]
        unknown = token.replace("de", "ro")
        response = translate(server, [f"{token} {TEXTS[1]}", f"{unknown} {TEXTS[2]}"], model=model)
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert (
            error["param"] == "text" and "text[1]: unknown target language 'ro'" in error["message"]
        )


def test_a_single_source_model_takes_its_language_by_any_name(server: LiveServer) -> None:
    german = ok(translate(server, TEXTS[0], model="t5", target_lang="de"))
    for name in ("en", "EN", "eng", "eng_Latn"):
        assert (
            ok(translate(server, TEXTS[0], model="t5", target_lang="de", source_lang=name))
            == german
        )
    response = translate(server, TEXTS[0], model="t5", target_lang="de", source_lang="fra")
    assert response.status_code == 422 and response.json()["error"]["param"] == "source_lang"


def test_iso_names_and_codes_give_the_same_answer(server: LiveServer) -> None:
    a = ok(translate(server, TEXTS[0], target_lang="de", source_lang="en"))
    b = ok(translate(server, TEXTS[0], target_lang="deu_Latn", source_lang="eng_Latn"))
    c = ok(translate(server, TEXTS[0], target_lang="de"))  # the tokenizer's source: eng_Latn
    assert a == b == c
    other = ok(translate(server, TEXTS[0], target_lang="fr"))
    assert other["text"] != a["text"] or other["score"] != a["score"]


def test_one_batch_decodes_into_several_languages(server: LiveServer) -> None:
    jobs = [(text, lang) for text in TEXTS for lang in ("de", "fr", "zho_Hant")]
    alone = [ok(translate(server, text, target_lang=lang)) for text, lang in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda j: ok(translate(server, j[0], target_lang=j[1])), jobs))
    assert [t["text"] for t in together] == [t["text"] for t in alone]
    for got, want in zip(together, alone, strict=True):
        assert got["score"] == pytest.approx(
            want["score"], abs=1e-4 * max(want["output_tokens"], 1)
        )


def test_one_batch_mixes_families_and_streams(server: LiveServer) -> None:
    """Marian, NLLB and T5 requests (beam and greedy streams) at once: each answer is the one
    it gets alone."""
    jobs: list[dict[str, Any]] = []
    for text in TEXTS[:3]:
        jobs.append({"model": "marian", "text": text, "target_lang": "de"})
        jobs.append({"model": "nllb", "text": text, "target_lang": "fr"})
        jobs.append({"model": "t5", "text": text, "target_lang": "de"})
        jobs.append({"model": "t5", "text": "summarize: " + text, "beam_size": 1})

    def run(job: dict[str, Any]) -> dict[str, Any]:
        if job.get("beam_size") == 1:  # streamed over SSE, greedy: the streamed text
            body = {"max_new_tokens": 12, "stream": True} | job
            with httpx.stream("POST", server.url + "/v1/generate", json=body, timeout=120) as r:
                assert r.status_code == 200
                events = [line for line in r.iter_lines() if line.startswith("data: ")]
            return {"events": events}
        return ok(translate(server, **job))

    alone = [run(job) for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(run, jobs))
    for got, want in zip(together, alone, strict=True):
        if "events" in want:
            assert got == want
            continue
        assert got["text"] == want["text"]
        tolerance = 1e-4 * max(want["output_tokens"], 1)
        assert got["score"] == pytest.approx(want["score"], abs=tolerance)


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"target_lang": "xx"}, "target_lang", "unknown language"),
        ({"target_lang": "zh"}, "target_lang", "ambiguous"),
        ({}, "target_lang", "give target_lang"),
        ({"target_lang": "de", "source_lang": "qq"}, "source_lang", "unknown language"),
    ],
)
def test_bad_languages_are_a_422(
    server: LiveServer, fields: dict[str, Any], param: str, message: str
) -> None:
    response = translate(server, TEXTS[0], **fields)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_openai_completions_take_the_languages(server: LiveServer) -> None:
    body = {"model": "nllb", "prompt": TEXTS[1], "target_lang": "de", "source_lang": "en"}
    body |= {"max_tokens": 12}
    body |= {"use_beam_search": True, "best_of": 3}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=120.0)
    assert response.status_code == 200, response.text
    assert (
        response.json()["choices"][0]["text"]
        == ok(translate(server, TEXTS[1], target_lang="de"))["text"]
    )
