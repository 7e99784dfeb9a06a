"""The learning-curve plot: dev BLEU, and dev loss beside it when the history has it."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from attnserve.training.curve import curve_table, plot_curve

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
