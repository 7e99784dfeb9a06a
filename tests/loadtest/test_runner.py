"""`attnserve loadtest` refuses clearly before any load: no model, no server, a bad ladder."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnserve.cli import main
from tests.service.helpers import free_port


def test_a_missing_model_is_named_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["loadtest", "--model", str(tmp_path / "ende-small"), "--out", str(tmp_path / "r")])
    assert code == 2 and not (tmp_path / "r").exists()
    error = capsys.readouterr().err
    assert "ende-small does not exist" in error and "LOADTEST_MODEL=DIR" in error


def test_a_host_that_does_not_answer_fails_before_any_stage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    host = f"http://127.0.0.1:{free_port()}"
    assert main(["loadtest", "--host", host, "--out", str(tmp_path)]) == 1
    assert "does not answer" in caplog.text and not list(tmp_path.iterdir())


@pytest.mark.parametrize("users", ["", "0,2", "two"])
def test_a_bad_ladder_is_refused(users: str, tmp_path: Path) -> None:
    assert main(["loadtest", "--host", "http://x", "--users", users, "--out", str(tmp_path)]) == 2
    assert not list(tmp_path.iterdir())
