"""Benchmark results as JSON lines, a markdown table and a PNG bar chart (matplotlib, optional)."""

from __future__ import annotations

import json
import logging
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attnserve.bench.offline import BenchResult
from attnserve.loadtest.report import machine

log = logging.getLogger(__name__)

LABELS = {
    "torch": "attnserve torch fp32",
    "onnx-fp32": "attnserve ORT fp32",
    "onnx-int8": "attnserve ORT int8",
    "onnx-fp16": "attnserve ORT fp16 (CUDA)",
    "hf": "HF transformers fp32",
    "ct2-fp32": "CTranslate2 fp32",
    "ct2-int8": "CTranslate2 int8",
}


def label(backend: str) -> str:
    return LABELS.get(backend, backend)


def write_table(out_dir: Path, name: str, rows: Sequence[dict[str, Any]], table: str) -> None:
    """NAME.json (the result rows) and NAME.md (their markdown table) in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(list(rows), indent=2) + "\n")
    (out_dir / f"{name}.md").write_text(table)


def write_jsonl(
    results: Sequence[BenchResult], path: Path, *, model: str, info: dict[str, Any]
) -> Path:
    """One JSON object per (backend, beam, batch), with the model label and machine info."""
    lines = [json.dumps({"model": model, **r.to_dict(), "machine": info}) for r in results]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _configs(results: Sequence[BenchResult]) -> list[tuple[int, int]]:
    return sorted({(r.beam_size, r.batch_size) for r in results})


def _backends(results: Sequence[BenchResult]) -> list[str]:
    return list(dict.fromkeys(r.backend for r in results))


def markdown_table(results: Sequence[BenchResult], baseline: str | None = None) -> str:
    """Tokens/s (median) per backend and setting, as a ratio to `baseline` (default: first)."""
    configs = _configs(results)
    backends = _backends(results)
    base = baseline if baseline in backends else backends[0]
    cell = {(r.backend, r.beam_size, r.batch_size): r for r in results}
    header = ["backend", *[f"beam {k}, batch {b}" for k, b in configs]]
    header += ["size on disk (MB)", "peak RSS (MB)"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for backend in backends:
        cells = [label(backend)]
        for beam, batch in configs:
            r = cell.get((backend, beam, batch))
            ref = cell.get((base, beam, batch))
            if r is None:
                cells.append("-")
                continue
            ratio = f" ({r.tokens_per_second / ref.tokens_per_second:.2f}x)" if ref else ""
            cells.append(f"{r.tokens_per_second:.0f}{ratio}")
        mine = [r for r in results if r.backend == backend]
        size = mine[0].model_size_mb
        cells.append(f"{size:.1f}" if size is not None else "-")
        rss = max(r.peak_rss_mb for r in mine)
        cells.append(f"{rss:.0f}" + ("" if mine[0].isolated else " (shared process)"))
        rows.append("| " + " | ".join(cells) + " |")
    runs = max(len(r.runs) for r in results)
    note = (
        f"Target tokens/s, median of {runs} interleaved runs; in parentheses the ratio to "
        f"{label(base)} in the same run."
    )
    return "\n".join(rows) + "\n\n" + note + "\n"


def write_chart(results: Sequence[BenchResult], path: Path, *, title: str) -> Path | None:
    """Horizontal bars of tokens/s per backend, one panel per (beam, batch); None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no chart (pip install matplotlib)")
        return None
    configs = _configs(results)
    backends = _backends(results)
    cell = {(r.backend, r.beam_size, r.batch_size): r.tokens_per_second for r in results}
    colors = [f"C{i}" for i in range(10)]  # matplotlib's default cycle
    width = max(6.0, 2.6 * len(configs) + 1.6)
    fig, axes = plt.subplots(1, len(configs), figsize=(width, 0.32 * len(backends) + 1.5), dpi=80)
    axes_list = list(axes) if len(configs) > 1 else [axes]
    for i, (ax, (beam, batch)) in enumerate(zip(axes_list, configs, strict=True)):
        values = [cell.get((b, beam, batch), 0.0) for b in backends]
        ax.barh(range(len(backends)), values, color=[colors[j % 10] for j in range(len(values))])
        ax.set_yticks(range(len(backends)))
        ax.set_yticklabels([label(b) for b in backends] if i == 0 else [], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"beam {beam}, batch {batch}", fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_xlabel("target tokens/s", fontsize=8)
        for y, value in enumerate(values):
            ax.text(value, y, f" {value:.0f}", va="center", fontsize=7)
        ax.set_xlim(0, max(values or [1.0]) * 1.3)
    fig.suptitle(textwrap.fill(title, int(width * 14)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_report(
    results: Sequence[BenchResult],
    out_dir: Path,
    name: str,
    *,
    model: str,
    baseline: str | None = None,
    chart: bool = True,
) -> list[Path]:
    """out_dir/<name>.jsonl, <name>.md and <name>.png; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    info = machine()
    written = [write_jsonl(results, out_dir / f"{name}.jsonl", model=model, info=info)]
    md = out_dir / f"{name}.md"
    md.write_text(f"**{model}** ({info['cpu']})\n\n" + markdown_table(results, baseline))
    written.append(md)
    if chart:
        png = write_chart(results, out_dir / f"{name}.png", title=model)
        if png is not None:
            written.append(png)
    return written
