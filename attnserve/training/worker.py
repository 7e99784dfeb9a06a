"""`python -m attnserve.training.worker`: a worker of rank > 0 of a data-parallel run.

Worker 0 (`attnserve train --workers N`, training/distributed.py's `workers`) starts it and
writes the run's config on its stdin; `--run-dir` repeats the config's run directory so that
`pkill -f "run-dir RUN"` finds every worker of a run.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import sys
from typing import NoReturn

import torch.distributed as dist

from attnserve.training.config import TrainConfig
from attnserve.training.distributed import Group, die_with_parent, join, ready_key
from attnserve.training.train import train_worker


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--store", required=True, help="the rendezvous file")
    p.add_argument("--parent", type=int, required=True, help="worker 0's pid")
    args = p.parse_args(argv)
    faulthandler.enable()  # a crash in native code (gloo, torch) prints this worker's stack
    die_with_parent()
    if os.getppid() != args.parent:  # worker 0 ended before the line above took effect
        return 1
    cfg = TrainConfig(**json.loads(sys.stdin.read()))
    if cfg.run_dir != args.run_dir:
        raise SystemExit(f"--run-dir {args.run_dir} is not the config's {cfg.run_dir}")
    logging.basicConfig(level=logging.WARNING, format=f"worker {args.rank}: %(message)s")
    store = dist.FileStore(args.store, args.size)
    store.set(ready_key(args.rank), "1")
    join(store, args.rank, args.size)
    try:
        train_worker(cfg, Group(args.rank, args.size))
        dist.barrier()  # worker 0's `workers` meets it: every worker leaves the group at once
    finally:
        dist.destroy_process_group()
    return 0


def leave(code: int) -> NoReturn:
    """Exit without the interpreter's finalization: once the group is gone, the exit status is
    the work's. Finalization can still run native teardown of gloo's threads and the tensors they
    held, which has aborted a worker (SIGABRT) after its last checkpoint was written."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())
