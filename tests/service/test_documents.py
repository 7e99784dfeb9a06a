"""Documents through the native and OpenAI routes: a text of N sentences is the N sentences
sent alone (tokens and scores), in the source's layout; html keeps its tags; long sentences are
cut, never truncated; source_lang auto."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from attnserve.text.document import split_document
from attnserve.text.segment import default_segmenter
from tests.conftest import SYLLABLES, make_sentences
from tests.service.helpers import LiveServer
from tests.service.test_api import post, sse_events
from tests.text.test_markup import tags_of

WORDS = make_sentences(23, SYLLABLES, n=8)
SENTENCES = [f"{w.capitalize()}{'.!?'[i % 3]}" for i, w in enumerate(WORDS)]
DOCUMENT = f"{SENTENCES[0]} {SENTENCES[1]}\n\n  {SENTENCES[2]}  {SENTENCES[3]}\n{SENTENCES[4]}\t\n"


def translate(server: LiveServer, text: Any, **fields: Any) -> dict[str, Any]:
    body = {"text": text, "target_lang": "de", "return_scores": True, **fields}
    response = post(server, "/v1/generate", body)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def test_a_document_is_its_sentences_alone(live: LiveServer) -> None:
    units = split_document(DOCUMENT, default_segmenter(), "en").units
    assert units == SENTENCES[:5]
    alone = translate(live, units)["translations"]
    with ThreadPoolExecutor(4) as pool:  # batched with other requests
        others = [pool.submit(translate, live, SENTENCES[5:]) for _ in range(3)]
        (doc,) = translate(live, DOCUMENT)["translations"]
        [f.result() for f in others]
    assert [s["text"] for s in doc["sentences"]] == [a["text"] for a in alone]
    # fp32 products are not batch-invariant in their last bits (the int8 server's are:
    # test_batch_invariance.py); the tokens are the same
    scores = [a["score"] for a in alone]
    assert [s["score"] for s in doc["sentences"]] == pytest.approx(scores, rel=1e-6)
    assert doc["token_ids"] == [t for a in alone for t in a["token_ids"]]
    expected = split_document(DOCUMENT, default_segmenter(), "en").join([a["text"] for a in alone])
    assert doc["text"] == expected  # whitespace, line and paragraph breaks as sent
    assert doc["score"] == pytest.approx(sum(scores) / len(scores), rel=1e-6)
    assert doc["output_tokens"] == sum(a["output_tokens"] for a in alone)


def test_split_sentences_false_is_one_unit(live: LiveServer) -> None:
    text = f" {SENTENCES[0]}\n{SENTENCES[1]} "
    (doc,) = translate(live, text, split_sentences=False)["translations"]
    (alone,) = translate(live, text.strip(), split_sentences=False)["translations"]
    assert doc["token_ids"] == alone["token_ids"]
    assert "sentences" not in doc


def test_nbest_of_a_document_joins_its_sentences(live: LiveServer) -> None:
    text = f"{SENTENCES[0]} {SENTENCES[1]}"
    (doc,) = translate(live, text, beam_size=3, num_hypotheses=2)["translations"]
    alone = translate(live, SENTENCES[:2], beam_size=3, num_hypotheses=2)["translations"]
    for k in range(2):
        joined = " ".join(a["hypotheses"][k]["text"] for a in alone)
        assert doc["hypotheses"][k]["text"] == joined
    texts = [[h["text"] for h in s["hypotheses"]] for s in doc["sentences"]]
    assert texts == [[h["text"] for h in a["hypotheses"]] for a in alone]


def test_a_sentence_over_the_source_limit_is_cut_not_truncated(live: LiveServer) -> None:
    long = " ".join(["kamaru tesino,"] * 30) + " kamaru."  # well over 64 positions
    (doc,) = translate(live, long)["translations"]
    sources = [s["source"] for s in doc["sentences"]]
    assert len(sources) > 1
    assert " ".join(sources) == long  # every word translated, in order


def test_html_keeps_every_tag(live: LiveServer) -> None:
    source = (
        f'<div class="a"><p>{SENTENCES[0]} <b>{WORDS[1]}</b> {SENTENCES[2]}</p>'
        f'<p title="t">{SENTENCES[3]}<br>{SENTENCES[4]}</p><pre>{WORDS[5]}</pre></div>'
    )
    (doc,) = translate(live, source, format="html")["translations"]
    assert tags_of(doc["text"]) == tags_of(source)
    assert f"<pre>{WORDS[5]}</pre>" in doc["text"]
    # plain text is never parsed as markup
    (plain,) = translate(live, "<b>kamaru</b>")["translations"]
    (alone,) = translate(live, "<b>kamaru</b>", split_sentences=False)["translations"]
    assert plain["text"] == alone["text"]


def test_a_document_streams_sentence_by_sentence(live: LiveServer) -> None:
    body = {"text": DOCUMENT, "target_lang": "de", "stream": True}
    events = sse_events(post(live, "/v1/generate", body))
    assert events[-1] == "[DONE]"
    final = events[-2]
    deltas = events[:-2]
    assert "".join(e["text"] for e in deltas) == final["text"]
    (doc,) = translate(live, DOCUMENT, beam_size=1)["translations"]
    assert final["text"] == doc["text"]
    assert any(e["token_id"] is None and "\n\n" in e["text"] for e in deltas)


def test_completions_translate_documents(live: LiveServer) -> None:
    body = {"model": "opus-mt-tiny", "prompt": DOCUMENT, "target_lang": "de", "temperature": 0}
    response = post(live, "/v1/completions", body)
    assert response.status_code == 200, response.text
    native = post(live, "/v1/translate", {"text": DOCUMENT, "target_lang": "de"})
    assert response.json()["choices"][0]["text"] == native.json()["translations"][0]["text"]


def test_auto_source_language(live: LiveServer) -> None:
    english = "The meeting has been moved to Tuesday afternoon. Please tell everyone."
    (doc,) = translate(live, english, source_lang="auto")["translations"]
    assert doc["detected_language"]["language"] == "en"
    assert 0.5 < doc["detected_language"]["confidence"] <= 1.0
    german = "Der Zug nach Berlin fällt heute leider aus, sagte der Schaffner."
    response = post(
        live, "/v1/translate", {"text": german, "source_lang": "auto", "target_lang": "de"}
    )
    assert response.status_code == 400
    assert "'de'" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"text": "<p> </p><br>", "format": "html"}, 422, "only markup"),
        ({"text": "<div>unclosed", "format": "html"}, 422, "never closed"),
        ({"text": "kamaru. tesino.", "target_lang": "xx"}, 422, "xx"),
        ({"text": "<b>a</b>", "format": "xml"}, 422, "format"),
        ({"text": "kamaru. " * 600}, 422, "sentences to translate"),
        ({"text": "3 4 5 !!", "source_lang": "auto"}, 400, "language"),
    ],
)
def test_bad_documents(live: LiveServer, body: dict[str, Any], status: int, words: str) -> None:
    response = post(live, "/v1/translate", {"target_lang": "de", **body})
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]


def test_a_megabyte_of_text_is_refused_quickly(live: LiveServer) -> None:
    body = {"text": "Kamaru tesino. " * 70_000, "target_lang": "de"}
    response = httpx.post(live.url + "/v1/translate", json=body, timeout=10.0)
    assert response.status_code == 413


def test_a_huge_word_or_many_sentences_are_answered_quickly(live: LiveServer) -> None:
    import time

    # under the test server's 64 KB body limit: a 60 KB "word" is cut into pieces the model
    # takes (translated, or a 422 if there are more than the sentence limit), 15,000 sentences
    # are a 422 found while splitting; neither takes long
    for text, statuses in [("kamarutesino" * 5_000, (200, 422)), ("Ka. " * 15_000, (422,))]:
        began = time.perf_counter()
        response = post(live, "/v1/translate", {"text": text, "target_lang": "de"})
        assert response.status_code in statuses, response.text[:200]
        if response.status_code == 422:
            assert "sentences" in response.json()["error"]["message"]
        assert time.perf_counter() - began < 30.0


def test_html_with_images_comments_and_breaks_inside_inline_elements(live: LiveServer) -> None:
    source = (
        '<p><a href="/">Home <img src="x.png"> page</a> and <b>bold <!-- c --> text</b>.</p>'
        '<p><b>line<br>next</b></p><a href="/"><div>card</div></a>'
    )
    (doc,) = translate(live, source, format="html")["translations"]
    assert tags_of(doc["text"]) == tags_of(source)
    assert '<img src="x.png">' in doc["text"] and "<!-- c -->" in doc["text"]


def test_a_two_way_model_refuses_a_source_language_it_does_not_read() -> None:
    """The default model reads English and German: a source_lang of another language is the
    client's 422 (as LibreTranslate's /translate answers it), not a translation of the text
    read as English or German."""
    from types import SimpleNamespace

    from attnserve.defaults import default_model_dir
    from attnserve.model.tokenizer import Tokenizer
    from attnserve.service.decoding import check_languages
    from attnserve.service.errors import ApiError
    from attnserve.service.schemas import TranslateRequest

    model: Any = SimpleNamespace(name="ende-small", tokenizer=Tokenizer.load(default_model_dir()))
    for source in ("de", "DE", "deu", "auto"):
        body = TranslateRequest(text="Guten Tag.", source_lang=source, target_lang="en")
        check_languages(body, ["Guten Tag."], model)
    for source in ("fr", "xx", "\u0000\n"):
        body = TranslateRequest(text="Guten Tag.", source_lang=source, target_lang="en")
        with pytest.raises(ApiError) as refused:
            check_languages(body, ["Guten Tag."], model)
        assert refused.value.status == 422 and refused.value.param == "source_lang"
        assert "'de', 'en'" in refused.value.message or "'en', 'de'" in refused.value.message
