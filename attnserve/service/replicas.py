"""`attnserve serve --replicas N` / `--ray`: the flags, and the Ray Serve deployment options they
make. Nothing here imports Ray (the `ray` extra is optional); service/ray_serve.py does.

A replica is the whole app of `create_app` with its own models and engine threads; Serve's HTTP
proxy spreads requests over the replicas. Each replica reserves `threads` CPUs of the cluster
(`ray_actor_options.num_cpus`), so that 2 replicas of 1 thread fill 2 cores.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from typing import Any

from attnserve.service.settings import Settings

EXTRA_HINT = "pip install 'attnserve[ray]'"
# The Serve application's name and the deployment's (Serve's dashboard, `serve status`).
APP_NAME = "attnserve"
DEPLOYMENT_NAME = "attnserve"
# Seconds Serve's proxy waits for a request past the server's own longest deadline
# (max_timeout_ms) before it answers 408 itself: a replica that hangs cannot hold a client.
PROXY_TIMEOUT_MARGIN_S = 30.0
# Seconds past drain_seconds that a stopping replica may take to stop its engines.
SHUTDOWN_MARGIN_S = 5.0


class ReplicaError(Exception):
    """Inconsistent replica flags, or Ray missing (exit status 2)."""


@dataclass(frozen=True)
class ReplicaOptions:
    """How many replicas, where, and how Serve routes to them."""

    replicas: int = 1
    ray: bool = False  # --ray: on Ray Serve even with one replica
    address: str | None = None  # a running cluster (else RAY_ADDRESS, else a local Ray)
    # Autoscaling on ongoing requests per replica (Serve's autoscaling_config) when max is set.
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    # Requests Serve sends one replica at once; more wait in Serve's router for the first
    # replica with room. Default: max_batch_rows (a full batch; the engine queues the rest).
    max_ongoing_requests: int | None = None

    @property
    def on_ray(self) -> bool:
        return self.ray or self.replicas > 1 or self.autoscaling

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None

    @property
    def most_replicas(self) -> int:
        return self.max_replicas if self.max_replicas is not None else self.replicas

    def check(self) -> None:
        if self.replicas < 1:
            raise ReplicaError("--replicas must be at least 1")
        if self.autoscaling:
            low = self.min_replicas if self.min_replicas is not None else 1
            if low < 0 or self.most_replicas < max(low, 1):
                raise ReplicaError("need 0 <= --min-replicas <= --max-replicas, and max >= 1")
            if self.replicas > 1 and not low <= self.replicas <= self.most_replicas:
                raise ReplicaError("--replicas (the initial count) must lie in min..max")
        elif self.min_replicas is not None or self.target_ongoing_requests is not None:
            raise ReplicaError("--min-replicas and --target-ongoing-requests need --max-replicas")
        if self.target_ongoing_requests is not None and self.target_ongoing_requests <= 0:
            raise ReplicaError("--target-ongoing-requests must be positive")
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise ReplicaError("--max-ongoing-requests must be at least 1")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas on Ray Serve (the `ray` extra: " + EXTRA_HINT + ")")
    g.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="N > 1: N replicas behind Ray Serve's HTTP proxy on --host/--port, each with its "
        "own models and --threads threads (default: the cores / N)",
    )
    g.add_argument("--ray", action="store_true", help="serve through Ray Serve, also with one")
    g.add_argument(
        "--ray-address",
        default=None,
        help="a running Ray cluster (default: env RAY_ADDRESS, else a local Ray started here)",
    )
    g.add_argument(
        "--max-replicas",
        type=int,
        default=None,
        help="autoscale between --min-replicas and this on ongoing requests per replica",
    )
    g.add_argument("--min-replicas", type=int, default=None, help="autoscaling floor (1)")
    g.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=None,
        help="autoscaling: requests per replica to aim for (Serve's default: 2)",
    )
    g.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=None,
        help="requests Serve sends one replica at once (default: --max-batch-rows)",
    )


def options_from_args(args: argparse.Namespace) -> ReplicaOptions:
    options = ReplicaOptions(
        replicas=args.replicas,
        ray=args.ray,
        address=args.ray_address,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        max_ongoing_requests=args.max_ongoing_requests,
    )
    options.check()
    return options


def replica_threads(settings: Settings, options: ReplicaOptions, cores: int | None) -> int:
    """Intra-op threads per replica: --threads, else this machine's cores shared by the most
    replicas there may be."""
    if settings.threads:
        return settings.threads
    return max(1, (cores or 1) // options.most_replicas)


def deployment_options(settings: Settings, options: ReplicaOptions) -> dict[str, Any]:
    """Serve's deployment options (`serve.deployment(**options)`; in a Serve config file the
    `deployments` entry overrides them). `settings.threads` must be set (replica_threads)."""
    threads = settings.threads or 1
    found: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "max_ongoing_requests": options.max_ongoing_requests or settings.max_batch_rows,
        "ray_actor_options": {"num_cpus": threads},
        # Serve waits this long for a stopping replica's requests, then its lifespan shutdown
        # (our drain, the engines stopped) runs; past it the replica is killed.
        "graceful_shutdown_timeout_s": settings.drain_seconds + SHUTDOWN_MARGIN_S,
        "graceful_shutdown_wait_loop_s": 0.5,
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 30.0,
        # attnserve's middleware logs every request with its id; Serve's line would repeat it.
        "logging_config": {"enable_access_log": False},
    }
    if options.autoscaling:
        scaling: dict[str, Any] = {
            "min_replicas": options.min_replicas if options.min_replicas is not None else 1,
            "max_replicas": options.most_replicas,
            "initial_replicas": options.replicas if options.replicas > 1 else None,
        }
        if options.target_ongoing_requests is not None:
            scaling["target_ongoing_requests"] = options.target_ongoing_requests
        found["autoscaling_config"] = {k: v for k, v in scaling.items() if v is not None}
    else:
        found["num_replicas"] = options.replicas
    return found


def proxy_timeout_s(settings: Settings) -> float:
    """Serve's end-to-end HTTP timeout (its 408): past the longest deadline a request may ask."""
    return settings.max_timeout_ms / 1000 + PROXY_TIMEOUT_MARGIN_S


def ray_installed() -> bool:
    """Whether Ray Serve imports (it is about to be used: the import is not wasted)."""
    try:
        importlib.import_module("ray.serve")
    except ImportError:
        return False
    return True


def missing_ray_message(options: ReplicaOptions) -> str:
    what = f"--replicas {options.replicas}" if options.replicas > 1 else "--ray"
    if options.autoscaling and options.replicas == 1:
        what = "--max-replicas"
    return (
        f"attnserve serve: {what} runs replicas on Ray Serve, which is not installed "
        f"({sys.executable} cannot import ray.serve); install the extra: {EXTRA_HINT}"
    )
