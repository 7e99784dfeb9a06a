"""Data-parallel training (`--workers N`): the same updates as one process, resumable either
way, every worker paused by the run's `pkill -f "run-dir RUN"`, and a worker's death ends the
run with an error instead of a hang (worker 0's death ends the others)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from attnserve.training.distributed import Group
from attnserve.training.train import train
from tests.training.test_train import config, logged_losses, tiny_data  # noqa: F401


def weights(run: Path) -> dict[str, torch.Tensor]:
    """A run's weights but the attention key biases: their gradient is zero in exact arithmetic
    (softmax ignores a shift common to every key), so Adam turns float noise into updates of
    the learning rate's size in any two runs whose sums differ in order; they change no
    output."""
    model = torch.load(run / "checkpoint.pt", weights_only=False)["model"]
    return {k: v for k, v in model.items() if not k.endswith("k_proj.bias")}


def test_rows_share_out_a_batch() -> None:
    batch = np.arange(7)
    shares = [Group(rank, 3).rows(batch) for rank in range(3)]
    assert [s.tolist() for s in shares] == [[0, 3, 6], [1, 4], [2, 5]]
    assert Group().rows(batch).tolist() == batch.tolist()


def test_two_workers_make_the_updates_of_one_process(
    tiny_data: tuple[Path, Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    data, spm_model = tiny_data
    alone = train(config(data, spm_model, tmp_path / "alone", max_steps=5, accum_steps=2))
    pair = train(config(data, spm_model, tmp_path / "pair", max_steps=5, accum_steps=2, workers=2))
    assert (pair.step, pair.epoch, pair.batch_in_epoch, pair.tokens) == (
        alone.step, alone.epoch, alone.batch_in_epoch, alone.tokens,
    )  # fmt: skip
    assert logged_losses(tmp_path / "pair") == pytest.approx(logged_losses(tmp_path / "alone"))
    a, b = weights(tmp_path / "alone"), weights(tmp_path / "pair")
    # The same sums in another order: equal to float rounding, after five updates.
    assert all(torch.allclose(a[k], b[k], atol=1e-5, rtol=1e-4) for k in a)
    assert not all(torch.equal(a[k], b[k]) for k in a)  # two processes did compute it
    ckpt = torch.load(tmp_path / "pair" / "checkpoint.pt", weights_only=False)
    assert len(ckpt["rng_workers"]) == 2 and ckpt["train_config"]["workers"] == 2
    assert "2 worker(s) of 1 thread(s)" in (tmp_path / "pair" / "train.log").read_text()


def test_a_run_resumes_with_another_number_of_workers(
    tiny_data: tuple[Path, Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    data, spm_model = tiny_data
    run = tmp_path / "run"
    train(config(data, spm_model, run, max_steps=2))
    state = train(config(data, spm_model, run, max_steps=4, resume=True, workers=2))
    again = train(config(data, spm_model, run, max_steps=6, resume=True))
    straight = train(config(data, spm_model, tmp_path / "straight", max_steps=6))
    assert state.step == 4 and again.step == 6
    assert (again.epoch, again.batch_in_epoch, again.tokens) == (
        straight.epoch, straight.batch_in_epoch, straight.tokens,
    )  # fmt: skip
    log = (run / "train.log").read_text()
    assert "resumed from step 2" in log and "resumed from step 4" in log
    a, b = weights(run), weights(tmp_path / "straight")
    assert all(torch.allclose(a[k], b[k], atol=1e-5, rtol=1e-4) for k in a)
    with pytest.raises(ValueError, match="--workers 0"):
        train(config(data, spm_model, tmp_path / "none", workers=0))


def _workers_of(run: Path) -> list[int]:
    """Processes whose command line names `--run-dir RUN` (what `pkill -f "run-dir RUN"`
    matches)."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, PermissionError, ProcessLookupError, NotADirectoryError):
            continue
        args = [a.decode(errors="replace") for a in cmdline]
        if "--run-dir" in args and str(run) in args:
            found.append(int(pid))
    return found


def test_a_dead_worker_ends_the_run_with_an_error(
    tiny_data: tuple[Path, Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    """The worker is found the way a pause finds it (its command line names the run), and
    SIGKILL on it makes the run raise, within seconds, instead of waiting for it."""
    data, spm_model = tiny_data
    run = tmp_path / "run"
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["state"] = train(config(data, spm_model, run, max_steps=5_000, workers=2))
        except Exception as e:
            outcome["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    found: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while "training examples" not in _log(run) and not outcome:
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        found = _workers_of(run)
        assert len(found) == 1, (found, outcome)  # worker 1 (worker 0: this test's process)
        time.sleep(1.0)  # training
        os.kill(found[0], signal.SIGKILL)
        thread.join(timeout=60)
        assert not thread.is_alive(), "the run still waits for its dead worker"
        assert isinstance(outcome.get("error"), RuntimeError), outcome
    finally:
        for pid in _workers_of(run):  # whatever went wrong, no worker trains on
            os.kill(pid, signal.SIGKILL)


def test_a_worker_ends_with_its_run(
    tiny_data: tuple[Path, Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    """SIGKILL on `attnserve train --workers 2` (worker 0: nothing of it runs to clean up)
    leaves no worker training on without it (the kernel's signal below, or the collective's
    broken connection, whichever comes first)."""
    data, spm_model = tiny_data
    run = tmp_path / "run"
    command = [
        sys.executable, "-m", "attnserve", "train", "--data-dir", str(data),
        "--spm-model", str(spm_model), "--run-dir", str(run), "--preset", "tiny",
        "--max-tokens", "400", "--max-len", "60", "--lr", "3e-3", "--warmup-steps", "10",
        "--max-steps", "5000", "--eval-every", "0", "--log-every", "1", "--threads", "1",
        "--no-bf16", "--workers", "2",
    ]  # fmt: skip
    parent = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while "| loss " not in _log(run):  # both workers joined and train
            assert parent.poll() is None, "the run ended before it trained"
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        workers = [pid for pid in _workers_of(run) if pid != parent.pid]
        assert len(workers) == 1, workers
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _workers_of(run) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _workers_of(run) == [], "a worker trains on without its run"
    finally:
        parent.kill()
        for pid in _workers_of(run):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running or sleeping (a zombie waits only for a reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_die_with_parent_ends_a_process_with_the_one_that_started_it() -> None:
    """Whatever a worker is doing (a long computation, not only a collective), SIGKILL on its
    parent ends it."""
    child = (  # busy: a computation, not a wait on a socket or a sleep
        "import os, time\nfrom attnserve.training.distributed import die_with_parent\n"
        "die_with_parent()\nprint(os.getpid(), flush=True)\nend = time.monotonic() + 120\n"
        "while time.monotonic() < end:\n    pass\n"
    )
    parent_code = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(120)"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True
    )
    pid = 0
    try:
        assert parent.stdout is not None
        ready, _, _ = select.select([parent.stdout], [], [], 120)
        assert ready, "the child did not start"
        pid = int(parent.stdout.readline())
        assert _alive(pid)
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the child outlived the process that started it"
    finally:
        parent.kill()
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_each_worker_keeps_its_own_dropout_stream_across_a_resume(
    tiny_data: tuple[Path, Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    """With dropout, two workers draw different masks (their checkpoint holds each one's
    random state), and a run resumed from it makes exactly the updates of one run straight."""
    data, spm_model = tiny_data
    dropout = {"dropout": 0.2}
    straight = tmp_path / "straight"
    train(config(data, spm_model, straight, max_steps=4, workers=2, model_overrides=dropout))
    resumed = tmp_path / "resumed"
    train(config(data, spm_model, resumed, max_steps=2, workers=2, model_overrides=dropout))
    rng = torch.load(resumed / "checkpoint.pt", weights_only=False)["rng_workers"]
    assert not torch.equal(rng[0]["torch"], rng[1]["torch"])
    train(config(data, spm_model, resumed, max_steps=4, workers=2, model_overrides=dropout,
                 resume=True))  # fmt: skip
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _log(run: Path) -> str:
    path = run / "train.log"
    return path.read_text() if path.exists() else ""


def test_bench_train_times_each_layout_on_the_same_batches(
    tiny_data: tuple[Path, Path],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import json

    from attnserve.bench.training import parse_setups
    from attnserve.cli import main

    data, spm_model = tiny_data
    cpus = os.sched_getaffinity(0)
    args = ["bench-train", "--data-dir", str(data), "--spm-model", str(spm_model), "--preset",
            "tiny", "--max-tokens", "400", "--max-len", "60", "--bf16", "--no-bf16",
            "--setups", "1x1,2x1", "--updates", "3", "--repeats", "1", "--name", "layouts",
            "--output-dir", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    rows = json.loads((tmp_path / "layouts.json").read_text())
    assert [r["setup"] for r in rows] == ["1x1", "2x1"]
    assert all(r["updates"] == 3 and r["tokens_per_second"] > 0 for r in rows)
    assert len({r["tokens"] for r in rows}) == 1  # the same batches for every layout
    table = (tmp_path / "layouts.md").read_text()
    assert table in capsys.readouterr().out
    assert "| 1x1 |" in table and "| 2x1 |" in table and "1.00x" in table
    assert os.sched_getaffinity(0) == cpus  # the workers' pinning undone
    assert parse_setups("1x2, 2X1") == [(1, 2), (2, 1)]
    for bad in ("2", "0x1", "ax1"):
        with pytest.raises(ValueError, match="setup"):
            parse_setups(bad)


def test_a_worker_leaves_with_its_status_its_output_flushed_and_no_finalization() -> None:
    """A worker ends by `leave`: what it printed and logged is written, the status is the work's,
    and the interpreter's finalization (where gloo's native teardown has aborted a finished
    worker) does not run."""
    code = (
        "import atexit, logging, sys\n"
        "from attnserve.training.worker import leave\n"
        "atexit.register(lambda: print('finalized'))\n"
        "logging.basicConfig(level=logging.WARNING, stream=sys.stderr)\n"
        "print('trained', end='')\n"
        "logging.warning('logged')\n"
        "leave(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (3, "trained")
    assert "logged" in done.stderr
