"""The learning curve of a packaged model: dev BLEU per direction against training hours.

Reads `dev_history` from the model directory's metadata.json (written by `attnserve package`)
and draws it with matplotlib (imported lazily: the `loadtest` or `bench` extra).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def dev_history(model_dir: str | Path) -> list[dict[str, Any]]:
    """The dev evaluations of the run the model came from, in order."""
    metadata = json.loads((Path(model_dir) / "metadata.json").read_text(encoding="utf-8"))
    return list(metadata.get("dev_history") or [])


def curve_table(history: Sequence[dict[str, Any]]) -> str:
    """Markdown: step, hours, dev BLEU en-de and de-en."""
    lines = ["| step | hours | dev BLEU en->de | dev BLEU de->en |", "|---|---|---|---|"]
    for r in history:
        lines.append(
            f"| {r['step']} | {r['hours']:.2f} | {r['bleu_ende']:.2f} | {r['bleu_deen']:.2f} |"
        )
    return "\n".join(lines)


def plot_curve(history: Sequence[dict[str, Any]], out: str | Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hours = [r["hours"] for r in history]
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=120)
    ax.plot(hours, [r["bleu_ende"] for r in history], marker="o", label="en->de")
    ax.plot(hours, [r["bleu_deen"] for r in history], marker="s", label="de->en")
    ax.set_xlabel("training hours (2 CPU cores)")
    ax.set_ylabel("dev BLEU (greedy, 100 verses)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return Path(out)
