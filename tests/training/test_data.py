"""Corpus builder on a tiny bible.db and Ding file: joins, split by book, cleaning, dedup."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from attnserve.cli import main
from attnserve.training.data import Manifest, build_corpus, clean_verse, ding_pair
from attnserve.training.pairs import normalize
from tests.training.tiny_corpus import write_bible_db, write_synthetic_bible

ROWS = [
    # training book 1
    ("k", 1, 1, 1, "In the beginning God created the heaven and the earth."),
    ("4", 1, 1, 1, "In the beginning God created the heavens and the earth."),
    ("e", 1, 1, 1, "Im  Anfang schuf Gott die Himmel und die Erde. "),
    ("s", 1, 1, 1, "Im Anfang schuf Gott den Himmel und die Erde."),
    ("k", 1, 1, 2, "And God said, Let there be light."),
    ("4", 1, 1, 2, "God`s word: let there be light."),
    ("e", 1, 1, 2, "Und Gott sprach: Es werde Licht! *"),
    ("k", 1, 1, 3, "In the beginning God created the heaven and the earth."),  # duplicate
    ("e", 1, 1, 3, "Im Anfang schuf Gott die Himmel und die Erde."),
    ("k", 1, 1, 4, "Woe unto you, scribes and Pharisees, hypocrites!"),
    ("e", 1, 1, 4, "(*)"),  # empty after cleaning
    ("k", 1, 1, 5, "And the evening and the morning were the first day."),
    ("e", 1, 1, 5, "Ja."),  # badly length-mismatched
    ("k", 1, 1, 6, "Green is the grass."),
    ("e", 1, 1, 6, "Gru\u0308n ist das Gras."),  # decomposed ü -> NFC
    ("k", 19, 1, 1, "Blessed is the man!"),
    ("e", 19, 1, 1, "(Ein Psalm Davids.) Glückselig der Mann!"),  # superscription
    ("k", 19, 13, 1, "How long wilt thou forget me?"),
    ("e", 19, 13, 1, "(Dem Vorsänger. Ein Psalm von David.)"),  # Hebrew numbering: shifted
    ("k", 19, 13, 2, "How long shall I take counsel?"),
    ("e", 19, 13, 2, "Bis wann, Jehova, willst du meiner vergessen?"),
    # test book 8 (Ruth), dev book 31 (Obadiah)
    ("k", 8, 1, 1, "Ruth spoke."),
    ("e", 8, 1, 1, "Ruth sprach."),
    ("k", 8, 1, 2, "Naomi [wept]."),
    ("e", 8, 1, 2, "Noomi weinte [laut]."),
    ("k", 31, 1, 1, "Obadiah saw."),
    ("e", 31, 1, 1, "Obadja sah."),
    ("k", 31, 1, 2, "The vision."),
    ("e", 31, 1, 2, "   "),
]

DING = """\
# Version :: devel test
# License :: GPL Version 2 or later
Haus {n} | Das Haus ist groß. :: house | The house is big.
Sonnenbrand {m} [med.] | einen Sonnenbrand bekommen | Haben Sie etwas gegen Sonnenbrand? \
:: sunburn | to get a sunburn; to get sunburnt | Have you anything for sunburn?
abnehmen {vt} | er/sie nimmt ab :: to take off | he/she takes off
jdm. etw. geben | jdm. helfen :: to give sb. sth. | to help sb.
Da staunt der Laie [Sprw.]. :: The mind boggles.
kaputte Zeile ohne Trenner
a | b :: c
Das Haus ist groß. :: The house is big.
"""


@pytest.fixture()
def corpus(tmp_path: Path) -> tuple[Path, Manifest]:
    db = write_bible_db(tmp_path / "bible.db", ROWS)
    ding = tmp_path / "de-en"
    ding.write_text(DING, encoding="utf-8")
    out = tmp_path / "data"
    return out, build_corpus(out, bible_db=db, ding_path=ding)


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_training_pairs_are_joined_cleaned_and_deduplicated(corpus: tuple[Path, Manifest]) -> None:
    out, _ = corpus
    pairs = list(zip(lines(out / "train.en"), lines(out / "train.de"), strict=True))
    assert pairs == [
        ("In the beginning God created the heaven and the earth.",
         "Im Anfang schuf Gott die Himmel und die Erde."),
        ("And God said, Let there be light.", "Und Gott sprach: Es werde Licht!"),
        ("Green is the grass.", "Grün ist das Gras."),
        ("Blessed is the man!", "Glückselig der Mann!"),
        ("The house is big.", "Das Haus ist groß."),
        ("to get a sunburn", "einen Sonnenbrand bekommen"),
        ("Have you anything for sunburn?", "Haben Sie etwas gegen Sonnenbrand?"),
        ("The mind boggles.", "Da staunt der Laie."),
    ]  # fmt: skip
    assert "Grün" in lines(out / "train.de")[2] and len(lines(out / "train.de")[2]) == 18


def test_extra_pairing_is_a_one_direction_training_set(corpus: tuple[Path, Manifest]) -> None:
    out, manifest = corpus
    assert lines(out / "train.en-de.en") == [
        "In the beginning God created the heavens and the earth.",
        "God's word: let there be light.",
    ]
    assert lines(out / "train.en-de.de")[1] == "Und Gott sprach: Es werde Licht!"
    assert manifest.train_sets == [
        {"name": "train", "directions": ["en-de", "de-en"], "pairs": 8},
        {"name": "train.en-de", "directions": ["en-de"], "pairs": 2},
    ]
    assert "s" not in manifest.sources["versions"]  # Schlachter 1951 is not public domain


def test_split_is_by_whole_book(corpus: tuple[Path, Manifest]) -> None:
    out, manifest = corpus
    assert lines(out / "test.en") == ["Ruth spoke.", "Naomi wept."]
    assert lines(out / "test.de") == ["Ruth sprach.", "Noomi weinte laut."]
    assert lines(out / "test.tsv") == [
        "book\tchapter\tverse\ten\tde",
        "8\t1\t1\tRuth spoke.\tRuth sprach.",
        "8\t1\t2\tNaomi wept.\tNoomi weinte laut.",
    ]
    assert lines(out / "dev.en") == ["Obadiah saw."]
    train_text = set(lines(out / "train.en")) | set(lines(out / "train.en-de.en"))
    assert not train_text & (set(lines(out / "test.en")) | set(lines(out / "dev.en")))
    assert manifest.splits == {"train": 8, "train.en-de": 2, "dev": 1, "test": 2}


def test_manifest_counts_what_was_dropped(corpus: tuple[Path, Manifest]) -> None:
    out, manifest = corpus
    assert manifest.dropped == {
        "bible_ke_duplicate": 1,
        "bible_ke_empty": 1,
        "bible_ke_length_ratio": 1,
        "bible_ke_dev_dropped": 1,
        "bible_ke_shifted_psalm": 2,
        "ding_duplicate": 1,
        "ding_malformed_lines": 2,
        "ding_subentries_not_phrases": 6,
    }
    assert manifest.train_pairs_by_source == {"bible_ke": 4, "bible_4e": 2, "ding": 4}
    assert manifest.sources["ding"]["version"] == "devel test"
    assert Manifest.load(out / "manifest.json") == manifest
    assert json.loads((out / "manifest.json").read_text())["rules"]["test_books"] == [8, 32, 41, 56]


def test_normalize_and_version_markup() -> None:
    assert normalize("  Gru\u0308n\u00a0 ist\tes’s ") == "Grün ist es's"
    assert normalize("Ar\u00adchi\u00advie\u00adren") == "Archivieren"  # soft hyphens
    assert normalize("Gru\u00ad\u0308n") == "Grün"  # removed before NFC composes
    assert clean_verse("Ps (Dem Vorsänger.) Text", "e", 19, 1) == "Ps (Dem Vorsänger.) Text"
    assert clean_verse("(Dem Vorsänger.) Text", "e", 19, 1) == "Text"
    assert clean_verse("(32:1) Und Laban stand auf.", "s", 1, 31) == "Und Laban stand auf."
    assert clean_verse("ein Opfer der first -[fruits]", "4", 3, 2) == "ein Opfer der first-fruits"
    assert clean_verse("erstatten. -", "e", 2, 22) == "erstatten."


@pytest.mark.parametrize(
    ("de", "en", "expected"),
    [
        ("Das Haus ist groß.", "The house is big.", ("Das Haus ist groß.", "The house is big.")),
        ("Haus {n}", "house", None),  # a headword, not a phrase
        (
            "in der Reihe bleiben [ugs.]",
            "to keep in line",
            ("in der Reihe bleiben", "to keep in line"),
        ),
        ("er/sie nimmt ab", "he/she takes off", None),  # conjugation row
        (
            "Ende der Woche /EdW/",  # an abbreviation is an annotation, not a template
            "end of the week /EOW/",
            ("Ende der Woche", "end of the week"),
        ),
        ("jdm. helfen", "to help sb.", None),  # template
        ("schnell laufen; rennen", "to run fast; to sprint", None),  # two words each
    ],
)
def test_ding_phrase_rule(de: str, en: str, expected: tuple[str, str] | None) -> None:
    assert ding_pair(de, en) == expected


def test_main_builds_the_corpus(tmp_path: Path) -> None:
    db = write_bible_db(tmp_path / "bible.db", ROWS)
    out = tmp_path / "data"
    argv = ["data", "build", "--out", str(out), "--bible-db", str(db), "--ding", ""]
    argv += ["--spm-vocab-size", "0", "--modern", "off"]
    assert main(argv) == 0
    assert Manifest.load(out / "manifest.json").splits == {
        "train": 4,
        "train.en-de": 2,
        "dev": 1,
        "test": 2,
    }
    assert "ding" not in Manifest.load(out / "manifest.json").sources


def test_ding_terms_are_a_training_set_of_their_own(tmp_path: Path) -> None:
    """--ding-terms: each line's headword, where it is a term (not a phrase, at most three words
    a side, no template), cleaned as phrases are, in the training set `ding-terms` (both
    directions); the phrases and the other sets as without it."""
    from attnserve.training.data import ding_term

    db = write_bible_db(tmp_path / "bible.db", ROWS)
    ding = tmp_path / "de-en"
    ding.write_text(DING + "Apotheke {f} [pharm.] | Apotheken {pl} :: pharmacy | pharmacies\n")
    plain = build_corpus(tmp_path / "plain", bible_db=db, ding_path=ding)
    out = tmp_path / "terms"
    manifest = build_corpus(out, bible_db=db, ding_path=ding, ding_terms=True)
    pairs = list(zip(lines(out / "ding-terms.en"), lines(out / "ding-terms.de"), strict=True))
    # Headwords that are terms (annotations dropped); plural sub-entries are not headwords;
    # "Da staunt der Laie." is a phrase (train); "jdm. etw. geben" a template.
    assert pairs == [
        ("house", "Haus"), ("sunburn", "Sonnenbrand"), ("to take off", "abnehmen"),
        ("pharmacy", "Apotheke"),
    ]  # fmt: skip
    assert manifest.train_sets[-1] == {
        "name": "ding-terms", "directions": ["en-de", "de-en"], "pairs": 4
    }  # fmt: skip
    assert manifest.train_sets[:-1] == plain.train_sets
    assert lines(out / "train.en") == lines(tmp_path / "plain" / "train.en")
    assert manifest.train_pairs_by_source["ding_terms"] == 4
    assert manifest.rules["ding_term_words"] == 3
    assert ding_term("Sonnenbrand {m} [med.]", "sunburn") == ("Sonnenbrand", "sunburn")
    assert ding_term("Dienstag {m} /Di/", "Tuesday /Tue/") == ("Dienstag", "Tuesday")
    assert ding_term("Kilometer {m} /km/", "kilometre /km/") == ("Kilometer", "kilometre")
    assert ding_term("und/oder", "and/or") is None  # a slash inside a word: a template
    assert ding_term("Das Haus ist groß.", "The house is big.") is None  # a phrase
    assert ding_term("jdm. helfen", "to help sb.") is None
    assert ding_term("ein sehr langer Begriff", "a very long term") is None  # four words


def test_a_build_keeps_a_given_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--spm-model: the build copies that model (a run goes on on the vocabulary it has) and
    the manifest names it and its sha256; a build that trains one records its size and hash."""
    db = write_synthetic_bible(tmp_path / "bible.db")
    argv = ["data", "build", "--bible-db", str(db), "--ding", "", "--modern", "off"]
    trained = tmp_path / "trained"
    assert main([*argv, "--out", str(trained), "--spm-vocab-size", "80"]) == 0
    spm_model = trained / "spm.model"
    digest = hashlib.sha256(spm_model.read_bytes()).hexdigest()
    assert Manifest.load(trained / "manifest.json").tokenizer == {
        "trained": {"vocab_size": 80, "type": "unigram", "sha256": digest}
    }
    out = tmp_path / "kept"
    (out).mkdir()
    (out / "spm.vocab").write_text("a stale list of another model's pieces\n")
    assert main([*argv, "--out", str(out), "--spm-model", str(spm_model)]) == 0
    assert (out / "spm.model").read_bytes() == spm_model.read_bytes()
    assert (out / "spm.vocab").read_bytes() == (trained / "spm.vocab").read_bytes()
    kept = {"copied": {"path": str(spm_model.resolve()), "sha256": digest}}
    assert Manifest.load(out / "manifest.json").tokenizer == kept
    # the folder's own model, kept in place (a rebuild of the same folder)
    assert main([*argv, "--out", str(trained), "--spm-model", str(spm_model)]) == 0
    assert hashlib.sha256(spm_model.read_bytes()).hexdigest() == digest
    # before any work: a missing file, a file that is no model, both flags
    for bad, message in [
        (["--spm-model", str(tmp_path / "no.model")], "no such file"),
        (["--spm-model", str(db)], "not a SentencePiece model"),
        (["--spm-model", str(spm_model), "--spm-vocab-size", "80"], "not both"),
    ]:
        assert main([*argv, "--out", str(tmp_path / "none"), *bad]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "none").exists()


def test_a_manifest_of_a_newer_build_loads(tmp_path: Path) -> None:
    """Fields a later build writes that this code does not know are left out, not an error."""
    manifest = Manifest({}, [], [], {"train": 1}, {}, {})
    manifest.save(tmp_path / "manifest.json")
    data = json.loads((tmp_path / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps({**data, "from_the_future": 1}))
    assert Manifest.load(tmp_path / "manifest.json") == manifest
