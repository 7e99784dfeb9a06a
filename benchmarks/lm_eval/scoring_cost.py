"""What prompt scoring costs, and that ordinary steps do not pay for it.

1. A language model's step graph with `logit_positions` against the same model's graph exported
   before that input (`--before`: a model directory holding such a variant): a decoding step at
   1 and 16 rows (100 cached tokens) and a 500-token prefill, the two graphs alternating in one
   process (the new backend runs the old graph as it ran before: no index fed).
2. A 340-token prompt prefilled plainly, with every position's logits, and the host's scores of
   those logits (engine/scoring.py).

Runs with attnserve's own Python (`python benchmarks/lm_eval/scoring_cost.py --help`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np

from attnserve.engine.onnx.lm_open import open_lm_dir
from attnserve.engine.scoring import score_positions


def step_ms(
    backend: Any, rows: int, cached: int, rng: np.random.Generator, steps: int = 16
) -> float:
    ids = rng.integers(100, 40000, (rows, cached))
    state = backend.encode(ids, np.full(rows, cached))
    tokens = np.full(rows, 500, dtype=np.int64)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        _, state = backend.step(tokens, state)
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def prefill_ms(backend: Any, length: int, rng: np.random.Generator) -> float:
    ids = rng.integers(100, 40000, (1, length))
    started = time.perf_counter()
    backend.encode(ids, np.array([length]))
    return 1e3 * (time.perf_counter() - started)


def ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(a) / statistics.median(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--variant", default="int8")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    new = open_lm_dir(args.model, args.variant, threads=args.threads, provider="cpu")
    old = open_lm_dir(args.before, args.variant, threads=args.threads, provider="cpu")
    assert new.scores_prompts and not old.scores_prompts, "--before must predate logit_positions"
    timed: dict[str, dict[str, list[float]]] = {}
    for repeat in range(args.repeats):
        pair = [("before", old), ("logit_positions", new)]
        for name, backend in pair if repeat % 2 == 0 else pair[::-1]:
            for what, ms in (
                ("step_1_row", step_ms(backend, 1, 100, rng)),
                ("step_16_rows", step_ms(backend, 16, 100, rng)),
                ("prefill_500", prefill_ms(backend, 500, rng)),
            ):
                timed.setdefault(what, {}).setdefault(name, []).append(ms)
    scoring: dict[str, list[float]] = {"prefill": [], "every_position": [], "host_scores": []}
    for _ in range(args.repeats):
        ids = rng.integers(100, 40000, (1, 340))
        mask = np.ones_like(ids)
        started = time.perf_counter()
        new.extend(new.empty(1), ids, mask)
        scoring["prefill"].append(time.perf_counter() - started)
        started = time.perf_counter()
        logits, _ = new.extend(new.empty(1), ids, mask, all_positions=True)
        scoring["every_position"].append(time.perf_counter() - started)
        started = time.perf_counter()
        score_positions(logits[0], [*ids[0, 1:].tolist(), 5], 1)
        scoring["host_scores"].append(time.perf_counter() - started)
    report = {
        "date": date.today().isoformat(),
        "load_average": os.getloadavg()[0],
        "model": str(args.model),
        "variant": args.variant,
        "threads": args.threads,
        "repeats": args.repeats,
        "median_ms": {
            what: {name: round(statistics.median(v), 2) for name, v in by.items()}
            for what, by in timed.items()
        },
        "ratio_logit_positions_to_before": {
            what: round(ratio(by["logit_positions"], by["before"]), 3) for what, by in timed.items()
        },
        "scoring_340_tokens_median_ms": {
            k: round(1e3 * statistics.median(v), 1) for k, v in scoring.items()
        },
        "all": timed,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "all"}, indent=2))
    if args.output is not None:
        args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
