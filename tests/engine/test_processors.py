"""The repetition penalty at the edges of its range: CTRL's rule where it is finite, finite
scores (and a finite log-softmax) where dividing by a penalty near 0 would overflow."""

from __future__ import annotations

import numpy as np

from attnserve.engine.processors import apply_repetition_penalty, log_softmax


def test_repetition_penalty_follows_ctrl() -> None:
    row = np.array([2.0, -1.0, 0.5, 3.0], dtype=np.float32)
    apply_repetition_penalty(row, [0, 1, 1], 2.0)
    np.testing.assert_array_equal(row, np.array([1.0, -2.0, 0.5, 3.0], dtype=np.float32))


def test_a_penalty_near_zero_keeps_scores_finite() -> None:
    row = np.array([2.0, -1.0, 0.5, 3.0], dtype=np.float32)
    apply_repetition_penalty(row, [0, 1], 5e-324)
    assert np.isfinite(row).all()
    log_probs = log_softmax(row[None, :])
    assert np.isfinite(log_probs).all() and int(log_probs.argmax()) == 0  # seen and boosted
