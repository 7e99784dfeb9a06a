"""`attnserve bench`: interleaved timing, token counts, the report, worker processes, peers.

Tiny preset, one repeat, a few sentences: seconds, not minutes. Peers are skipped when their
package is missing (ctranslate2 is not a test dependency).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from attnserve.bench.offline import (
    BackendRunner,
    BenchConfig,
    BenchResult,
    InProcess,
    random_sources,
    run_interleaved,
)
from attnserve.bench.peers import available
from attnserve.bench.report import markdown_table, write_report
from attnserve.bench.workers import RunnerSpec, WorkerRunner
from attnserve.cli import main
from attnserve.engine.loading import load_backend


class FakeRunner:
    """Writes `per_sentence` tokens a sentence and logs when it was called."""

    def __init__(self, name: str, calls: list[str], per_sentence: int | None = None) -> None:
        self.name, self.calls, self.per_sentence = name, calls, per_sentence

    def timed_decode(self, config: BenchConfig) -> tuple[int, float]:
        self.calls.append(self.name)
        per = config.new_tokens if self.per_sentence is None else self.per_sentence
        return 4 * per, 0.5 if self.name == "slow" else 0.25

    def peak_rss_mb(self) -> float:
        return 100.0

    def model_size_mb(self) -> float | None:
        return 1.5


def test_run_interleaved_alternates_runners_and_reports_medians() -> None:
    calls: list[str] = []
    runners = {
        "slow": FakeRunner("slow", calls),
        "fast": FakeRunner("fast", calls),
        "short": FakeRunner("short", calls, per_sentence=3),
    }
    configs = [BenchConfig(1, 2, 8), BenchConfig(4, 2, 8)]
    results = run_interleaved(runners, configs, sentences=4, repeats=2)
    # Per config: one warm-up call each, then the repeats round-robin.
    assert calls[:9] == ["slow", "fast", "short"] * 3
    assert len(results) == 6 and {(r.beam_size, r.batch_size) for r in results} == {(1, 2), (4, 2)}
    slow, fast, short = results[:3]
    assert slow.tokens_per_second == 64.0 and fast.tokens_per_second == 128.0
    assert slow.runs == [64.0, 64.0] and slow.target_tokens == 32 and slow.peak_rss_mb == 100.0
    assert short.extra == {"expected_tokens": 32} and not fast.extra  # wrong length is visible


def test_random_sources_avoid_special_ids() -> None:
    sources = random_sources(50, 20, eos_id=0, exclude={1, 19}, min_len=3, max_len=6)
    assert all(s[-1] == 0 and 4 <= len(s) <= 7 for s in sources)
    body = np.concatenate([s[:-1] for s in sources])
    assert body.min() >= 3 and not np.isin(body, [1, 19]).any()


@pytest.fixture(scope="module")
def sources(tiny_onnx_import: Path) -> list[list[int]]:
    backend = load_backend(tiny_onnx_import, "onnx-fp32", provider="cpu")
    return random_sources(5, backend.spec.vocab_size, exclude={backend.spec.pad_id})


@pytest.mark.parametrize("name", ["torch", "onnx-fp32", "onnx-int8"])
def test_backends_write_exactly_the_fixed_length(
    tiny_onnx_import: Path, sources: list[list[int]], name: str
) -> None:
    runner = BackendRunner(load_backend(tiny_onnx_import, name, threads=1, provider="cpu"))
    for beam in (1, 3):
        assert runner.decode(sources, BenchConfig(beam, 2, 6)) == len(sources) * 6


def test_worker_process_reports_its_own_rss(
    tiny_onnx_import: Path, sources: list[list[int]]
) -> None:
    spec = RunnerSpec("onnx-int8", "onnx-int8", str(tiny_onnx_import), 1, {"provider": "cpu"})
    worker = WorkerRunner(spec, sources)
    try:
        tokens, seconds = worker.timed_decode(BenchConfig(2, 4, 5))
        assert tokens == len(sources) * 5 and seconds > 0
        # A worker that never imported torch: far below this (torch-importing) test process.
        assert 0 < worker.peak_rss_mb() < 400
        size = worker.model_size_mb()
        assert size is not None and size > 0
    finally:
        worker.close()


def test_report_table_and_files(tmp_path: Path) -> None:
    results = [
        BenchResult(name, beam, 32, 8, 256, tps, [tps], 50.0, 2.0, 1, True)
        for name, factor in (("torch", 1.0), ("onnx-int8", 2.5))
        for beam, tps in ((1, 100.0 * factor), (4, 40.0 * factor))
    ]
    table = markdown_table(results)
    assert "| attnserve ORT int8 | 250 (2.50x) | 100 (2.50x) | 2.0 | 50 |" in table
    written = write_report(results, tmp_path, "t", model="tiny", chart=False)
    assert [p.name for p in written] == ["t.jsonl", "t.md"]
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and lines[0]["model"] == "tiny" and "cpu" in lines[0]["machine"]


def test_chart_is_a_small_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = [BenchResult("torch", 4, 32, 8, 256, 10.0, [10.0], 50.0)]
    [*_, png] = write_report(results, tmp_path, "c", model="tiny")
    assert png.suffix == ".png" and png.read_bytes()[:4] == b"\x89PNG"
    assert png.stat().st_size < 100_000


@pytest.mark.slow
def test_cli_bench_preset_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "bench",
            "--preset",
            "tiny",
            "--preset-overrides",
            '{"vocab_size": 48, "final_logits_bias": false}',
            "--backends",
            "torch,onnx-int8,onnx-fp16",  # no GPU: fp16 is skipped with a warning
            "--beam-sizes",
            "2",
            "--batch-sizes",
            "1,4",
            "--sentences",
            "4",
            "--new-tokens",
            "4",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--no-isolate",
            "--output-dir",
            str(tmp_path),
            "--name",
            "tiny",
        ]
    )
    assert code == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert {(x["backend"], x["batch_size"]) for x in lines} == {
        (b, n) for b in ("torch", "onnx-int8") for n in (1, 4)
    }
    assert all(x["target_tokens"] == 16 and not x["isolated"] for x in lines)
    md = (tmp_path / "tiny.md").read_text()
    assert "vocab 48" in md and "attnserve ORT int8" in md


@pytest.mark.slow
def test_peers_decode_the_same_lengths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A random Marian of the tiny shape, imported for attnserve and converted for the peers;
    CTranslate2 is dropped (with a warning) when it is not installed."""
    pytest.importorskip("transformers")
    argv = ["bench", "--preset", "tiny", "--backends", "onnx-int8,hf,ct2-int8", "--no-isolate"]
    argv += ["--beam-sizes", "2", "--batch-sizes", "3", "--sentences", "5", "--new-tokens", "5"]
    assert main([*argv, "--repeats", "1", "--threads", "1"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    expected = ["onnx-int8", "hf"] + (["ct2-int8"] if available("ct2-int8") else [])
    assert [x["backend"] for x in lines] == expected
    assert all(x["target_tokens"] == 25 and not x["extra"] for x in lines)


def test_in_process_runner_rss_is_the_process_peak(
    tiny_onnx_import: Path, sources: list[list[int]]
) -> None:
    runner = InProcess(
        BackendRunner(load_backend(tiny_onnx_import, "onnx-fp32", provider="cpu")), sources
    )
    assert runner.timed_decode(BenchConfig(1, 5, 3))[0] == 15
    assert runner.peak_rss_mb() > 0


def test_io_binding_flag_reaches_the_onnx_backends_only_when_given() -> None:
    from attnserve.bench.runner import _onnx_options
    from attnserve.cli import build_parser

    parser = build_parser()
    default = parser.parse_args(["bench", "--preset", "tiny", "--provider", "cuda"])
    assert _onnx_options(default) == {"provider": "cuda"}  # the backend's default: on for CUDA
    off = parser.parse_args(["bench", "--preset", "tiny", "--no-io-binding"])
    assert _onnx_options(off) == {"provider": "auto", "io_binding": False}
    on = parser.parse_args(["bench", "--preset", "tiny", "--io-binding", "--provider", "cpu"])
    assert _onnx_options(on) == {"provider": "cpu", "io_binding": True}
