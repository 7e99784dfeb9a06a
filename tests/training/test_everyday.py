"""The fixed everyday sentences (attnserve/training/everyday.py): twenty, ten a direction, every
topic the issue names in both, and a table that shows each output as it came."""

from __future__ import annotations

from attnserve.training.everyday import EVERYDAY, Example, examples, markdown

TOPICS = {"directions", "shopping", "work", "travel", "weather", "computers"}


def test_twenty_sentences_ten_a_direction_every_topic_in_both() -> None:
    assert len(EVERYDAY) == 20
    assert len({e.source for e in EVERYDAY}) == 20  # no sentence twice
    for source_lang, target_lang in (("en", "de"), ("de", "en")):
        these = examples(source_lang, target_lang)
        assert len(these) == 10
        assert {e.topic for e in these} == TOPICS
        assert all(e.source.strip() and e.reference.strip() for e in these)
    # the issue's own examples are in the list
    sources = {e.source for e in EVERYDAY}
    assert {
        "The meeting has been moved to Tuesday afternoon.",
        "Could you send me the report by Friday?",
        "Der Zug nach Berlin fällt heute aus.",
        "Ich suche eine Apotheke in der Nähe.",
    } <= sources


def test_the_table_keeps_every_output_as_it_came() -> None:
    rows = [
        (Example("en", "de", "work", "a | b", "c"), "x | y"),
        (Example("de", "en", "work", "d", "e"), "line\nbreak"),
    ]
    table = markdown(rows).splitlines()
    assert table[0] == "| # | direction | source | translation | reference |"
    assert table[2] == "| 1 | en->de | a \\| b | x \\| y | c |"
    assert table[3] == "| 2 | de->en | d | line break | e |"
