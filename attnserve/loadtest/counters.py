"""Does the server count what the load test sent? `attnserve_requests_total` against locust.

The runner scrapes `/metrics` before and after each stage; the increase of
`attnserve_requests_total{route, status}` on the API routes (`/v1/...`) must equal, route by route
and status by status, what the locustfile recorded (its `Record.responses`). Scrapes of
`/metrics` itself and health checks are other routes and do not enter the comparison.
"""

from __future__ import annotations

import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

REQUESTS_METRIC = "attnserve_requests_total"
Key = tuple[str, int]  # (route, status)


def scrape(base_url: str, timeout: float = 10.0) -> str:
    """The text of GET /metrics."""
    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as response:
        return str(response.read().decode("utf-8"))


def api_request_counts(metrics_text: str) -> Counter[Key]:
    """attnserve_requests_total per (route, status) for the /v1/ routes."""
    counts: Counter[Key] = Counter()
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            route = sample.labels.get("route", "")
            if sample.name == REQUESTS_METRIC and route.startswith("/v1/"):
                counts[route, int(sample.labels["status"])] += int(sample.value)
    return counts


@dataclass(frozen=True)
class CounterCheck:
    """The server's increase and the client's count per (route, status)."""

    server: Counter[Key]
    client: Counter[Key]

    @property
    def match(self) -> bool:
        keys = set(self.server) | set(self.client)
        return all(self.server[k] == self.client[k] for k in keys)

    def to_dict(self) -> dict[str, object]:
        def nested(counts: Mapping[Key, int]) -> dict[str, dict[str, int]]:
            out: dict[str, dict[str, int]] = {}
            for (route, status), n in sorted(counts.items()):
                if n:
                    out.setdefault(route, {})[str(status)] = n
            return out

        return {"match": self.match, "server": nested(self.server), "client": nested(self.client)}


def compare(before: str, after: str, client: Counter[Key]) -> CounterCheck:
    """The server's increase between two scrapes against the client's counts."""
    server = api_request_counts(after)
    server.subtract(api_request_counts(before))
    return CounterCheck(+server, +client)


def settle(
    before: str,
    client: Counter[Key],
    fetch: Callable[[], str],
    timeout: float = 5.0,
    interval: float = 0.25,
) -> tuple[CounterCheck, str]:
    """Scrape until the counters match or `timeout` passes (a response can reach the client a
    moment before the server's middleware counts it); the last check and scrape."""
    end = time.monotonic() + timeout
    while True:
        after = fetch()
        check = compare(before, after, client)
        if check.match or time.monotonic() >= end:
            return check, after
        time.sleep(interval)
