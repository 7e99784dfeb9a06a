"""Load test results: locust's CSVs and the locustfile's record -> one summary per stage.

Per stage (one user count): requests, failures and requests/s from locust's `<stage>_stats.csv`
(its "Aggregated" row and one row per request name), failures by message from
`<stage>_failures.csv`; answers per status, the latencies of successful requests, target tokens
and time to first token from the locustfile's `<stage>_record.json`; and the check of the
server's counters. `write_summary` writes `summary.json` and `summary.md`.
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnserve.loadtest.counters import CounterCheck
from attnserve.loadtest.traffic import Record

AGGREGATED = "Aggregated"
PERCENTILES = (50, 66, 75, 80, 90, 95, 98, 99, 99.9, 100)
OVERLOADED = "HTTP 429"  # the only failure allowed, and only above saturation
_CATCH = re.compile(r"^CatchResponseError\((['\"])(.*)\1\)$")


def machine() -> dict[str, Any]:
    """CPU model, logical CPUs and 1-minute load average at the time of the run (Linux)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "load_average_1m": load}


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None  # "N/A" when a request name has no answers yet
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class StatsRow:
    """One row of locust's `_stats.csv` (times in milliseconds)."""

    name: str
    requests: int
    failures: int
    median_ms: float | None
    average_ms: float | None
    max_ms: float | None
    requests_per_s: float
    percentiles: dict[str, float | None]  # "50%" ... "100%"

    def percentile(self, label: str) -> float | None:
        return self.percentiles.get(label)


def read_stats(path: Path) -> dict[str, StatsRow]:
    """Rows by request name; the total is under AGGREGATED."""
    rows = {}
    with open(path, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            percentiles = {k: _number(v) for k, v in row.items() if k.endswith("%")}
            rows[row["Name"]] = StatsRow(
                name=row["Name"],
                requests=int(row["Request Count"]),
                failures=int(row["Failure Count"]),
                median_ms=_number(row["Median Response Time"]),
                average_ms=_number(row["Average Response Time"]),
                max_ms=_number(row["Max Response Time"]),
                requests_per_s=_number(row["Requests/s"]) or 0.0,
                percentiles=percentiles,
            )
    return rows


def read_failures(path: Path) -> Counter[str]:
    """Occurrences per failure message (`HTTP 429 overloaded`, `no response: ...`)."""
    failures: Counter[str] = Counter()
    if not path.is_file():
        return failures
    with open(path, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            match = _CATCH.match(row["Error"])
            failures[match.group(2) if match else row["Error"]] += int(row["Occurrences"])
    return failures


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)) - 1, 0)]


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def latency_percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """{"50%": ms, ..., "100%": ms} of `values` (None when there are none)."""
    return {f"{q:g}%": _round(percentile(values, q)) for q in PERCENTILES}


def stage_summary(
    users: int,
    stats: dict[str, StatsRow],
    failures: Counter[str],
    record: Record,
    counters: CounterCheck | None = None,
) -> dict[str, Any]:
    """The numbers of one stage; see the module docstring for where each comes from.

    Rates use locust's window (its first to its last request). Latencies are those of the
    successful requests (a 429 answers at once and would flatter them); locust's own
    percentiles, over every answer, are kept as `locust_latency_ms`.
    """
    total = stats[AGGREGATED]
    seconds = total.requests / total.requests_per_s if total.requests_per_s else 0.0
    succeeded = total.requests - total.failures
    latencies = [t for values in record.latency_ms.values() for t in values]
    distribution = latency_percentiles(latencies)
    statuses: Counter[int] = Counter()
    for (_, status), n in record.responses.items():
        statuses[status] += n
    unexpected = sum(n for error, n in failures.items() if not error.startswith(OVERLOADED))
    traffic = sum(n for (route, _), n in record.responses.items() if route != "/v1/models")
    return {
        "users": users,
        "seconds": round(seconds, 2),
        "requests": total.requests,
        "failures": total.failures,
        "requests_per_s": round(total.requests_per_s, 3),
        "ok_requests_per_s": round(succeeded / seconds, 3) if seconds else 0.0,
        "texts": record.texts,
        "output_tokens": record.output_tokens,
        "target_tokens_per_s": round(record.output_tokens / seconds, 1) if seconds else 0.0,
        "latency_ms": {
            "p50": distribution["50%"],
            "p95": distribution["95%"],
            "p99": distribution["99%"],
            "max": distribution["100%"],
            "mean": _round(sum(latencies) / len(latencies)) if latencies else None,
        },
        "latency_percentiles_ms": distribution,
        "locust_latency_ms": {p: total.percentile(p) for p in ("50%", "95%", "99%", "100%")},
        "ttft_ms": {
            "streams": len(record.ttft_ms),
            "p50": _round(percentile(record.ttft_ms, 50)),
            "p95": _round(percentile(record.ttft_ms, 95)),
        },
        "status_counts": {str(s): n for s, n in sorted(statuses.items())},
        "errors_by_status": {str(s): n for s, n in sorted(statuses.items()) if s != 200},
        "failures_by_message": dict(failures.most_common()),
        "unexpected_failures": unexpected,
        "by_name": {
            name: {
                "requests": row.requests,
                "failures": row.failures,
                "requests_per_s": round(row.requests_per_s, 3),
                **{
                    f"p{q}_ms": _round(percentile(record.latency_ms.get(name, []), q))
                    for q in (50, 95, 99)
                },
            }
            for name, row in stats.items()
            if name != AGGREGATED
        },
        # Every answer locust counted is in the record too (plus GET /v1/models at the start),
        # and so is the latency of every success.
        "record_matches_locust": traffic == total.requests and len(latencies) == succeeded,
        "counters": counters.to_dict() if counters is not None else None,
    }


def load_stage(prefix: Path, users: int, counters: CounterCheck | None = None) -> dict[str, Any]:
    """The summary of the stage whose files start with `prefix` (e.g. results/u004)."""
    stats = read_stats(prefix.with_name(prefix.name + "_stats.csv"))
    failures = read_failures(prefix.with_name(prefix.name + "_failures.csv"))
    record = Record.load(prefix.with_name(prefix.name + "_record.json"))
    return stage_summary(users, stats, failures, record, counters)


def verdict(stages: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What a passing load test needs: only 429s as failures, counters equal at every stage."""
    counted = [s for s in stages if s.get("counters") is not None]
    return {
        "unexpected_failures": sum(s["unexpected_failures"] for s in stages),
        "counters_match": all(s["counters"]["match"] for s in counted) if counted else None,
        "record_matches_locust": all(s["record_matches_locust"] for s in stages),
        "first_stage_with_429": next(
            (s["users"] for s in stages if s["errors_by_status"].get("429")), None
        ),
    }


def _cell(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(stages: Sequence[dict[str, Any]]) -> str:
    """One row per stage, for docs/BENCHMARKS.md (latencies: successful requests)."""
    header = (
        "| users | successful requests/s | target tokens/s | p50 ms | p95 ms | p99 ms "
        "| TTFT p50 / p95 ms | errors by status | counters |"
    )
    rows = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for s in stages:
        latency, ttft = s["latency_ms"], s["ttft_ms"]
        errors = ", ".join(f"{k}: {v}" for k, v in s["errors_by_status"].items()) or "none"
        counters = s.get("counters")
        agree = "-" if counters is None else ("equal" if counters["match"] else "**differ**")
        rows.append(
            f"| {s['users']} | {s['ok_requests_per_s']:.1f} | {s['target_tokens_per_s']:.0f} "
            f"| {_cell(latency['p50'])} | {_cell(latency['p95'])} | {_cell(latency['p99'])} "
            f"| {_cell(ttft['p50'])} / {_cell(ttft['p95'])} | {errors} | {agree} |"
        )
    return "\n".join(rows) + "\n"


def write_summary(
    out_dir: Path, stages: Sequence[dict[str, Any]], meta: dict[str, Any]
) -> list[Path]:
    """summary.json (meta, stages, verdict) and summary.md (the table)."""
    summary = {**meta, "verdict": verdict(stages), "stages": list(stages)}
    json_path = out_dir / "summary.json"
    json_path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    md_path = out_dir / "summary.md"
    title = meta.get("title", "attnserve load test")
    md_path.write_text(f"**{title}**\n\n{markdown_table(stages)}", encoding="utf-8")
    return [json_path, md_path]
