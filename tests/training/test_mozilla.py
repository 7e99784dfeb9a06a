"""Firefox/Thunderbird strings: en-US archives and a German language pack aligned by id."""

from __future__ import annotations

import zipfile
from collections import Counter
from pathlib import Path

from attnserve.training.catalogs import clean_units
from attnserve.training.mozilla import langpack_units, parse_fluent

EN_FTL = """\
# A comment
-brand-short-name = Firefox
update-title = Update { -brand-short-name }
    .tooltip = Check for a newer
        version now
tabs-count = { $count ->
    [one] One open tab
   *[other] { $count } open tabs
}
only-english = Not in the language pack
"""
DE_FTL = """\
-brand-short-name = Firefox
update-title = { -brand-short-name } aktualisieren
    .tooltip = Jetzt nach einer neueren
        Version suchen
tabs-count = { $count ->
    [one] Ein offener Tab
   *[other] { $count } offene Tabs
}
"""


def write_zip(path: Path, files: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def test_parse_fluent_messages_attributes_and_continuations() -> None:
    parsed = parse_fluent(EN_FTL)
    assert parsed["update-title.tooltip"] == "Check for a newer version now"
    assert parsed["-brand-short-name"] == "Firefox"
    assert parsed["tabs-count"].startswith("{ $count -> [one] One open tab")


def test_langpack_units_align_by_file_and_id(tmp_path: Path) -> None:
    omni = write_zip(tmp_path / "omni.ja", {
        "localization/en-US/browser/app.ftl": EN_FTL,
        "chrome/en-US/locale/en-US/mail/mail.properties": "# c\nsend=Send the message now\n",
        "res/other.txt": "ignored = yes",
    })  # fmt: skip
    xpi = write_zip(tmp_path / "langpack-de.xpi", {
        "browser/localization/de/browser/app.ftl": DE_FTL,
        "chrome/de/locale/de/mail/mail.properties": "send=Die Nachricht jetzt senden\n",
    })  # fmt: skip
    units = list(langpack_units([omni], xpi))
    assert ("Update Firefox", "Firefox aktualisieren") in units
    assert ("Send the message now", "Die Nachricht jetzt senden") in units
    assert not any(en.startswith("Not in") for en, _ in units)
    stats: Counter[str] = Counter()
    assert sorted(clean_units(units, stats)) == [
        ("Check for a newer version now", "Jetzt nach einer neueren Version suchen"),
        ("Send the message now", "Die Nachricht jetzt senden"),
        ("Update Firefox", "Firefox aktualisieren"),
    ]
    assert stats["placeholder"] == 1  # the plural selector
