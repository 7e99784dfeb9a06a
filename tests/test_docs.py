"""The docs agree: README's figures come from docs/BENCHMARKS.md, docs/bench holds exactly the
result files the docs cite, and ARCHITECTURE's layout table states tests/test_layers.py's rules."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from tests.test_layers import ALLOWED

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "BENCHMARKS.md"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
BENCH_DIR = ROOT / "docs" / "bench"

# A ratio or a percentage, single or a range: 1.52x, 1.43-1.65x, +1.21 %, 6-15 %.
FIGURE = re.compile(r"(?<![\w.])[+-]?\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?(?:x\b| ?%)")
NUMBER = re.compile(r"(?<![\w.])[+-]?\d+(?:[.,]\d+)*(?:-\d+(?:[.,]\d+)*)?(?:x\b| ?%)?")
# docs/bench paths anywhere, and links relative to docs/ (`![plot](bench/NAME.png)`).
BENCH_PATH = re.compile(r"(?<![\w/])docs/bench/[\w.{},/-]*[\w}/]|\]\((bench/[^)\s]+)\)")


def prose(markdown: str) -> str:
    """The text outside fenced code blocks (commands and real outputs are not figures)."""
    return "\n".join(re.split(r"^```.*?^```", markdown, flags=re.M | re.S))


def sentences(markdown: str) -> list[str]:
    """Prose sentences (a table row counts as one), each on one line."""
    found: list[str] = []
    for paragraph in re.split(r"\n\s*\n", prose(markdown)):
        if paragraph.lstrip().startswith("|"):
            found += paragraph.strip().splitlines()
        else:
            found += re.split(r"(?<=[.!?])\s+(?=[A-Z`*(\[])", " ".join(paragraph.split()))
    return found


def sections(markdown: str) -> list[str]:
    """The text under each heading of any level (and before the first)."""
    return re.split(r"^#+ .*$", markdown, flags=re.M)


def states(text: str, figure: str) -> bool:
    """Whether `text` has `figure` as it is: not rounded, not part of a longer number."""
    pattern = rf"(?<![\d.]){re.escape(figure.replace(' %', '%'))}(?![\d])"
    return re.search(pattern, text.replace(" %", "%")) is not None


def unsupported(groups: list[list[str]], source: str) -> list[list[str]]:
    """The groups of figures that no one section of `source` states all of."""
    parts = sections(source)
    return [
        group
        for group in groups
        if group and not any(all(states(part, figure) for figure in group) for part in parts)
    ]


def section(markdown: str, heading: str) -> str:
    """A `## heading` section, up to the next heading of its level."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", markdown, flags=re.M | re.S)
    assert match, f"no section {heading!r}"
    return match.group(1)


def test_unsupported_finds_figures_no_section_states() -> None:
    source = "# A\nint8 1.52x, 1.43-1.65x over runs\n## B\n1.12x without, 1.25x with; +1.21 %\n"
    groups = [["1.52x", "1.43-1.65x"], ["1.25x", "1.12x"], ["+1.21 %"], ["1.52x", "1.25x"]]
    assert unsupported(groups, source) == [["1.52x", "1.25x"]]  # true figures, not one section
    wrong = [["1.5x"], ["1.43x"], ["+1.2 %"], ["2x"], ["1.25x", "1.13x"], ["11.25x"]]
    assert unsupported(wrong, source) == wrong


def test_every_ratio_and_percentage_in_readme_is_in_one_section_of_benchmarks() -> None:
    groups = [FIGURE.findall(sentence) for sentence in sentences(README.read_text("utf-8"))]
    assert sum(map(len, groups)) > 10  # the rule still sees README's figures
    assert unsupported(groups, BENCHMARKS.read_text(encoding="utf-8")) == []


def test_every_figure_of_readmes_benchmarks_table_is_in_one_section_of_benchmarks() -> None:
    rows = [
        line.rstrip("|").rsplit("|", 1)[-1]  # the result column
        for line in section(README.read_text(encoding="utf-8"), "Benchmarks").splitlines()
        if line.startswith("| ") and not line.startswith("| question")
    ]
    groups = [NUMBER.findall(row) for row in rows]
    assert sum(map(len, groups)) > 20
    assert unsupported(groups, BENCHMARKS.read_text(encoding="utf-8")) == []


def expand_braces(path: str) -> list[str]:
    """`a{,-b}.{md,png}` -> a.md, a.png, a-b.md, a-b.png (the shell's rule, without nesting)."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[text] if i % 2 == 0 else text.split(",") for i, text in enumerate(parts)]
    return ["".join(chosen) for chosen in itertools.product(*choices)]


def test_expand_braces() -> None:
    assert expand_braces("docs/bench/a{,-b}.{md,png}") == [
        "docs/bench/a.md",
        "docs/bench/a.png",
        "docs/bench/a-b.md",
        "docs/bench/a-b.png",
    ]
    assert expand_braces("docs/bench/a-t{1,2}/") == ["docs/bench/a-t1/", "docs/bench/a-t2/"]


def documents() -> list[Path]:
    """Every document that may cite a result file (not the result files themselves)."""
    found = [README, *ROOT.glob("docs/*.md"), *ROOT.glob("checkpoints/*/*.md")]
    found += [*ROOT.glob("loadtest/*.md"), *ROOT.glob("benchmarks/**/*.md")]
    return sorted(found)


def cited_bench_paths() -> dict[str, list[str]]:
    """Cited docs/bench paths (from the repository's root, braces expanded) -> who cites them."""
    cited: dict[str, list[str]] = {}
    for doc in documents():
        for match in BENCH_PATH.finditer(doc.read_text(encoding="utf-8")):
            path = "docs/" + match.group(1) if match.group(1) else match.group(0)
            for expanded in expand_braces(path):
                cited.setdefault(expanded, []).append(str(doc.relative_to(ROOT)))
    return cited


def test_the_citation_rule_reads_paths_links_and_braces() -> None:
    text = (
        "Files: docs/bench/x-t{1,2}.{md,json}. ![plot](bench/y.png) `--output-dir docs/bench` "
        "in docs/bench/ (name files); attnserve/bench/lm.py; docs/bench/dir/ (a.json)"
    )
    found = [m.group(1) or m.group(0) for m in BENCH_PATH.finditer(text)]
    assert found == ["docs/bench/x-t{1,2}.{md,json}", "bench/y.png", "docs/bench/dir/"]


def test_every_cited_bench_path_exists() -> None:
    missing = {
        path: docs for path, docs in cited_bench_paths().items() if not (ROOT / path).exists()
    }
    assert missing == {}


def test_every_bench_file_is_cited() -> None:
    cited = set(cited_bench_paths())
    cited_dirs = {path.rstrip("/") for path in cited if (ROOT / path).is_dir()}
    files = sorted(p.relative_to(ROOT) for p in BENCH_DIR.rglob("*") if p.is_file())
    assert files
    uncited = [
        str(path)
        for path in files
        if str(path) not in cited and not any(str(parent) in cited_dirs for parent in path.parents)
    ]
    assert uncited == []


def layout_table() -> dict[str, set[str]]:
    """ARCHITECTURE's "Layout" table: folder (or top-level module: `defaults.py`) -> the folders
    its "may import" column names."""
    table = section(ARCHITECTURE.read_text(encoding="utf-8"), "Layout")
    rules: dict[str, set[str]] = {}
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        unit = re.fullmatch(r"`(\w+)(?:/|\.py)`", cells[0]) if len(cells) == 4 else None
        if unit is None:  # the header, `engine/onnx/` (part of engine)
            continue
        may_import = cells[3]
        if may_import == "nothing":
            rules[unit.group(1)] = set()
        elif may_import == "every folder above":  # defaults.py: every rule's, unnamed
            rules[unit.group(1)] = set(rules) - {"defaults"}
        else:
            rules[unit.group(1)] = set(re.findall(r"`(\w+)`", may_import))
    return rules


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_layout_table_states_the_import_rules(folder: str) -> None:
    assert layout_table().get(folder) == ALLOWED[folder]


def test_readme_console_rewrites_only_server_curls_outputs() -> None:
    """tests/service/readme_console.py: each server curl's output (up to the next `$ ` line or
    the block's end) is replaced by a fresh run, blank separators stay, other lines and blocks
    are kept; the README's own blocks parse (every server curl gets exactly one run)."""
    from tests.service.readme_console import is_server_curl, rewrite

    text = "\n".join([
        "$ curl -s localhost:8000/outside",  # not in a console block
        "```console",
        "$ curl -s localhost:8000/a",
        "old a",
        "",
        "$ # a comment, not run",
        "kept",
        "$ curl -s -N localhost:8000/b | grep x",
        "old b1",
        "old b2",
        "```",
        "```bash",
        "$ curl -s localhost:8000/c",
        "```",
    ])  # fmt: skip
    ran: list[str] = []

    def run(command: str) -> str:
        ran.append(command)
        return f"new {len(ran)}\n\nsecond line\n"

    assert rewrite(text, run).split("\n") == [
        "$ curl -s localhost:8000/outside", "```console",
        "$ curl -s localhost:8000/a", "new 1", "", "second line", "",
        "$ # a comment, not run", "kept",
        "$ curl -s -N localhost:8000/b | grep x", "new 2", "", "second line", "```",
        "```bash", "$ curl -s localhost:8000/c", "```",
    ]  # fmt: skip
    assert ran == ["curl -s localhost:8000/a", "curl -s -N localhost:8000/b | grep x"]
    with pytest.raises(ValueError, match="never closed"):
        rewrite("```console\n$ curl -s localhost:8000/a\nold", run)
    assert not is_server_curl("$ curl -s localhost:8000/a \\")  # continued: left alone
    readme = README.read_text(encoding="utf-8")
    ran.clear()
    rewrite(readme, run)
    in_console = sum(
        is_server_curl(line)
        for block in re.findall(r"^```console\n(.*?)^```", readme, flags=re.M | re.S)
        for line in block.split("\n")
    )
    assert len(ran) == in_console > 30
