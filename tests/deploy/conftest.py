"""The service as the cpu image runs it: its CMD and ENV, its packages only, a staged model.

`runtime_server` starts `attnserve` in a subprocess with the Dockerfile's `cpu` stage CMD and
ATTNSERVE_* environment (host, port, threads and model path replaced for the test machine),
importing only what the image installs, on the tiny test model staged as the Dockerfile stages
the default model (its files without the torch weights, one ONNX variant). It answers a few
requests, so that every metric family has samples, and stops with SIGTERM, as Docker does.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.files import REQUIREMENTS_DIR, dockerfile_stages, read_requirements
from tests.deploy.runtime_image import BLOCKED_VARIABLE
from tests.service.helpers import free_port

RUNTIME_IMAGE = Path(__file__).with_name("runtime_image.py")
CPU_REQUIREMENTS = REQUIREMENTS_DIR / "requirements-cpu.txt"
# The files of a model directory that serving does not read (torch weights).
UNSERVED_FILES = ("model.safetensors",)


def runtime_distributions(requirements: Path) -> set[str]:
    """attnserve and the distributions `requirements` installs, with their dependencies."""
    todo = [Requirement(line).name for line in read_requirements(requirements)]
    found = {canonicalize_name("attnserve")}
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        found.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # optional on this platform; pip would not install it either
        for text in requires:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def blocked_modules(requirements: Path) -> set[str]:
    """Top-level modules of this venv that come only from distributions the image lacks."""
    runtime = runtime_distributions(requirements)
    return {
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if not any(canonicalize_name(dist) in runtime for dist in dists)
    }


def stage_model(source: Path, out: Path, variant: str) -> Path:
    """What the Dockerfile's export stage copies into an image: the model's files (not its
    torch weights) and onnx/<variant>."""
    out.mkdir(parents=True)
    for path in source.iterdir():
        if path.is_file() and path.name not in UNSERVED_FILES:
            shutil.copy2(path, out / path.name)
    shutil.copytree(source / "onnx" / variant, out / "onnx" / variant)
    return out


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under `directory`: (size, mtime in ns)."""
    return {
        str(path.relative_to(directory)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in sorted(directory.rglob("*"))
    }


@dataclass
class RuntimeServer:
    url: str
    process: subprocess.Popen[bytes]
    model_dir: Path
    model_before: dict[str, tuple[int, int]]
    workdir: Path
    tmpdir: Path
    home: Path
    log: Path

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text


def _wait_ready(server: RuntimeServer, timeout: float = 90.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if server.process.poll() is not None:
            pytest.fail(
                f"the server exited ({server.process.returncode}):\n{server.log.read_text()}"
            )
        try:
            if httpx.get(server.url + "/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail(f"the server did not become ready:\n{server.log.read_text()}")


def _send_traffic(url: str) -> None:
    """Requests that give every metric family samples (time per token needs 2+ tokens)."""
    with httpx.Client(base_url=url, timeout=30) as client:
        body = {"text": "kamaru tesino", "target_lang": "de", "beam_size": 1}
        translate = client.post("/v1/translate", json=body)
        assert translate.status_code == 200, translate.text
        body = {"text": "kamaru", "target_lang": "de", "min_new_tokens": 3, "max_new_tokens": 4}
        generate = client.post("/v1/generate", json=body)
        assert generate.status_code == 200, generate.text


@pytest.fixture(scope="session")
def runtime_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_onnx_import: Path
) -> Iterator[RuntimeServer]:
    stage = dockerfile_stages()["cpu"]
    root = tmp_path_factory.mktemp("runtime-image")
    variant = stage.env()["ATTNSERVE_VARIANT"]
    model_dir = stage_model(tiny_onnx_import, root / "models" / tiny_onnx_import.name, variant)
    workdir, home, tmpdir = root / "workdir", root / "home", root / "tmp"
    for directory in (workdir, home, tmpdir):
        directory.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_")}
    env.update({k: v for k, v in stage.env().items() if k != "PATH"})
    env.update(
        {
            "ATTNSERVE_MODELS": str(model_dir),
            "ATTNSERVE_HOST": "127.0.0.1",
            "ATTNSERVE_PORT": str(port),
            "ATTNSERVE_THREADS": "1",
            "HOME": str(home),  # the image's volume
            "TMPDIR": str(tmpdir),
            BLOCKED_VARIABLE: ",".join(sorted(blocked_modules(CPU_REQUIREMENTS))),
        }
    )
    command = stage.exec_form("CMD")
    assert command[0] == "attnserve"
    log = root / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, str(RUNTIME_IMAGE), *command[1:]],
            cwd=workdir,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = RuntimeServer(
        f"http://127.0.0.1:{port}",
        process,
        model_dir,
        snapshot(model_dir),
        workdir,
        tmpdir,
        home,
        log,
    )
    try:
        _wait_ready(server)
        _send_traffic(server.url)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # `docker stop`
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    assert process.returncode == 0, f"SIGTERM: exit {process.returncode}\n{log.read_text()}"
