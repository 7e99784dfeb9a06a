"""`attnserve bench-lm` on the tiny language model: every variant decodes exactly the asked
number of tokens, the report has a row per variant, and the CLI writes it."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from attnserve.bench.lm import bench_lm, markdown, write_report
from attnserve.cli import main
from attnserve.export.lm_export import export_lm_model


@pytest.fixture(scope="module")
def lm_dir(tiny_lm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench-lm") / "tiny-lm"
    shutil.copytree(tiny_lm_dir, out)
    export_lm_model(out, ("fp32", "int8"), verify=False)
    return out


def test_bench_lm_times_every_variant(lm_dir: Path, tmp_path: Path) -> None:
    text = " ".join(f"w{i % 40}" for i in range(64))
    results = bench_lm(
        lm_dir,
        ["fp32", "int8"],
        new_tokens=6,
        prefill_tokens=24,
        repeats=2,
        long_text=text,
        read_rate_megabytes=32,
    )
    assert [r.variant for r in results] == ["fp32", "int8"]
    for r in results:
        assert r.new_tokens == 6 and r.prefill_tokens == 24
        assert len(r.decode_runs) == 2 and r.decode_tokens_per_second > 0
        assert r.prefill_tokens_per_second > 0
    rate = results[0].machine_read_gb_s  # measured once, in the same run
    assert rate is not None and rate > 0 and {r.machine_read_gb_s for r in results} == {rate}
    table = markdown(results)
    rows = [line for line in table.splitlines() if line.startswith("| attnserve")]
    assert len(rows) == 2 and "| attnserve int8 |" in table
    share = results[1].weight_gb_per_second / rate  # type: ignore[operator]
    assert rows[1].endswith(f" {share:.0%} |") and f"at {rate:.1f} GB/s" in table
    assert "read rate" not in markdown([replace(r, machine_read_gb_s=None) for r in results])
    write_report(results, tmp_path, "tiny")
    assert len(json.loads((tmp_path / "tiny.json").read_text())) == 2
    assert (tmp_path / "tiny.png").stat().st_size > 0  # matplotlib: a test dependency
    with pytest.raises(ValueError, match="not 500"):
        bench_lm(lm_dir, ["fp32"], prefill_tokens=500, long_text=text)


def test_bench_lm_cli(lm_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench-lm", "--model", str(lm_dir), "--variants", "fp32", "--new-tokens", "4"]
    args += ["--prefill-tokens", "16", "--repeats", "1", "--output-dir", str(tmp_path)]
    assert main([*args, "--read-rate-mb", "16"]) == 0
    out = capsys.readouterr().out
    assert "| attnserve fp32 |" in out and "with as many threads" in out
    assert main([*args, "--read-rate-mb", "0"]) == 0
    assert "with as many threads" not in capsys.readouterr().out
    assert (tmp_path / "bench-lm.md").is_file()


def test_mixed_workload_through_the_scheduler(lm_dir: Path) -> None:
    from attnserve.bench.lm import mixed_workload, workload_markdown

    results = [
        mixed_workload(lm_dir, mode, 4, variant="fp32", seconds=2.0)
        for mode in ("static", "continuous")
    ]
    for r in results:
        assert r.requests > 0 and r.output_tokens > 0 and r.tokens_per_second > 0
        assert 0 < r.ttft_p50 <= r.ttft_p99
    table = workload_markdown(results)
    assert "| 4 | static |" in table and "| 4 | continuous |" in table


def test_workload_chart(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from attnserve.bench.lm import WorkloadResult, write_workload_chart

    results = [
        WorkloadResult(mode, clients, 60.0, 10, 600, rate, 0.5, p99)
        for clients in (16, 64)
        for mode, rate, p99 in (("static", 80.0, 3.8), ("continuous", 140.0, 1.2))
    ]
    path = write_workload_chart(results, tmp_path / "w.png", "workload")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
