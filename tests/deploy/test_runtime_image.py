"""The runtime image's contract, run here without Docker: its CMD and ENV serve a staged model
with only the packages the image installs, write nothing outside the volume, and answer the
HEALTHCHECK."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from tests.deploy.conftest import (
    CPU_REQUIREMENTS,
    RuntimeServer,
    blocked_modules,
    runtime_distributions,
    snapshot,
)
from tests.deploy.files import REQUIREMENTS_DIR
from tests.deploy.runtime_image import NotInImage
from tests.service.helpers import free_port

EXPORT_ONLY = ("torch", "onnxscript", "safetensors")


# (ids: a test whose keywords include "gpu" is skipped without CUDA, tests/conftest.py)
@pytest.mark.parametrize("target", ["cpu", "gpu"], ids=["cpu-image", "cuda-image"])
def test_the_runtime_images_install_no_export_or_test_packages(target: str) -> None:
    runtime = runtime_distributions(REQUIREMENTS_DIR / f"requirements-{target}.txt")
    unwanted = {*EXPORT_ONLY, "transformers", "pytest", "sacrebleu", "locust", "setuptools", "pip"}
    assert not runtime & unwanted
    assert {"attnserve", "fastapi", "uvicorn", "onnx", "sentencepiece"} <= runtime


def test_what_the_image_lacks_cannot_be_imported() -> None:
    blocked = blocked_modules(CPU_REQUIREMENTS)
    assert {*EXPORT_ONLY, "transformers", "pytest"} <= blocked
    assert not {"attnserve", "onnxruntime", "fastapi", "numpy"} & blocked
    with pytest.raises(ModuleNotFoundError, match="not in the runtime image"):
        NotInImage({"torch"}).find_spec("torch.nn", None)


def test_the_image_command_serves_the_staged_model(runtime_server: RuntimeServer) -> None:
    assert not (runtime_server.model_dir / "model.safetensors").exists()
    ready = httpx.get(runtime_server.url + "/readyz", timeout=5)
    assert ready.status_code == 200, ready.text
    models = httpx.get(runtime_server.url + "/v1/models", timeout=5).json()["data"]
    assert [(m["id"], m["variant"], m["provider"]) for m in models] == [
        (runtime_server.model_dir.name, "int8", "CPUExecutionProvider")
    ]
    body = {"text": "kamaru tesino", "target_lang": "de"}
    answer = httpx.post(runtime_server.url + "/v1/translate", json=body, timeout=30)
    assert answer.status_code == 200, answer.text


def test_serving_writes_nothing(runtime_server: RuntimeServer) -> None:
    """The model directory, the working directory, TMPDIR and HOME (the image's volume) stay as
    they were. Without the image's ORT_DISABLE_TELEMETRY, ONNX Runtime writes HOME/.cache and
    TMPDIR/.ses: a read-only root filesystem needs a writable /tmp then."""
    assert snapshot(runtime_server.model_dir) == runtime_server.model_before
    for directory in (runtime_server.workdir, runtime_server.tmpdir, runtime_server.home):
        assert list(directory.iterdir()) == [], directory


def _healthcheck(port: int, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ATTNSERVE_PORT": str(port)}
    command = [sys.executable, "-m", "attnserve.service.healthcheck", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)


def test_healthcheck(runtime_server: RuntimeServer) -> None:
    port = int(runtime_server.url.rsplit(":", 1)[1])
    assert _healthcheck(port).returncode == 0
    assert _healthcheck(port, "/readyz").returncode == 0
    missing = _healthcheck(port, "/no-such-path")
    assert missing.returncode == 1 and "HTTP 404" in missing.stderr
    refused = _healthcheck(free_port())
    assert refused.returncode == 1 and "healthcheck failed" in refused.stderr
