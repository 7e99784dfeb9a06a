"""`attnserve bench-train`: training throughput of worker and thread layouts, side by side.

Each setup `WxT` (W workers of T threads: `--workers W --threads T`) trains a fresh run of the
same flags for `--updates` updates from the same start (the same batches: same seed, same data
position), each in a process of its own, the setups taken in turn, `--repeats` times; tokens/s
is source + target tokens over training seconds (the updates alone: not loading, not the final
checkpoint). The first setup is the baseline of the ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from attnserve.training.config import TrainConfig, add_train_arguments, config_from_args


def parse_setups(text: str) -> list[tuple[int, int]]:
    """ "1x2,2x1" -> [(1, 2), (2, 1)] (workers, threads)."""
    setups = []
    for part in text.split(","):
        try:
            workers, threads = (int(x) for x in part.strip().lower().split("x"))
        except ValueError:
            raise ValueError(f"setup {part!r}: give WORKERSxTHREADS, e.g. 2x1") from None
        if workers < 1 or threads < 1:
            raise ValueError(f"setup {part!r}: workers and threads are 1 or more")
        setups.append((workers, threads))
    return setups


def measure(cfg: TrainConfig, workers: int, threads: int, updates: int) -> dict[str, Any]:
    """One fresh run of `cfg` with this layout, in a temporary run directory, in a process of
    its own (no layout inherits another's threads, CPU masks or warm caches)."""
    from attnserve.loadtest.report import machine

    with tempfile.TemporaryDirectory(prefix="bench-train-") as run_dir:
        run = dataclasses.replace(
            cfg, run_dir=run_dir, workers=workers, threads=threads, max_steps=updates,
            resume=False, cooldown_steps=0, max_hours=0.0, eval_every=0, keep_snapshots=0,
            checkpoint_minutes=1e9,
        )  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", __name__], input=json.dumps(dataclasses.asdict(run)),
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"training layout {workers}x{threads} failed:\n{done.stderr}")
    state = json.loads(done.stdout.splitlines()[-1])
    return {
        "setup": f"{workers}x{threads}", "workers": workers, "threads": threads,
        "updates": state["step"], "tokens": state["tokens"], "seconds": round(state["seconds"], 3),
        "tokens_per_second": round(state["tokens"] / state["seconds"], 1), "machine": machine(),
    }  # fmt: skip


def _measured_run() -> int:
    """`python -m attnserve.bench.training`: train the run whose config is on stdin; print its
    updates, tokens and training seconds as a JSON line."""
    from attnserve.training.train import train

    state = train(TrainConfig(**json.loads(sys.stdin.read())))
    print(json.dumps({"step": state.step, "tokens": state.tokens, "seconds": state.seconds}))
    return 0


def markdown(rows: list[dict[str, Any]]) -> str:
    setups = list(dict.fromkeys(r["setup"] for r in rows))
    median = {
        s: statistics.median(r["tokens_per_second"] for r in rows if r["setup"] == s)
        for s in setups
    }
    base = median[setups[0]]
    lines = [
        "| setup (workers x threads) | tokens/s (median) | every repeat | ratio |",
        "|---|---|---|---|",
    ]
    for s in setups:
        each = ", ".join(f"{r['tokens_per_second']:.0f}" for r in rows if r["setup"] == s)
        lines.append(f"| {s} | {median[s]:.0f} | {each} | {median[s] / base:.2f}x |")
    return "\n".join(lines) + "\n"


def cmd_bench_train(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    setups = parse_setups(args.setups)
    rows = [
        measure(cfg, workers, threads, args.updates)
        for _ in range(args.repeats)
        for workers, threads in setups
    ]
    table = markdown(rows)
    print(table, end="")
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.name}.json").write_text(json.dumps(rows, indent=2) + "\n")
        (out / f"{args.name}.md").write_text(table)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "bench-train",
        help="training tokens/s of worker and thread layouts (the train flags, plus these)",
    )
    add_train_arguments(p)
    p.add_argument(
        "--setups",
        default="1x2,2x1",
        help="WORKERSxTHREADS, comma-separated (in place of --workers and --threads)",
    )
    p.add_argument("--updates", type=int, default=30, help="updates a run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--name", default="train-workers", help="the result files' name")
    p.add_argument("--output-dir", default=None, help="write NAME.json and NAME.md here")
    p.set_defaults(func=cmd_bench_train)


if __name__ == "__main__":
    raise SystemExit(_measured_run())
