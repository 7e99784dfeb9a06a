"""`attnserve generate`: stdin prompts (or chat messages) to JSON lines, on torch and ONNX."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from attnserve.cli import main
from attnserve.engine.generator import Generator
from attnserve.engine.options import DecodingOptions


def run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], lines: str, *args: str
) -> tuple[int, list[dict], dict]:
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in out.splitlines()]
    summary = json.loads(err.strip().splitlines()[-1]) if code == 0 else {}
    return code, records, summary


def test_prompts_and_chats_on_torch(
    tiny_lm_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--model", str(tiny_lm_dir), "--backend", "torch", "--max-new-tokens", "6"]
    code, records, summary = run(monkeypatch, capsys, "w1 w2 w3\nw7\n", *flags)
    assert code == 0 and len(records) == 2
    generator = Generator.from_model_dir(tiny_lm_dir, backend="torch")
    expected = generator.generate(
        [generator.prompt_ids("w1 w2 w3"), generator.prompt_ids("w7")],
        DecodingOptions(max_new_tokens=6),
    )
    for record, result in zip(records, expected, strict=True):
        best = result.completions[0]
        assert record["token_ids"] == best.token_ids
        assert record["text"] == best.text
        assert record["finish_reason"] == best.finish_reason
    assert records[0]["prompt_tokens"] == 3
    assert summary["prompts"] == 2 and summary["backend"] == "torch"

    code, chats, _ = run(monkeypatch, capsys, "w1 w2\n", *flags, "--chat", "--system", "w5")
    messages = [{"role": "system", "content": "w5"}, {"role": "user", "content": "w1 w2"}]
    chat = generator.generate(
        [generator.prompt_ids(messages=messages)], DecodingOptions(max_new_tokens=6)
    )
    assert code == 0 and chats[0]["token_ids"] == chat[0].completions[0].token_ids
    assert chats[0]["prompt_tokens"] == len(generator.prompt_ids(messages=messages))


def test_sampling_flags_samples_and_logprobs(
    tiny_lm_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--model", str(tiny_lm_dir), "--backend", "torch", "--max-new-tokens", "5"]
    sampling = [
        *flags,
        "--sampling",
        "--seed",
        "3",
        "-n",
        "3",
        "--min-p",
        "0.01",
        "--logprobs",
        "2",
    ]
    code, records, _ = run(monkeypatch, capsys, "w1 w2\n", *sampling)
    assert code == 0
    assert len(records[0]["completions"]) == 3
    assert len(records[0]["logprobs"]) == len(records[0]["token_ids"])
    assert all(len(entry["top"]) == 2 for entry in records[0]["logprobs"])
    _, again, _ = run(monkeypatch, capsys, "w1 w2\n", *sampling)
    assert again == records  # the seed makes it reproducible
    monkeypatch.setattr("sys.stdin", io.StringIO("w1\n"))
    assert main(["generate", *flags, "-n", "2"]) == 2  # several samples need --sampling
    assert "invalid option n: several samples need sampling" in capsys.readouterr().err


def test_onnx_is_exported_on_first_use(
    tiny_lm_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import shutil

    model = tmp_path / "lm"
    shutil.copytree(tiny_lm_dir, model)
    flags = ["--model", str(model), "--max-new-tokens", "6"]
    code, records, summary = run(monkeypatch, capsys, "w1 w2 w3\n", *flags, "--variant", "fp32")
    assert code == 0 and summary["backend"] == "onnx" and summary["variant"] == "fp32"
    assert (model / "onnx" / "fp32" / "step.onnx").is_file()
    _, reference, _ = run(monkeypatch, capsys, "w1 w2 w3\n", *flags, "--backend", "torch")
    assert records == reference  # fp32 graphs decode exactly as torch
    code, _, _ = run(monkeypatch, capsys, "w1\n", *flags, "--variant", "int8", "--no-auto-export")
    assert code == 2
