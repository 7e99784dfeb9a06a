"""Service fixtures: the tiny exported model served by a real uvicorn server on a free port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

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
