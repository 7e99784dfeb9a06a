"""Documents: units are spans of the text, everything else comes back verbatim."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnserve.text.document import Document, UnitTooLong, split_document, whole
from attnserve.text.segment import default_segmenter


def test_whitespace_and_paragraphs_round_trip() -> None:
    text = "  First one. Second one!\n\n\tThird?  \r\n- a list item\n"
    doc = split_document(text, default_segmenter(), "en")
    assert doc.units == ["First one.", "Second one!", "Third?", "- a list item"]
    assert doc.join(doc.units) == text
    upper = doc.join([u.upper() for u in doc.units])
    assert upper == "  FIRST ONE. SECOND ONE!\n\n\tTHIRD?  \r\n- A LIST ITEM\n"


def test_whole() -> None:
    assert whole("  one. two.\n").units == ["one. two."]
    assert whole(" \n ").spans == ()


def test_long_sentence_cut_at_clauses_then_words() -> None:
    text = "alpha beta, gamma delta; epsilon zeta eta theta iota kappa lambda mu."
    doc = split_document(text, default_segmenter(), "en", fits=lambda u: len(u.split()) <= 3)
    assert doc.units == [
        "alpha beta,", "gamma delta;", "epsilon zeta eta", "theta iota kappa", "lambda mu.",
    ]  # fmt: skip
    assert all(len(u.split()) <= 3 for u in doc.units)
    assert doc.join(doc.units) == text


def test_a_word_longer_than_the_limit_is_cut_not_dropped() -> None:
    text = "a " + "x" * 25
    doc = split_document(text, default_segmenter(), "en", fits=lambda u: len(u) < 10)
    assert doc.units == ["a", "x" * 9, "x" * 9, "x" * 7]
    with pytest.raises(UnitTooLong):
        split_document(text, default_segmenter(), "en", fits=lambda u: False)


@given(st.text(alphabet=st.sampled_from(list("ab .!?,\n\t")), max_size=60))
def test_join_of_units_is_the_text(text: str) -> None:
    doc = split_document(text, default_segmenter(), "en", fits=lambda u: len(u) <= 12)
    assert doc.join(doc.units) == text
    assert all(u == u.strip() and u for u in doc.units)
    assert all(b <= c for (_, b), (c, _) in zip(doc.spans, doc.spans[1:], strict=False))
    assert all(not gap.strip() for gap in doc.gaps())  # no text is left untranslated


def test_join_checks_the_count() -> None:
    with pytest.raises(ValueError):
        Document("a. b.", ((0, 2), (3, 5))).join(["x"])


@pytest.mark.parametrize(
    ("line", "language", "units"),
    [
        ("1. Open the box. 2. Remove the device.", "en",
         ["1. Open the box.", "2. Remove the device."]),
        ("Dr. Müller kommt um 10 Uhr. Er bringt z. B. Äpfel mit.", "de",
         ["Dr. Müller kommt um 10 Uhr.", "Er bringt z. B. Äpfel mit."]),
        ("Am 1. Januar beginnt das Jahr. Wir feiern.", "de",
         ["Am 1. Januar beginnt das Jahr.", "Wir feiern."]),
        ("It costs $3.50, e.g. at the U.S. store. Really?", "en",
         ["It costs $3.50, e.g. at the U.S. store.", "Really?"]),
    ],
)  # fmt: skip
def test_sentences_of_everyday_text(line: str, language: str, units: list[str]) -> None:
    assert split_document(line, default_segmenter(), language).units == units


def test_a_sentence_longer_than_preferred_is_cut_at_clauses_only() -> None:
    text = "alpha beta, gamma delta; epsilon zeta eta theta. iota kappa lambda mu nu xi."
    doc = split_document(
        text, default_segmenter(), "en", fits=lambda u: len(u.split()) <= 8,
        prefer=lambda u: len(u.split()) <= 3,
    )  # fmt: skip
    # clauses are packed by the preference; a clause or clause-less sentence longer than it
    # stays whole while the model takes it
    assert doc.units == [
        "alpha beta,", "gamma delta;", "epsilon zeta eta theta.", "iota kappa lambda mu nu xi.",
    ]  # fmt: skip
    assert doc.join(doc.units) == text
