"""`attnserve bench-http` on the tiny model: offline and both batching modes, same tokens."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from attnserve.bench.http import (
    Run,
    choose_work,
    concurrency_levels,
    ladder_series,
    mode_serve_args,
    percentiles,
    summary,
)
from attnserve.loadtest.sentences import LanguagePool


def test_mixed_work_alternates_short_and_long() -> None:
    pool = LanguagePool.of([f"{'w ' * n}." for n in range(1, 31)])
    work = choose_work(pool, 6, mixed=True, seed=1)
    assert work.kinds == ["short", "long"] * 3
    assert all(t in pool.short for t in work.texts[::2]) and all(
        t in pool.long for t in work.texts[1::2]
    )
    assert choose_work(pool, 6, mixed=True, seed=1) == work  # seeded


def test_percentiles_and_summary_table() -> None:
    assert percentiles([float(v) for v in range(1, 101)]) == {"p50": 51.0, "p99": 100.0, "n": 100}
    runs = [
        Run("offline", 0, 2.0, 1000, {}),
        Run("offline", 1, 2.5, 1000, {}),
        Run("http-continuous", 0, 2.5, 1000, {"short": {"p50": 10.0, "p99": 30.0}}),
        Run("http-continuous", 1, 2.5, 1000, {"short": {"p50": 12.0, "p99": 40.0}}),
    ]
    table = summary(runs)
    assert "| offline | 450 | 1.00x | 500, 400 | - |" in table
    assert "| http-continuous | 400 | 0.89x | 400, 400 | short 12 / 40 |" in table


def test_a_ladder_of_client_levels_gets_a_clients_column_and_ratios_per_level() -> None:
    assert concurrency_levels("64") == [64]
    assert concurrency_levels("4, 8,16") == [4, 8, 16]
    assert concurrency_levels("8,4,8") == [8, 4]  # each level once
    for bad in ("", "0", "4,x", "-2"):
        with pytest.raises(argparse.ArgumentTypeError):
            concurrency_levels(bad)
    short = {"short": {"p50": 5.0, "p99": 9.0}, "all": {"p50": 6.0, "p99": 20.0}}
    runs = [
        Run("offline", 0, 1.0, 1000, {}, clients=4),
        Run("http-request", 0, 2.0, 1000, short, clients=4),
        Run("offline", 0, 1.0, 800, {}, clients=16),
        Run("http-request", 0, 1.0, 600, {"all": {"p50": 7.0, "p99": 30.0}}, clients=16),
    ]
    table = summary(runs).splitlines()
    assert table[0].startswith("| clients | system |")
    # Each level's ratio is to the offline runs of its own level.
    assert "| 4 | http-request | 500 | 0.50x | 500 | short 5 / 9; all 6 / 20 |" in table
    assert "| 16 | http-request | 600 | 0.75x | 600 | all 7 / 30 |" in table
    series = ladder_series(runs)
    assert series["http-request"] == {
        "clients": [4.0, 16.0],
        "tokens": [500.0, 600.0],
        "p99": [9.0, 30.0],  # the short requests' p99 where the load had them
    }
    assert series["offline"]["tokens"] == [1000.0, 800.0]


def test_modes_name_serve_flags() -> None:
    assert mode_serve_args("request") == ("request", "--batching request")
    assert mode_serve_args("two=--max-cohorts 2") == ("two", "--max-cohorts 2")
    assert mode_serve_args("static") == ("static", "--batching static")
    for bad in ("iteration", "=--max-cohorts 2", "x="):
        with pytest.raises(ValueError, match="--modes"):
            mode_serve_args(bad)


def test_bench_http_runs_both_modes_on_the_tiny_model(
    tiny_onnx_import: Path, tmp_path: Path
) -> None:
    command = [
        sys.executable,
        "-m",
        "attnserve.cli",
        "bench-http",
        "--model",
        str(tiny_onnx_import),
    ]
    command += ["--variant", "fp32", "--sentences", "6", "--repeats", "1", "--concurrency", "3"]
    command += ["--beam-size", "2", "--batch-size", "2", "--mixed", "--output-dir", str(tmp_path)]
    command += ["--max-chars", "55"]  # the tiny model's inputs stop at 64 tokens
    command += ["--modes", "continuous,cohorts=--max-cohorts 2 --max-join-padding 0,request"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = [json.loads(line) for line in (tmp_path / "http.jsonl").read_text().splitlines()]
    systems = ["offline", "http-continuous", "http-cohorts", "http-request"]
    assert [r["system"] for r in runs] == systems
    # The same sentences and decoding on every side: the same number of target tokens.
    assert len({r["output_tokens"] for r in runs}) == 1
    assert set(runs[1]["latency_ms"]) == {"short", "long", "all"}
    assert "| http-request |" in (tmp_path / "http.md").read_text()


def test_bench_http_in_process_drives_the_scheduler(tiny_onnx_import: Path, tmp_path: Path) -> None:
    """--in-process: each mode's serve flags become scheduler limits, no server is started."""
    command = [sys.executable, "-m", "attnserve.cli", "bench-http", "--model"]
    command += [str(tiny_onnx_import), "--variant", "fp32", "--sentences", "6", "--repeats", "1"]
    command += ["--concurrency", "1,3", "--beam-size", "2", "--batch-size", "2"]
    command += ["--modes", "continuous,wait=--max-join-padding 0,request,static", "--in-process"]
    command += ["--max-chars", "55", "--output-dir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "starting" not in done.stderr  # no server process
    runs = [json.loads(line) for line in (tmp_path / "http.jsonl").read_text().splitlines()]
    systems = ["offline", "engine-continuous", "engine-wait", "engine-request", "engine-static"]
    assert [r["system"] for r in runs] == systems * 2
    assert [r["clients"] for r in runs] == [1] * 5 + [3] * 5
    # The same outputs whatever the batching (static: finished rows decoded on as padding).
    assert len({r["output_tokens"] for r in runs}) == 1
    assert all(r["detail"]["steps"] > 0 and r["latency_ms"]["all"]["n"] == 6 for r in runs[1:5])
    # One client: one request at a time, so a decoder step never holds more than its 2 rows.
    assert all(r["detail"]["rows_per_step"] <= 2 for r in runs[1:5])
    assert "steps of" in (tmp_path / "http.md").read_text()
    assert (tmp_path / "http.png").read_bytes().startswith(b"\x89PNG")
