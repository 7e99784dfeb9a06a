"""Data-parallel training on one machine: `--workers N` processes train one model together.

Every worker reads the same batch stream (same seed and data position) and takes every N-th
row of each batch (`rows`); the loss is divided by the whole batch's target tokens, the
gradients are summed across workers before clipping (`Group.sum_gradients`), and every worker
makes the same optimizer step. With dropout off, an update is the one a single process makes on
the whole batch, up to the order of float sums; with dropout, each worker draws its own masks
(the same in distribution, not the same masks), saved and restored per worker by checkpoints.

Worker 0 is the process that was started: it evaluates, logs, checkpoints and decides when to
stop (`Group.decide`); the others are its subprocesses (training/worker.py): they meet it
through a file in a temporary directory (no port to race for), talk over loopback, get the
run's config on stdin, end when it ends (SIGTERM on their parent's death), and their command
lines carry `--run-dir RUN`, so `pkill -STOP -f "run-dir RUN"` pauses all of them.

Why: on a CPU with few cores, processes of one thread each may use the cores better than the
threads of one process; `attnserve bench-train` measures it (docs/bench/tried-and-not-kept.md).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from attnserve.training.config import TrainConfig

log = logging.getLogger(__name__)

WORKER_MODULE = "attnserve.training.worker"  # a worker of rank > 0: `python -m` it

# Rendezvous: every worker connects within this (they start together; loading comes after).
CONNECT_TIMEOUT = timedelta(minutes=5)
# A collective waits this long for the others: worker 0's dev evaluations, and runs paused
# with SIGSTOP for hours (the wait resumes with them), must not end the run.
WAIT_TIMEOUT = timedelta(days=30)
LEAVE_TIMEOUT = 60  # seconds for the workers to end once their group broke up at the end


@dataclass(frozen=True)
class Group:
    """This process's place among the workers of a run; one worker alone by default (every
    collective is then a no-op)."""

    rank: int = 0
    size: int = 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def rows(self, indices: np.ndarray) -> np.ndarray:
        """This worker's share of a batch's example indices: every size-th row from its rank
        (a batch is sorted by length, so the shares pad alike)."""
        return indices[self.rank :: self.size]

    def sum_gradients(self, module: nn.Module, loss: float) -> float:
        """Sum every parameter's gradient and `loss` over the workers (one all-reduce of one
        flat buffer); a worker without a parameter's gradient (no rows in this update) adds
        zeros, and a parameter no worker has a gradient for keeps none (AdamW skips it, as it
        does in one process). Returns the summed loss."""
        if self.size == 1:
            return loss
        params = [p for p in module.parameters() if p.requires_grad]
        dtype = params[0].dtype
        flat = torch.cat(
            [
                *(p.new_zeros(p.numel()) if p.grad is None else p.grad.reshape(-1) for p in params),
                torch.tensor([p.grad is not None for p in params], dtype=dtype),
                torch.tensor([loss], dtype=dtype),
            ]
        )
        dist.all_reduce(flat)
        has_grad = flat[-1 - len(params) : -1].tolist()
        offset = 0
        for p, has in zip(params, has_grad, strict=True):
            p.grad = flat[offset : offset + p.numel()].view_as(p) if has else None
            offset += p.numel()
        return float(flat[-1])

    def decide(self, *flags: bool) -> tuple[bool, ...]:
        """The leader's flags, on every worker (decisions made on its clock: checkpoint, stop)."""
        if self.size == 1:
            return flags
        shared = torch.tensor([int(f) for f in flags], dtype=torch.int64)
        dist.broadcast(shared, 0)
        return tuple(bool(f) for f in shared.tolist())

    def gather(self, obj: Any) -> list[Any]:
        """Every worker's `obj`, in rank order (picklable objects)."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def share_weights(self, module: nn.Module) -> None:
        """Everyone starts from the leader's weights (a fresh run initialises them alike
        already; this makes it so whatever the initialisation did)."""
        if self.size == 1:
            return
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, 0)

    def check_in_step(self, module: nn.Module) -> None:
        """Raise if the workers' weights have drifted apart (they make the same updates from the
        same sums, so they never should)."""
        if self.size == 1:
            return
        with torch.no_grad():
            total = float(sum(p.double().sum() for p in module.parameters()))
        totals = self.gather(total)
        if len(set(totals)) != 1:
            raise RuntimeError(f"the workers' weights differ (sums {totals})")


ALONE = Group()  # one process training alone


def rank_seed(seed: int, step: int, rank: int) -> int:
    """The dropout seed of a worker with no saved random state (rank > 0 of a fresh run, or of
    a run resumed with more workers than it was saved with)."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


def pin(group: Group, threads: int) -> int:
    """Give this worker `threads` of the process's CPUs of its own where there are enough;
    returns the threads it should use (0 in `threads`: the CPUs shared out)."""
    cpus = sorted(os.sched_getaffinity(0))
    if group.size == 1:
        return threads
    threads = threads or max(1, len(cpus) // group.size)
    if len(cpus) >= group.size * threads:
        os.sched_setaffinity(0, cpus[group.rank * threads : (group.rank + 1) * threads])
    return threads


def ready_key(rank: int) -> str:
    return f"attnserve/ready/{rank}"


def join(store: dist.Store, rank: int, size: int) -> None:
    """The gloo group over loopback (no port of the machine's own addresses is opened)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=WAIT_TIMEOUT)


def _wait_ready(store: dist.Store, procs: list[subprocess.Popen[str]]) -> None:
    """Until every worker has reached the store; one that exits first, or none within
    CONNECT_TIMEOUT, fails the run now rather than at the group's long timeout."""
    deadline = time.monotonic() + CONNECT_TIMEOUT.total_seconds()
    while not store.check([ready_key(rank) for rank in range(1, len(procs) + 1)]):
        exited = [(rank, p.returncode) for rank, p in enumerate(procs, 1) if p.poll() is not None]
        if exited:
            raise RuntimeError(f"training workers exited before joining (rank, code): {exited}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"training workers did not join within {CONNECT_TIMEOUT}")
        time.sleep(0.05)


def die_with_parent() -> None:
    """SIGTERM this process when the one that started it ends, however it ends (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        return


@contextmanager
def workers(cfg: TrainConfig) -> Iterator[Group]:
    """Start workers 1..N-1 of the run and join them as worker 0; yields this process's Group.
    On leaving, waits for them (a worker that failed fails the run) and stops any left."""
    if cfg.workers <= 1:
        yield Group()
        return
    config = json.dumps(dataclasses.asdict(cfg))
    procs: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory(prefix="attnserve-workers-") as tmp:
        rendezvous = str(Path(tmp) / "store")  # a file: no port to race for or to expose
        store = dist.FileStore(rendezvous, cfg.workers)
        try:
            for rank in range(1, cfg.workers):
                cmd = [sys.executable, "-m", WORKER_MODULE, "--run-dir", cfg.run_dir, "--rank",
                       str(rank), "--size", str(cfg.workers), "--store", rendezvous,
                       "--parent", str(os.getpid())]  # fmt: skip
                proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, text=True)
                procs.append(proc)
                assert proc.stdin is not None
                proc.stdin.write(config)
                proc.stdin.close()
            _wait_ready(store, procs)
            join(store, 0, cfg.workers)
            yield Group(0, cfg.workers)
            try:
                dist.barrier()  # each worker's last call: the group is left by all at once
            except RuntimeError as e:
                left: RuntimeError | None = e  # a worker that is gone: its exit code says why
            else:
                left = None
            dist.destroy_process_group()
            wait = None if left is None else LEAVE_TIMEOUT  # a worker stuck where the group broke
            try:
                codes = [p.wait(timeout=wait) for p in procs]
            except subprocess.TimeoutExpired:
                raise RuntimeError("training workers did not end as the group broke up") from left
            failed = [(rank, code) for rank, code in enumerate(codes, 1) if code]
            if failed:
                raise RuntimeError(f"training workers failed (rank, exit code): {failed}") from left
            if left is not None:
                raise left
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait()
