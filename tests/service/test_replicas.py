"""`attnserve serve --replicas`: its flags and Serve options without Ray, the message when Ray
is missing, and the lifespan that loads the models before a replica counts as started."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from attnserve.cli import build_parser
from attnserve.service.app import create_app
from attnserve.service.replicas import (
    EXTRA_HINT,
    ReplicaError,
    ReplicaOptions,
    deployment_options,
    options_from_args,
    replica_threads,
)
from tests.service.helpers import make_settings


def parse(*flags: str) -> ReplicaOptions:
    return options_from_args(build_parser().parse_args(["serve", *flags]))


def test_one_replica_stays_off_ray() -> None:
    assert not parse().on_ray
    assert parse("--replicas", "2").on_ray
    assert parse("--ray").on_ray
    assert parse("--max-replicas", "4").on_ray


def test_fixed_replicas(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, threads=1, max_batch_rows=32)
    options = deployment_options(settings, parse("--replicas", "2"))
    assert options["num_replicas"] == 2
    assert "autoscaling_config" not in options
    assert options["ray_actor_options"] == {"num_cpus": 1}
    assert options["max_ongoing_requests"] == 32  # a batch's worth per replica
    assert options["graceful_shutdown_timeout_s"] > settings.drain_seconds


def test_autoscaling(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, threads=2)
    flags = ["--replicas", "2", "--min-replicas", "1", "--max-replicas", "4"]
    options = deployment_options(
        settings, parse(*flags, "--target-ongoing-requests", "8", "--max-ongoing-requests", "16")
    )
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "initial_replicas": 2,
        "target_ongoing_requests": 8.0,
    }
    assert options["ray_actor_options"] == {"num_cpus": 2}
    assert options["max_ongoing_requests"] == 16


@pytest.mark.parametrize(
    "flags",
    [
        ["--replicas", "0"],
        ["--min-replicas", "2"],  # without --max-replicas
        ["--target-ongoing-requests", "4"],
        ["--max-replicas", "2", "--min-replicas", "3"],
        ["--max-replicas", "2", "--replicas", "3"],
        ["--max-replicas", "2", "--target-ongoing-requests", "0"],
        ["--replicas", "2", "--max-ongoing-requests", "0"],
    ],
)
def test_inconsistent_flags(flags: list[str]) -> None:
    with pytest.raises(ReplicaError):
        parse(*flags)


def test_threads_share_the_cores(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, threads=None)
    assert replica_threads(settings, parse("--replicas", "2"), cores=2) == 1
    assert replica_threads(settings, parse("--replicas", "3"), cores=2) == 1
    assert replica_threads(settings, parse("--replicas", "2"), cores=8) == 4
    assert replica_threads(settings, parse("--max-replicas", "4"), cores=8) == 2
    explicit = make_settings(tmp_path, threads=3)
    assert replica_threads(explicit, parse("--replicas", "2"), cores=2) == 3


# `attnserve serve` in a process where `import ray` fails as it does when ray is not installed.
WITHOUT_RAY = textwrap.dedent(
    """
    import sys
    sys.modules["ray"] = None  # import ray -> ImportError
    from attnserve.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


@pytest.mark.parametrize("flags", [["--replicas", "2"], ["--ray"]])
def test_without_ray_says_how_to_install_it(flags: list[str]) -> None:
    command = [sys.executable, "-c", WITHOUT_RAY, "serve", "--model", "/nonexistent", *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert EXTRA_HINT in done.stderr
    assert flags[0] in done.stderr
    assert "Traceback" not in done.stderr


def failing_factory(directory: Path, settings: Any, stop_ids: Any = ()) -> Any:
    raise OSError("no such graph")


def test_waiting_lifespan_raises_when_a_model_fails(model_dir: Path) -> None:
    app = create_app(
        make_settings(model_dir), backend_factory=failing_factory, wait_for_models=True
    )

    async def start() -> None:
        async with app.router.lifespan_context(app):
            pass

    with pytest.raises(RuntimeError, match="no such graph"):
        asyncio.run(start())
    assert app.state.service.lifecycle.phase == "failed"


def test_waiting_lifespan_starts_ready(model_dir: Path) -> None:
    app = create_app(make_settings(model_dir), wait_for_models=True)
    phases = []

    async def start_and_stop() -> None:
        async with app.router.lifespan_context(app):
            phases.append(app.state.service.lifecycle.phase)  # no request waits for a load
        phases.append(app.state.service.lifecycle.phase)

    asyncio.run(start_and_stop())
    assert phases == ["ready", "draining"]
    assert all(not model.engine._thread.is_alive() for model in app.state.service.registry)
