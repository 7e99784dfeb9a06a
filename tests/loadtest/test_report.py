"""Summary parser, counter check and plots on a recorded run (tests/loadtest/recorded_run).

The data are two stages of a real `attnserve loadtest` against the tiny test model, served with
`--max-waiting 1 --max-batch-rows 4` so that the 6-user stage got 429s (batch shape off):
`u001_*` (1 user, no failure) and `u006_*` (6 users, ten 429s), locust's CSVs, the locustfile's
record and the /metrics scrapes around the 6-user stage.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from attnserve.loadtest.counters import CounterCheck, api_request_counts, compare, settle
from attnserve.loadtest.plots import write_plots
from attnserve.loadtest.report import (
    AGGREGATED,
    load_stage,
    markdown_table,
    percentile,
    read_failures,
    read_stats,
    write_summary,
)
from attnserve.loadtest.traffic import Record

DATA = Path(__file__).parent / "recorded_run"


def _text(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


def _check(client: Counter[tuple[str, int]] | None = None) -> CounterCheck:
    record = Record.load(DATA / "u006_record.json")
    before, after = _text("u006_metrics_before.txt"), _text("u006_metrics_after.txt")
    return compare(before, after, record.responses if client is None else client)


def test_read_stats_and_failures() -> None:
    stats = read_stats(DATA / "u006_stats.csv")
    assert set(stats) == {
        "/v1/generate stream sampling",
        "/v1/translate long beam4",
        "/v1/translate short beam1",
        AGGREGATED,
    }
    total = stats[AGGREGATED]
    assert (total.requests, total.failures) == (94, 10)
    assert total.requests_per_s == pytest.approx(33.756, abs=1e-3)
    assert total.percentile("99%") == 57.0 and total.percentile("50%") == 20.0
    assert read_failures(DATA / "u006_failures.csv") == Counter({"HTTP 429 overloaded": 10})
    assert read_failures(DATA / "u001_failures.csv") == Counter()
    assert read_failures(DATA / "missing.csv") == Counter()


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (
        50.0,
        99.0,
        100.0,
    )
    assert percentile([7.0], 95) == 7.0 and percentile([], 50) is None


def test_counters_agree_with_the_record_and_disagreement_shows() -> None:
    after = api_request_counts(_text("u006_metrics_after.txt"))
    assert after[("/v1/translate", 429)] == 3 and ("/metrics", 200) not in after
    check = _check()
    assert check.match
    assert check.to_dict()["server"] == {
        "/v1/generate": {"200": 28, "429": 7},
        "/v1/models": {"200": 1},
        "/v1/translate": {"200": 56, "429": 3},
    }
    one_more = Record.load(DATA / "u006_record.json").responses + Counter(
        {("/v1/generate", 200): 1}
    )
    assert not _check(one_more).match


def test_settle_waits_for_late_counts() -> None:
    before, after = _text("u006_metrics_before.txt"), _text("u006_metrics_after.txt")
    scrapes = iter([before, before, after])
    responses = Record.load(DATA / "u006_record.json").responses
    check, last = settle(before, responses, lambda: next(scrapes), timeout=5.0, interval=0.0)
    assert check.match and last == after
    check, _ = settle(before, responses, lambda: before, timeout=0.0)
    assert not check.match  # gives up at the timeout


def test_stage_summary_of_the_recorded_run() -> None:
    stage = load_stage(DATA / "u006", 6, _check())
    seconds = 94 / 33.75623683887205
    assert stage["users"] == 6 and stage["seconds"] == round(seconds, 2)
    assert (stage["requests"], stage["failures"], stage["texts"]) == (94, 10, 84)
    assert stage["ok_requests_per_s"] == round(84 / seconds, 3)
    assert stage["target_tokens_per_s"] == round(3260 / seconds, 1)
    assert stage["errors_by_status"] == {"429": 10}
    assert stage["status_counts"] == {"200": 85, "429": 10}  # with GET /v1/models
    assert stage["failures_by_message"] == {"HTTP 429 overloaded": 10}
    assert stage["unexpected_failures"] == 0
    assert stage["record_matches_locust"] and stage["counters"]["match"]
    # Latencies of the 84 successes, from the record (not locust's, which include the 429s).
    record = Record.load(DATA / "u006_record.json")
    successes = sorted(t for v in record.latency_ms.values() for t in v)
    assert len(successes) == 84
    assert stage["latency_ms"]["p50"] == round(successes[41], 1)
    assert stage["latency_ms"]["max"] == round(successes[-1], 1)
    assert stage["latency_percentiles_ms"]["99.9%"] == round(successes[-1], 1)
    assert stage["ttft_ms"]["streams"] == 26
    short = stage["by_name"]["/v1/translate short beam1"]
    assert (short["requests"], short["failures"]) == (36, 1)
    assert stage["locust_latency_ms"]["99%"] == 57.0


def test_summary_files_and_plots(tmp_path: Path) -> None:
    stages = [load_stage(DATA / "u001", 1), load_stage(DATA / "u006", 6, _check())]
    assert stages[0]["unexpected_failures"] == 0 and stages[0]["errors_by_status"] == {}
    written = write_summary(tmp_path, stages, {"title": "tiny test model"})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["verdict"] == {
        "unexpected_failures": 0,
        "counters_match": True,  # the 1-user stage has no check: only checked stages count
        "record_matches_locust": True,
        "first_stage_with_429": 6,
    }
    assert [s["users"] for s in summary["stages"]] == [1, 6]
    table = markdown_table(stages).splitlines()
    assert len(table) == 4 and table[2].startswith("| 1 | ") and "| 429: 10 | equal |" in table[3]
    assert (tmp_path / "summary.md").read_text().startswith("**tiny test model**")
    pngs = write_plots(stages, tmp_path, "tiny test model")
    assert [p.name for p in pngs] == ["throughput.png", "latency.png", "latency_distribution.png"]
    for path in pngs:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert len(written) == 2
