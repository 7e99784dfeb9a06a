"""Firefox and Thunderbird strings: the en-US ones in the application's omni.ja archives and the
German ones in its language pack (.xpi), aligned by file and message id.

Both are zip files holding `.../localization/<locale>/<path>.ftl` (Fluent: `id = value`,
`    .attribute = value`, indented continuation lines) and `.../locale/<locale>/<path>.properties`
(`key = value`). Fluent term references (`{ -brand-short-name }`) become the term's text in each
language; other placeables (`{ $name }`, selectors) are left for the cleaner to drop.
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

_ENTRY = re.compile(r"^(-?[A-Za-z][\w-]*)\s*=\s*(.*)$")
_ATTRIBUTE = re.compile(r"^\s+\.([A-Za-z][\w-]*)\s*=\s*(.*)$")
_TERM_REFERENCE = re.compile(r"\{\s*(-[\w-]+)\s*\}")


def parse_fluent(text: str) -> dict[str, str]:
    """Messages, attributes (`id.attr`) and terms (`-id`) of a Fluent file; comments skipped."""
    out: dict[str, str] = {}
    message, current = "", ""
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if entry := _ENTRY.match(line):
            message = current = entry[1]
            out[current] = entry[2].strip()
        elif (attribute := _ATTRIBUTE.match(line)) and message:
            current = f"{message}.{attribute[1]}"
            out[current] = attribute[2].strip()
        elif line[0].isspace() and current:
            out[current] = f"{out[current]} {line.strip()}".strip()
    return out


def parse_properties(text: str) -> dict[str, str]:
    """`key = value` lines of a Java .properties file (no continuation lines in Mozilla's)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.lstrip().startswith(("#", "!")):
            out[key.strip()] = value.strip().replace("\\n", "\n")
    return out


PARSERS = {".ftl": parse_fluent, ".properties": parse_properties}


def read_strings(archives: Iterable[Path], locale: str) -> dict[tuple[str, str], str]:
    """{(file path below the locale folder, message id): text} of the archives' `locale` files."""
    strings: dict[tuple[str, str], str] = {}
    for archive in archives:
        with zipfile.ZipFile(archive) as z:
            for name in z.namelist():
                parse = PARSERS.get(Path(name).suffix)
                path = _locale_path(name, locale)
                if parse is not None and path is not None:
                    text = z.read(name).decode("utf-8", "replace")
                    strings.update(((path, key), value) for key, value in parse(text).items())
    return strings


def _locale_path(name: str, locale: str) -> str | None:
    """`browser/localization/de/a/b.ftl` -> `a/b.ftl`: the same for both languages' files."""
    for folder in ("localization", "locale"):
        marker = f"{folder}/{locale}/"
        if marker in name:
            return name.split(marker, 1)[1]
    return None


def _with_terms(strings: dict[tuple[str, str], str]) -> dict[tuple[str, str], str]:
    terms = {k[1]: v for k, v in strings.items() if k[1].startswith("-") and "{" not in v}

    def expand(text: str) -> str:
        return _TERM_REFERENCE.sub(lambda m: terms.get(m[1], m[0]), text)

    return {k: expand(v) for k, v in strings.items() if not k[1].startswith("-")}


def langpack_units(en_archives: Iterable[Path], de_archive: Path) -> Iterator[tuple[str, str]]:
    """(en, de) texts of every message the language pack translates."""
    en = _with_terms(read_strings(en_archives, "en-US"))
    de = _with_terms(read_strings([de_archive], "de"))
    for key, text in en.items():
        if text and de.get(key):
            yield text, de[key]
