"""attnserve.provision: the one path from a model directory to a backend, and its defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnserve.cli import build_parser
from attnserve.cli.flags import runtime
from attnserve.provision import ModelNotFoundError, Runtime, ensure_model_dir, provision
from attnserve.service.settings import Settings


@pytest.mark.parametrize("command", ["translate", "generate", "eval"])
def test_the_command_line_and_the_service_run_models_alike_by_default(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("BACKEND", "VARIANT", "PROVIDER", "THREADS", "SPINNING", "AUTO_EXPORT"):
        monkeypatch.delenv(f"ATTNSERVE_{name}", raising=False)
    flags = runtime(build_parser().parse_args([command]))
    assert flags == Settings().runtime == Runtime()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Path, object]]:
    """The default language model's import and the export, recorded instead of run."""
    seen: list[tuple[str, Path, object]] = []

    def imported(directory: Path) -> Path:
        seen.append(("import", directory, None))
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{}")
        return directory

    def exported(directory: Path, variant: str, *, allow: bool) -> bool:
        seen.append(("export", directory, (variant, allow)))
        return allow

    monkeypatch.setattr("attnserve.convert.packaged.ensure_default_lm", imported)
    monkeypatch.setattr("attnserve.export.ensure.ensure_exported", exported)
    return seen


def test_the_default_language_model_is_imported_on_first_use_only_when_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, Path, object]]
) -> None:
    lm = tmp_path / "models" / "lm"
    monkeypatch.setenv("ATTNSERVE_DEFAULT_LM", str(lm))
    with pytest.raises(ModelNotFoundError, match="--no-auto-export"):
        ensure_model_dir(lm, auto_export=False)
    assert calls == []
    assert ensure_model_dir(lm) == lm and calls == [("import", lm, None)]


def test_a_missing_directory_names_itself_and_how_to_get_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="attnserve import HF_DIR DIR"):
        ensure_model_dir(tmp_path / "nowhere")
    with pytest.raises(ModelNotFoundError, match=r"no config\.json"):
        ensure_model_dir(tmp_path)


def test_only_the_onnx_backend_exports(
    tmp_path: Path, calls: list[tuple[str, Path, object]]
) -> None:
    (tmp_path / "config.json").write_text("{}")
    provision(tmp_path, Runtime(backend="torch"))
    assert calls == []
    provision(tmp_path, Runtime(variant="fp32", auto_export=False))
    assert calls == [("export", tmp_path, ("fp32", False))]
