"""npm packages' locale tables -> raw (English, German) units; fetching their pinned tarballs.

A web application keeps its interface strings in tables keyed by message id, one file a language:
JSON (nested objects; a key is its path) or Java `.properties`. A `Table` names a package's
German file and its English one; their entries are aligned by key. A table without an English
file is keyed by the English text (Joplin's JSON: `{"English": ["German", "German plural"]}`,
the first form).

The tarballs are the registry's, pinned by version and by the sha512 the registry publishes
(`dist.integrity`): `make data` fetches them into the catalogs folder's `npm/`
(`python -m attnserve.training.npm DIR`), and the build reads the tables straight from them,
checking the pin again. Nothing of a package is installed or run.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import re
import sys
import tarfile
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath

from attnserve.training.modern_sources import NPM, PYPI_DIR, SOURCES, Source

log = logging.getLogger(__name__)

REGISTRY = "https://registry.npmjs.org"
NPM_SUBDIR = "npm"  # in the catalogs folder (PYPI_DIR)
PACKAGE_ROOT = "package"  # every npm tarball's top folder
FETCH_TIMEOUT = 120  # seconds without data before a download fails
MAX_TABLE_BYTES = 16 << 20  # a locale file larger than this is not one

Key = tuple[str, ...]


def tarball_name(source: Source) -> str:
    """The tarball's file name as the registry serves it (`@scope/name` -> `name-1.0.tgz`)."""
    return f"{source.package.rsplit('/', 1)[-1]}-{source.version}.tgz"


def tarball_url(source: Source, registry: str = REGISTRY) -> str:
    return f"{registry}/{source.package}/-/{tarball_name(source)}"


def tarball_path(source: Source, catalogs_dir: Path = PYPI_DIR) -> Path:
    """Where `fetch` puts a source's tarball (scoped names keep their scope as a folder)."""
    return catalogs_dir / NPM_SUBDIR / source.package.rsplit("/", 1)[0] / tarball_name(source)


def integrity(data: bytes) -> str:
    """Subresource-integrity form of the sha512, as the npm registry publishes it."""
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def check(source: Source, data: bytes) -> None:
    if integrity(data) != source.integrity:
        raise ValueError(
            f"{source.package} {source.version}: the tarball's sha512 is not the pinned one "
            f"(got {integrity(data)[:30]}..., pinned {source.integrity[:30]}...)"
        )


def fetch(
    sources: Iterable[Source], catalogs_dir: Path = PYPI_DIR, registry: str = REGISTRY
) -> list[Path]:
    """Download every npm source's pinned tarball that is not there yet; returns their paths.
    A download whose sha512 differs from the pin raises and leaves nothing behind."""
    paths = []
    for source in sources:
        if source.registry != NPM:
            continue
        path = tarball_path(source, catalogs_dir)
        if not (path.is_file() and integrity(path.read_bytes()) == source.integrity):
            url = tarball_url(source, registry)
            log.info("fetching %s", url)
            with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT) as response:
                data = response.read()
            check(source, data)
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(path.name + ".part")
            partial.write_bytes(data)
            partial.replace(path)
        paths.append(path)
    return paths


# -- reading tables -------------------------------------------------------------------------


def _flatten(value: object, key: Key = ()) -> Iterator[tuple[Key, str]]:
    if isinstance(value, str):
        yield key, value
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _flatten(item, (*key, str(name)))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _flatten(item, (*key, str(i)))


_UNICODE_ESCAPE = re.compile(r"\\u([0-9a-fA-F]{4})")
_ESCAPE = re.compile(r"\\(.)")
_PROPERTY = re.compile(r"((?:[^\s=:\\]|\\.)+)[ \t\f]*[=:]?[ \t\f]*(.*)")


def _continues(line: str) -> bool:
    """A logical line goes on when it ends in an odd number of backslashes."""
    return (len(line) - len(line.rstrip("\\"))) % 2 == 1


def _unescape(text: str) -> str:
    text = _UNICODE_ESCAPE.sub(lambda m: chr(int(m[1], 16)), text)
    return _ESCAPE.sub(lambda m: {"n": "\n", "t": "\t", "r": "\r", "f": "\f"}.get(m[1], m[1]), text)


def read_properties(text: str) -> dict[str, str]:
    """Java `.properties`: `key=value`, `key: value` or `key value`; `#` and `!` comments;
    a trailing backslash continues the line (the next one's leading blanks dropped); `\\uXXXX`
    and `\\n`-style escapes."""
    table: dict[str, str] = {}
    lines = iter(text.replace("\r\n", "\n").replace("\r", "\n").split("\n"))
    for raw in lines:
        line = raw.lstrip(" \t\f")
        if not line or line[0] in "#!":
            continue
        while _continues(line):
            line = line[:-1] + next(lines, "").lstrip(" \t\f")
        match = _PROPERTY.fullmatch(line)
        if match:
            table[_unescape(match[1])] = _unescape(match[2])
    return table


def read_table(data: bytes, member: str) -> dict[Key, str]:
    """A locale file's strings by key (a JSON string's key is its path of object keys and list
    indexes)."""
    text = data.decode("utf-8-sig", errors="replace")
    suffix = PurePosixPath(member).suffix
    if suffix == ".json":
        return dict(_flatten(json.loads(text)))
    if suffix == ".properties":
        return {(key,): value for key, value in read_properties(text).items()}
    raise ValueError(f"{member}: no reader for {suffix or 'a file without a suffix'}")


def table_units(de: bytes, de_member: str, en: bytes | None = None) -> Iterator[tuple[str, str]]:
    """(English, German) units of one table: the German entries aligned with the English file's
    by key, or (`en` None) keyed by the English text."""
    german = read_table(de, de_member)
    if en is None:
        for key, text in german.items():  # {"English": "German"} or {"English": [forms]}
            if len(key) == 1 or key[1:] == ("0",):
                yield key[0], text
        return
    for key, text in read_table(en, "en" + PurePosixPath(de_member).suffix).items():
        if german.get(key):
            yield text, german[key]


def _member(archive: tarfile.TarFile, path: str) -> bytes:
    info = archive.getmember(f"{PACKAGE_ROOT}/{path}")
    if not info.isfile() or info.size > MAX_TABLE_BYTES:
        raise ValueError(f"{path}: not a locale file ({info.size} bytes)")
    handle = archive.extractfile(info)
    assert handle is not None
    return handle.read()


def tarball_units(source: Source, tarball: Path) -> Iterator[tuple[str, str]]:
    """Every table's units of a source's tarball, after checking it is the pinned one."""
    data = tarball.read_bytes()
    check(source, data)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        for table in source.tables:
            de = _member(archive, table.de)
            en = _member(archive, table.en) if table.en else None
            yield from table_units(de, table.de, en)


def npm_sources(sources: Iterable[Source] = SOURCES) -> list[Source]:
    return [s for s in sources if s.registry == NPM]


if __name__ == "__main__":  # `python -m attnserve.training.npm DIR`: what `make data` runs
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if len(sys.argv) != 2:
        sys.exit("usage: python -m attnserve.training.npm CATALOGS_DIR")
    for fetched in fetch(npm_sources(), Path(sys.argv[1])):
        print(fetched)
