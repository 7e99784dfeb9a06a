"""Service fixtures: the tiny exported model served by a real uvicorn server on a free port."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import build_once
from tests.service.helpers import LiveServer, make_settings

# Limits of the shared server, small enough to test each one.
MAX_TEXTS = 8
MAX_BODY = 64 * 1024
MAX_BEAM = 4
MAX_TIMEOUT_MS = 60_000


@pytest.fixture(scope="session")
def model_dir(tiny_onnx_import: Path) -> Path:
    """The tiny random Marian model, exported (fp32 and int8); max_positions = 64."""
    return tiny_onnx_import


@pytest.fixture(scope="session")
def live(model_dir: Path) -> Iterator[LiveServer]:
    """A server shared by the tests that only read its answers (fp32: see test_api)."""
    settings = make_settings(
        model_dir,
        variant="fp32",
        max_texts_per_request=MAX_TEXTS,
        max_body_bytes=MAX_BODY,
        max_beam_size=MAX_BEAM,
        max_timeout_ms=MAX_TIMEOUT_MS,
    )
    with LiveServer(settings) as server:
        yield server


@pytest.fixture(scope="session")
def lm_model(tiny_lm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny language model, its int8 graphs exported as a server's first start does."""
    from attnserve.service.launch import check_models

    def build(folder: Path) -> Path:
        out = folder / "tiny-lm"
        shutil.copytree(tiny_lm_dir, out)
        check_models(make_settings(out, variant="int8"))  # exports (as `attnserve serve`)
        return out

    return build_once(tmp_path_factory, "served-lm", build)


@pytest.fixture(scope="session")
def both(lm_model: Path, model_dir: Path) -> Iterator[LiveServer]:
    """The tiny translation model (the default) and the tiny language model, int8."""
    from attnserve.service.launch import check_models

    settings = make_settings(model_dir, models=[str(model_dir), str(lm_model)], variant="int8")
    check_models(settings)  # both exported already: nothing to do
    with LiveServer(settings) as server:
        yield server


@pytest.fixture(scope="session")
def byte_lm(
    tiny_byte_lm_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """The tiny language model whose tokens are bytes (it can write any text: JSON, tool
    calls), fp32: structured outputs and tool calls."""
    from attnserve.service.launch import check_models

    out = tmp_path_factory.mktemp("served") / "tiny-byte-lm"
    shutil.copytree(tiny_byte_lm_dir, out)
    settings = make_settings(out, variant="fp32", max_beam_size=MAX_BEAM)
    check_models(settings)
    with LiveServer(settings) as server:
        yield server
