"""`attnserve loadtest` end to end: locust headless against the tiny test model, a few seconds.

The tiny model is random, so its translations can be empty (`--allow-empty`), and its inputs are
at most 64 tokens (`--max-chars 55`: the test-book sentences that fit).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from attnserve.cli import main
from tests.service.helpers import LiveServer, make_settings

pytestmark = pytest.mark.slow
TINY_MODEL_FLAGS = ["--max-chars", "55", "--allow-empty", "--stage-seconds", "3"]


def _results(out: Path) -> tuple[Path, dict[str, Any]]:
    (run,) = out.iterdir()
    return run, json.loads((run / "summary.json").read_text())


def test_ladder_against_a_started_server_has_no_failures(
    tiny_onnx_import: Path, tiny_lm_dir: Path, tmp_path: Path
) -> None:
    lm = tmp_path / "models" / "tiny-lm"  # served beside the translation model: chat traffic
    shutil.copytree(tiny_lm_dir, lm)
    out = tmp_path / "out"
    code = main(
        ["loadtest", "--model", f"{tiny_onnx_import},{lm}", "--variant", "fp32"]
        + ["--threads", "1", "--users", "2,4", "--out", str(out), *TINY_MODEL_FLAGS]
    )
    run, summary = _results(out)
    assert code == 0, summary["verdict"]
    assert summary["verdict"]["unexpected_failures"] == 0 and summary["verdict"]["counters_match"]
    for stage, users in zip(summary["stages"], (2, 4), strict=True):
        assert stage["users"] == users and stage["requests"] > 0 and stage["failures"] == 0
        assert stage["errors_by_status"] == {} and stage["counters"]["match"]
        assert stage["record_matches_locust"] and stage["output_tokens"] > 0
        assert stage["latency_ms"]["p50"] is not None
    assert sum(s["ttft_ms"]["streams"] for s in summary["stages"]) > 0
    record = json.loads((run / "u004_record.json").read_text())
    assert set(record["latency_ms"]) >= {
        "/v1/chat/completions",
        "/v1/chat/completions stream",
        "/v1/translate short beam1",
    }
    assert [m["id"] for m in summary["models"]] == ["opus-mt-tiny", "tiny-lm"]
    assert (
        summary["models"][0]["id"] == "opus-mt-tiny"
        and "--variant fp32" in (summary["server_command"])
    )
    for name in (
        "summary.md",
        "throughput.png",
        "latency.png",
        "latency_distribution.png",
        "server.log",
        "u002_stats.csv",
        "u002_stats_history.csv",
        "u002_failures.csv",
        "u004_record.json",
        "u004_metrics_after.txt",
    ):
        assert (run / name).is_file(), name


def test_an_overloaded_server_answers_429_and_counts_every_one(
    tiny_onnx_import: Path, tmp_path: Path
) -> None:
    """--host: a server with room for one running and one waiting request, six users."""
    settings = make_settings(tiny_onnx_import, variant="fp32", max_waiting=1, max_batch_rows=1)
    with LiveServer(settings) as server:
        code = main(
            ["loadtest", "--host", server.url, "--users", "6", "--out", str(tmp_path)]
            + ["--weights", "batch=0", "--beams", "long=1", *TINY_MODEL_FLAGS]
        )
    _, summary = _results(tmp_path)
    (stage,) = summary["stages"]
    assert code == 0, summary["verdict"]  # 429s are allowed, nothing else is
    assert stage["errors_by_status"].get("429", 0) > 0
    assert set(stage["errors_by_status"]) == {"429"} and stage["unexpected_failures"] == 0
    assert stage["counters"]["match"], stage["counters"]
    assert summary["verdict"]["first_stage_with_429"] == 6 and summary["server_command"] is None
