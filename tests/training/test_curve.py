"""The learning-curve plot: dev BLEU, and dev loss beside it when the history has it."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from attnserve.training.curve import curve_table, plot_curve, train_threads

pytest.importorskip("matplotlib")


def png_width(path: Path) -> int:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width: int = struct.unpack(">I", data[16:20])[0]  # the IHDR chunk's width
    return width


def test_the_loss_panel_is_drawn_when_the_history_has_losses(tmp_path: Path) -> None:
    bleu_only = [{"step": s, "hours": s / 10, "bleu_ende": s, "bleu_deen": s + 1} for s in (1, 2)]
    with_loss = [r | {"loss_ende": 5.0 - r["step"], "loss_deen": 4.0} for r in bleu_only]
    one = plot_curve(bleu_only, tmp_path / "one.png", "old run", threads=2)
    two = plot_curve(with_loss, tmp_path / "two.png", "new run", threads=1)
    assert png_width(two) == 2 * png_width(one)
    assert curve_table(with_loss).splitlines()[2] == "| 1 | 0.10 | 1.00 | 2.00 |"


def test_both_domains_and_the_vocabulary_change(tmp_path: Path) -> None:
    """A run warm-started from a Bible-only model and then moved to a new vocabulary: the
    modern dev split's columns are blank before it was evaluated; the change is read from the
    package's metadata."""
    import json

    from attnserve.training.curve import layer_changes, marks, vocabulary_changes

    bible = [{"step": 1, "hours": 0.1, "bleu_ende": 20.0, "bleu_deen": 21.0, "loss_ende": 3.0}]
    mixed = [
        {"step": s, "hours": s / 10, "bleu_ende": 22.0, "bleu_deen": 23.0, "loss_ende": 2.5,
         "bleu_ende_modern": 10.0 + s, "bleu_deen_modern": 12.0, "loss_ende_modern": 2.0}
        for s in (2, 3)
    ]  # fmt: skip
    table = curve_table(bible + mixed).splitlines()
    assert table[0] == (
        "| step | hours | Bible dev BLEU en->de | Bible dev BLEU de->en "
        "| modern dev BLEU en->de | modern dev BLEU de->en |"
    )
    assert table[2] == "| 1 | 0.10 | 20.00 | 21.00 |  |  |"
    assert table[4] == "| 3 | 0.30 | 22.00 | 23.00 | 13.00 | 12.00 |"
    model = tmp_path / "model"
    model.mkdir()
    (model / "metadata.json").write_text(json.dumps({"warm_start": {"hours": 0.2}}))
    assert vocabulary_changes(model) == []
    changes = [{"step": 2, "hours": 0.25, "copied": 3, "composed": 2, "unknown": 0}]
    (model / "metadata.json").write_text(json.dumps({"vocabulary_changes": changes}))
    assert vocabulary_changes(model) == [0.25]
    assert layer_changes(model) == []
    grown = [
        {"step": 3, "hours": 0.25, "decoder_layers": [3, 5]},
        {"step": 4, "hours": 0.28, "encoder_layers": [6, 8], "decoder_layers": [5, 6]},
    ]
    (model / "metadata.json").write_text(json.dumps({"layer_changes": grown}))
    assert layer_changes(model) == [
        (0.25, "decoder 3 -> 5 layers"),
        (0.28, "encoder 6 -> 8 layers, decoder 5 -> 6 layers"),
    ]
    assert marks([0.25], layer_changes(model)) == {
        0.25: "new vocabulary; decoder 3 -> 5 layers",
        0.28: "encoder 6 -> 8 layers, decoder 5 -> 6 layers",
    }
    out = plot_curve(
        bible + mixed, tmp_path / "mixed.png", "mixed run", 1, [0.25], layer_changes(model)
    )
    assert curve_table([]).splitlines()[0] == "| step | hours | dev BLEU en->de | dev BLEU de->en |"
    no_loss = [{k: v for k, v in r.items() if "loss" not in k} for r in bible + mixed]
    assert png_width(out) == 2 * png_width(plot_curve(no_loss, tmp_path / "b.png", "b"))


def test_a_runs_threads_count_every_workers(tmp_path: Path) -> None:
    def threads(config: dict[str, int]) -> int | None:
        (tmp_path / "metadata.json").write_text(json.dumps({"train_config": config}))
        return train_threads(tmp_path)

    assert threads({"threads": 2}) == 2  # a run of before workers
    assert threads({"threads": 1, "workers": 2}) == 2
    assert threads({"threads": 2, "workers": 3}) == 6
    assert threads({}) is None
