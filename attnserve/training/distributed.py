"""Data-parallel training on one machine: `--workers N` processes train one model together.

Every worker reads the same batch stream (same seed and data position) and takes every N-th
row of each batch (`rows`); the loss is divided by the whole batch's target tokens, the
gradients are summed across workers before clipping (`Group.sum_gradients`), and every worker
makes the same optimizer step, so an update is the one a single process makes on the whole
batch, up to the order of float sums. Worker 0 is the process that was started: it evaluates,
logs, checkpoints and decides when to stop (`Group.decide`); the others are started by it
(`python -m attnserve.training.distributed`, their command lines carry `--run-dir RUN` too, so
`pkill -STOP -f "run-dir RUN"` pauses all of them) and get the run's config on stdin.

Why: on a CPU with few cores, processes of one thread each use the cores better than the
threads of one process (the matrix products of one batch do not split evenly between threads);
docs/BENCHMARKS.md ("Training throughput") has the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from attnserve.training.config import TrainConfig

log = logging.getLogger(__name__)

# Rendezvous: every worker connects within this (they start together; loading comes after).
CONNECT_TIMEOUT = timedelta(minutes=5)
# A collective waits this long for the others: worker 0's dev evaluations, and runs paused
# with SIGSTOP for hours (the wait resumes with them), must not end the run.
WAIT_TIMEOUT = timedelta(days=30)


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
        flat buffer); a worker without rows in this update adds zeros. Returns the summed loss."""
        if self.size == 1:
            return loss
        params = [p for p in module.parameters() if p.requires_grad]
        flat = torch.cat(
            [
                *(p.new_zeros(p.numel()) if p.grad is None else p.grad.reshape(-1) for p in params),
                torch.tensor([loss], dtype=params[0].dtype),
            ]
        )
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _join(rank: int, size: int, port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=CONNECT_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=WAIT_TIMEOUT)


@contextmanager
def workers(cfg: TrainConfig) -> Iterator[Group]:
    """Start workers 1..N-1 of the run and join them as worker 0; yields this process's Group.
    On leaving, waits for them (a worker that failed fails the run) and stops any left."""
    if cfg.workers <= 1:
        yield Group()
        return
    port = _free_port()
    config = json.dumps(dataclasses.asdict(cfg))
    procs = []
    for rank in range(1, cfg.workers):
        cmd = [sys.executable, "-m", __name__, "--run-dir", cfg.run_dir, "--rank", str(rank),
               "--size", str(cfg.workers), "--port", str(port)]  # fmt: skip
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, text=True)
        assert proc.stdin is not None
        proc.stdin.write(config)
        proc.stdin.close()
        procs.append(proc)
    try:
        _join(0, cfg.workers, port)
        yield Group(0, cfg.workers)
        failed = [(rank, code) for rank, proc in enumerate(procs, 1) if (code := proc.wait())]
        if failed:
            raise RuntimeError(f"training workers failed (rank, exit code): {failed}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()


def main(argv: list[str] | None = None) -> int:
    """A worker of rank > 0 (started by `workers`; the config comes on stdin)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)  # for `pkill -f "run-dir RUN"`; the config has it
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    cfg = TrainConfig(**json.loads(sys.stdin.read()))
    if cfg.run_dir != args.run_dir:
        raise SystemExit(f"--run-dir {args.run_dir} is not the config's {cfg.run_dir}")
    logging.basicConfig(level=logging.WARNING, format=f"worker {args.rank}: %(message)s")
    from attnserve.training.train import train_worker

    _join(args.rank, args.size, args.port)
    try:
        train_worker(cfg, Group(args.rank, args.size))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
