"""PNG plots of a load test (matplotlib, the `loadtest` extra): where the limits are.

- throughput.png: successful requests/s (and all answers/s, 429s included) and target tokens/s
  against concurrent users;
- latency.png: p50 / p95 / p99 latency and the streams' time to first token against users, and
  the p95 of each request name (shape); the first stage with 429s (overload) is marked;
- latency_distribution.png: the latency percentiles of every stage (one line per user count).
"""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DISTRIBUTION = ("50%", "66%", "75%", "80%", "90%", "95%", "98%", "99%", "99.9%", "100%")


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        log.warning("matplotlib is not installed: no plots (pip install -e '.[loadtest]')")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(stages: Sequence[dict[str, Any]], *keys: str) -> list[float]:
    values = []
    for stage in stages:
        value: Any = stage
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        values.append(float("nan") if value is None else float(value))
    return values


def _users_axis(ax: Any, users: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(users))
    ax.set_xticklabels([str(u) for u in users])
    ax.set_xlabel("concurrent users")
    ax.grid(True, alpha=0.3)


def _log_y(ax: Any) -> None:
    """A log latency axis labelled in plain numbers (5, 20, 100, 2000 ms)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _mark_overload(ax: Any, stages: Sequence[dict[str, Any]]) -> None:
    overloaded = [s["users"] for s in stages if s["errors_by_status"].get("429")]
    if overloaded:
        ax.axvline(min(overloaded), color="red", linestyle=":", label="first 429s")


def plot_throughput(stages: Sequence[dict[str, Any]], path: Path, title: str) -> Path | None:
    plt = _pyplot()
    if plt is None:
        return None
    users = [s["users"] for s in stages]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=90)
    ax.plot(users, _series(stages, "ok_requests_per_s"), "o-", color="C0", label="successful/s")
    answered = _series(stages, "requests_per_s")
    ax.plot(users, answered, "o:", color="C0", alpha=0.5, label="answered/s (with 429s)")
    ax.set_ylabel("requests/s", color="C0")
    _users_axis(ax, users)
    _mark_overload(ax, stages)
    twin = ax.twinx()
    tokens = _series(stages, "target_tokens_per_s")
    twin.plot(users, tokens, "s--", color="C1", label="target tokens/s")
    twin.set_ylabel("target tokens/s", color="C1")
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize=8)
    ax.set_ylim(bottom=0)
    twin.set_ylim(bottom=0)
    return _save(plt, fig, path, "Throughput vs concurrency\n" + title)


def plot_latency(stages: Sequence[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Left: all requests' percentiles and the streams' TTFT; right: p95 per request name."""
    plt = _pyplot()
    if plt is None:
        return None
    users = [s["users"] for s in stages]
    fig, (ax, by_name) = plt.subplots(1, 2, figsize=(11, 4), dpi=90, sharey=True)
    for key, style in (("p50", "o-"), ("p95", "s-"), ("p99", "^-")):
        ax.plot(users, _series(stages, "latency_ms", key), style, label=f"latency {key}")
    for key, style in (("p50", "o--"), ("p95", "s--")):
        ax.plot(users, _series(stages, "ttft_ms", key), style, label=f"TTFT {key} (streams)")
    ax.set_title("successful requests (all shapes)", fontsize=9)
    names = sorted({name for s in stages for name in s["by_name"]})
    for name in names:
        by_name.plot(users, _series(stages, "by_name", name, "p95_ms"), "o-", label=name)
    by_name.set_title("p95 of successful requests per request name", fontsize=9)
    for axis in (ax, by_name):
        _users_axis(axis, users)
        _mark_overload(axis, stages)
        _log_y(axis)
        axis.legend(fontsize=7)
    ax.set_ylabel("milliseconds")
    return _save(plt, fig, path, "Latency vs concurrency\n" + title)


def plot_distribution(stages: Sequence[dict[str, Any]], path: Path, title: str) -> Path | None:
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=90)
    positions = list(range(len(DISTRIBUTION)))
    for stage in stages:
        table = stage["latency_percentiles_ms"]
        values = [table.get(p) for p in DISTRIBUTION]
        ax.plot(
            positions,
            [float("nan") if v is None else v for v in values],
            "o-",
            markersize=3,
            label=f"{stage['users']} users",
        )
    ax.set_xticks(positions)
    ax.set_xticklabels(DISTRIBUTION)
    ax.set_xlabel("percentile of successful requests (all shapes)")
    _log_y(ax)
    ax.set_ylabel("latency (ms)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _save(plt, fig, path, "Latency distribution per stage\n" + title)


def plot_bench_ladder(
    series: dict[str, dict[str, list[float]]], path: Path, title: str
) -> Path | None:
    """`attnserve bench-http` over a ladder of client counts: tokens/s of every system (offline
    dashed, it does not depend on clients) and the p99 latency of the served ones."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    clients: list[float] = []
    for system, values in series.items():
        clients = values["clients"]
        style = {"linestyle": "--", "color": "gray"} if system == "offline" else {"marker": "o"}
        left.plot(values["clients"], values["tokens"], label=system, **style)
        if system != "offline":
            right.plot(values["clients"], values["p99"], marker="o", label=system)
    users = [int(c) for c in clients]
    for ax in (left, right):
        _users_axis(ax, users)
        ax.set_xlabel("concurrent clients (closed loop)")
    left.set_ylabel("target tokens/s (median of repeats)")
    left.set_ylim(bottom=0)
    left.legend(fontsize=7)
    _log_y(right)
    right.set_ylabel("p99 latency ms (short requests if mixed)")
    right.legend(fontsize=7)
    return _save(plt, fig, path, "bench-http: throughput and tail latency by load\n" + title)


def _save(plt: Any, fig: Any, path: Path, title: str) -> Path:
    fig.suptitle("\n".join(textwrap.fill(line, 90) for line in title.split("\n")), fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_plots(stages: Sequence[dict[str, Any]], out_dir: Path, title: str) -> list[Path]:
    """The three PNGs in `out_dir` (none without matplotlib)."""
    written = [
        plot_throughput(stages, out_dir / "throughput.png", title),
        plot_latency(stages, out_dir / "latency.png", title),
        plot_distribution(stages, out_dir / "latency_distribution.png", title),
    ]
    return [p for p in written if p is not None]
