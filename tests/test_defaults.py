"""attnserve.defaults: each default defined once, and where the default model is found."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from attnserve import defaults
from attnserve.service.settings import Settings


def test_the_default_model_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(defaults.DEFAULT_MODEL_ENV, raising=False)
    checkout = Path(defaults.__file__).resolve().parents[1] / "checkpoints" / "ende-small"
    assert defaults.default_model_dir() == checkout  # an editable install in this checkout
    monkeypatch.setenv(defaults.DEFAULT_MODEL_ENV, str(tmp_path / "mine"))
    assert defaults.default_model_dir() == tmp_path / "mine"
    # Installed from a wheel (site-packages has no checkpoints/): relative to the working dir.
    monkeypatch.delenv(defaults.DEFAULT_MODEL_ENV)
    monkeypatch.setattr(defaults, "__file__", str(tmp_path / "site" / "attnserve" / "x.py"))
    assert defaults.default_model_dir() == Path("checkpoints") / "ende-small"


def test_the_service_settings_offer_the_shared_choices() -> None:
    """Settings spells its choices as Literal types (pydantic needs them): they must be the
    shared defaults, or the CLI and the service would accept different values."""
    fields = Settings.model_fields

    def choices(name: str) -> tuple[str, ...]:
        return tuple(typing.get_args(fields[name].annotation))

    assert set(choices("variant")) == set(defaults.VARIANTS)
    assert set(choices("provider")) == set(defaults.PROVIDERS)
    assert set(choices("backend")) == set(defaults.BACKENDS)
    assert fields["variant"].default == defaults.DEFAULT_VARIANT
