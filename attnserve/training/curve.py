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
    return list(_metadata(model_dir).get("dev_history") or [])


def train_threads(model_dir: str | Path) -> int | None:
    """The training threads of the run the model came from (None if not recorded)."""
    threads = (_metadata(model_dir).get("train_config") or {}).get("threads")
    return int(threads) if threads else None


def _metadata(model_dir: str | Path) -> dict[str, Any]:
    metadata: dict[str, Any] = json.loads(
        (Path(model_dir) / "metadata.json").read_text(encoding="utf-8")
    )
    return metadata


def curve_table(history: Sequence[dict[str, Any]]) -> str:
    """Markdown: step, hours, dev BLEU en-de and de-en."""
    lines = ["| step | hours | dev BLEU en->de | dev BLEU de->en |", "|---|---|---|---|"]
    for r in history:
        lines.append(
            f"| {r['step']} | {r['hours']:.2f} | {r['bleu_ende']:.2f} | {r['bleu_deen']:.2f} |"
        )
    return "\n".join(lines)


def plot_curve(
    history: Sequence[dict[str, Any]], out: str | Path, title: str, threads: int | None = None
) -> Path:
    """Dev BLEU per direction against training hours; beside it the dev loss, where the
    history has it (runs since dev loss was recorded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_loss = [r for r in history if "loss_ende" in r and "loss_deen" in r]
    panels = 2 if with_loss else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.4 * panels, 3.6), dpi=120, squeeze=False)
    cores = f" ({threads} CPU thread{'s' if threads != 1 else ''})" if threads else ""
    bleu = axes[0][0]
    hours = [r["hours"] for r in history]
    bleu.plot(hours, [r["bleu_ende"] for r in history], marker="o", label="en->de")
    bleu.plot(hours, [r["bleu_deen"] for r in history], marker="s", label="de->en")
    bleu.set(xlabel=f"training hours{cores}", ylabel="dev BLEU (greedy, 100 verses)", title=title)
    if with_loss:
        loss = axes[0][1]
        hours = [r["hours"] for r in with_loss]
        loss.plot(hours, [r["loss_ende"] for r in with_loss], marker="o", label="en->de")
        loss.plot(hours, [r["loss_deen"] for r in with_loss], marker="s", label="de->en")
        loss.set(
            xlabel=f"training hours{cores}",
            ylabel="dev loss (nats/token, teacher-forced)",
            title="dev cross-entropy",
        )
    for ax in axes[0]:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return Path(out)
