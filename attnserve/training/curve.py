"""The learning curve of a packaged model: dev BLEU per direction against training hours.

Reads `dev_history` from the model directory's metadata.json (written by `attnserve package`)
and draws it with matplotlib (imported lazily: the `loadtest` or `bench` extra).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def dev_history(model_dir: str | Path) -> list[dict[str, Any]]:
    """The dev evaluations of the run the model came from, in order."""
    return list(_metadata(model_dir).get("dev_history") or [])


def train_threads(model_dir: str | Path) -> int | None:
    """The training threads of the run the model came from, every worker's (None if not
    recorded)."""
    config = _metadata(model_dir).get("train_config") or {}
    threads = config.get("threads")
    return int(threads) * int(config.get("workers") or 1) if threads else None


def _metadata(model_dir: str | Path) -> dict[str, Any]:
    metadata: dict[str, Any] = json.loads(
        (Path(model_dir) / "metadata.json").read_text(encoding="utf-8")
    )
    return metadata


def vocabulary_changes(model_dir: str | Path) -> list[float]:
    """The training hours at which the model's training moved to a new vocabulary (warm starts
    whose embedding was moved to other pieces: `attnserve package` records them)."""
    return [float(c["hours"]) for c in _metadata(model_dir).get("vocabulary_changes") or []]


def layer_changes(model_dir: str | Path) -> list[tuple[float, str]]:
    """The training hours at which the model grew, and how ("decoder 3 -> 5 layers"): warm
    starts into more layers, as `attnserve package` records them."""
    changes = []
    for change in _metadata(model_dir).get("layer_changes") or []:
        grown = [
            f"{field.split('_')[0]} {change[field][0]} -> {change[field][1]} layers"
            for field in ("encoder_layers", "decoder_layers")
            if field in change
        ]
        changes.append((float(change["hours"]), ", ".join(grown)))
    return changes


# The dev splits a history may have: the Bible's (keys without a suffix) and, for runs that
# train on modern text, modern-dev's (`_modern`).
SPLITS = (("", "Bible"), ("_modern", "modern"))


def _splits(history: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    found = [(k, name) for k, name in SPLITS if any(f"bleu_ende{k}" in r for r in history)]
    return found or [SPLITS[0]]


def curve_table(history: Sequence[dict[str, Any]]) -> str:
    """Markdown: step, hours, dev BLEU en-de and de-en of each dev split the history has
    (blank where an evaluation did not have it)."""
    splits = _splits(history)
    named = len(splits) > 1
    heads = [
        f"{name + ' ' if named else ''}dev BLEU {d}"
        for _, name in splits
        for d in ("en->de", "de->en")
    ]
    lines = ["| step | hours | " + " | ".join(heads) + " |", "|---" * (2 + len(heads)) + "|"]
    for r in history:
        cells = [
            f"{r[key]:.2f}" if key in r else ""
            for k, _ in splits
            for key in (f"bleu_ende{k}", f"bleu_deen{k}")
        ]
        lines.append(f"| {r['step']} | {r['hours']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def marks(
    vocabulary_hours: Sequence[float], growths: Sequence[tuple[float, str]] = ()
) -> dict[float, str]:
    """The curve's labelled lines: hour -> label, one label per hour (a warm start may both move
    to a new vocabulary and grow the model)."""
    texts: dict[float, list[str]] = {}
    for hours, text in [(h, "new vocabulary") for h in vocabulary_hours] + list(growths):
        texts.setdefault(hours, []).append(text)
    return {hours: "; ".join(labels) for hours, labels in texts.items()}


def plot_curve(
    history: Sequence[dict[str, Any]],
    out: str | Path,
    title: str,
    threads: int | None = None,
    vocabulary_hours: Sequence[float] = (),
    growths: Sequence[tuple[float, str]] = (),
) -> Path:
    """Dev BLEU per direction against training hours, each dev split the history has (the
    Bible's solid, modern text's dashed); beside it the dev loss, where the history has it
    (runs since dev loss was recorded). `vocabulary_hours`: a line at each move to a new
    vocabulary (losses per piece before and after one are not on one scale); `growths`: a line
    at each growth of the model, labelled (`layer_changes`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = _splits(history)
    with_loss = any("loss_ende" in r for r in history)
    panels = 2 if with_loss else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.4 * panels, 3.6), dpi=120, squeeze=False)
    cores = f" ({threads} CPU thread{'s' if threads != 1 else ''})" if threads else ""
    named = len(splits) > 1

    def draw(ax: Any, metric: str) -> None:
        for k, name in splits:
            for d, label, marker, colour in (
                ("ende", "en->de", "o", "tab:blue"), ("deen", "de->en", "s", "tab:orange")
            ):  # fmt: skip
                key = f"{metric}_{d}{k}"
                points = [(r["hours"], r[key]) for r in history if key in r]
                # Losses per piece of two vocabularies are not one line: split at the change.
                cuts = [-math.inf, *(vocabulary_hours if metric == "loss" else ()), math.inf]
                segments = [
                    [p for p in points if a < p[0] <= b] for a, b in itertools.pairwise(cuts)
                ]
                for n, segment in enumerate(s for s in segments if s):
                    ax.plot(
                        *zip(*segment, strict=True), marker=marker, markersize=3, color=colour,
                        linestyle="--" if k else "-",
                        label=None if n else f"{name} {label}" if named else label,
                    )  # fmt: skip
        for hours, text in marks(vocabulary_hours, growths).items():
            ax.axvline(hours, color="grey", linewidth=0.8, linestyle=":")
            ax.annotate(
                f" {text}", (hours, 1.0), xycoords=("data", "axes fraction"),
                va="top", fontsize=7, color="grey",
            )  # fmt: skip
        ax.set_xlabel(f"training hours{cores}")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7 if named else None)

    bleu = axes[0][0]
    draw(bleu, "bleu")
    unit = "100 sentences a split" if named else "100 verses"
    bleu.set(ylabel=f"dev BLEU (greedy, {unit})", title=title)
    if with_loss:
        loss = axes[0][1]
        draw(loss, "loss")
        loss.set(ylabel="dev loss (nats/token, teacher-forced)", title="dev cross-entropy")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return Path(out)
