"""Prometheus metrics: one registry per app; the engine's StepEvents are their main source.

Labels are bounded: `route` is a route template (or "other"), `status` an HTTP status code,
`model` a configured model name, `reason` one of REJECT_REASONS (requests) or CLOSE_REASONS
(connections).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from attnserve.engine.prefix_cache import PrefixCache
from attnserve.engine.scheduler import Outcome, StepEvents

PREFIX = "attnserve_"
REJECT_REASONS = (
    "queue_full",
    "draining",
    "not_ready",
    "body_too_large",
    "request_too_large",
    "unauthorized",
    "host_not_allowed",
    "origin_not_allowed",
)
# Connections the server closed on a client: headers (or a first request) too slow, a body too
# slow, one connection past max_connections, a request that is not HTTP (service/connections.py).
CLOSE_REASONS = ("header_timeout", "body_timeout", "connection_limit", "invalid_request")

# Latencies of one request: milliseconds (a short sentence, idle server) to a minute (long beam
# searches under overload, bounded by max_timeout_ms).
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Waiting for a batch slot / for the first token: ~0 when idle, seconds under overload.
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# One decoder step: ~0.2 ms (tiny model, one row) to ~1 s (large batch of beams on a CPU).
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class PrefixCacheCollector(Collector):
    """The prefix caches' counters, read from them at scrape time."""

    def __init__(self, caches: dict[str, PrefixCache]) -> None:
        self.caches = caches

    def describe(self) -> Iterable[Metric]:
        return self.collect()

    def collect(self) -> Iterable[Metric]:
        name = PREFIX + "prefix_cache_"
        queries = CounterMetricFamily(
            name + "queries", "Prompt tokens looked up in the prefix cache", labels=["model"]
        )
        hits = CounterMetricFamily(
            name + "hits", "Prompt tokens whose K/V came from the prefix cache", labels=["model"]
        )
        evictions = CounterMetricFamily(
            name + "evictions", "Blocks dropped from the prefix cache for room", labels=["model"]
        )
        size = GaugeMetricFamily(name + "bytes", "Bytes the prefix cache holds", labels=["model"])
        blocks = GaugeMetricFamily(
            name + "blocks", "Blocks the prefix cache holds", labels=["model"]
        )
        capacity = GaugeMetricFamily(
            name + "capacity_bytes", "The prefix cache's limit", labels=["model"]
        )
        # vLLM's cache_config_info, which the Gateway API Inference Extension's prefix scorer
        # reads (--cache-info-metric): the block size and how many blocks fit
        info = GaugeMetricFamily(
            name.removesuffix("prefix_cache_") + "cache_config_info",
            "The prefix cache's block size (tokens) and capacity (blocks)",
            labels=["model", "block_size", "num_gpu_blocks"],
        )
        for model, cache in self.caches.items():
            info.add_metric([model, str(cache.block), str(cache.capacity_blocks)], 1)
            stats = cache.snapshot()
            queries.add_metric([model], stats.queries)
            hits.add_metric([model], stats.hits)
            evictions.add_metric([model], stats.evictions)
            size.add_metric([model], stats.bytes)
            blocks.add_metric([model], stats.blocks)
            capacity.add_metric([model], cache.max_bytes)
        yield from (queries, hits, evictions, size, blocks, capacity, info)


class Metrics:
    """Every attnserve_* metric, in its own registry (tests build many apps in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.prefix_caches: dict[str, PrefixCache] = {}
        r.register(PrefixCacheCollector(self.prefix_caches))
        self.requests = Counter(
            PREFIX + "requests", "HTTP requests answered", ["route", "status"], registry=r
        )
        self.request_duration = Histogram(
            PREFIX + "request_duration_seconds",
            "HTTP request latency, from the first byte read to the last byte sent",
            ["route"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            PREFIX + "queue_wait_seconds",
            "Time a decoding request waited before joining the running batch",
            ["model"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "From queueing to the first decoded token",
            ["model"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Decoding time per token after the first",
            ["model"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.input_tokens = Counter(
            PREFIX + "input_tokens", "Source tokens of completed requests", ["model"], registry=r
        )
        self.output_tokens = Counter(
            PREFIX + "output_tokens",
            "Tokens generated for completed requests",
            ["model"],
            registry=r,
        )
        self.batch_rows = Histogram(
            PREFIX + "batch_rows",
            "Rows decoding at each scheduler step (all running batches of the model)",
            ["model"],
            buckets=ROW_BUCKETS,
            registry=r,
        )
        self.decode_step = Histogram(
            PREFIX + "decode_step_seconds",
            "One scheduler step: admission, encoder pass of joiners, one decoder step",
            ["model"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.requests_running = Gauge(
            PREFIX + "requests_running", "Requests in the running batch", ["model"], registry=r
        )
        self.requests_waiting = Gauge(
            PREFIX + "requests_waiting", "Requests queued for the batch", ["model"], registry=r
        )
        self.kv_cache_usage = Gauge(
            PREFIX + "kv_cache_usage_perc",
            "Share (0-1) of the batch's token budget (max_batch_tokens) that admitted requests "
            "hold: KV-cache utilisation as a load-aware router reads it",
            ["model"],
            registry=r,
        )
        self.rejected = Counter(
            PREFIX + "rejected", "Requests refused before decoding", ["reason"], registry=r
        )
        self.requests_ended = Counter(
            PREFIX + "decoding_requests",
            "Decoding requests (one per text) by outcome",
            ["model", "outcome"],
            registry=r,
        )
        self.model_info = Gauge(
            PREFIX + "model_info",
            "Models served (value 1)",
            ["model", "variant", "provider"],
            registry=r,
        )
        self.connections_open = Gauge(
            PREFIX + "connections_open", "HTTP connections open", registry=r
        )
        self.connections_closed = Counter(
            PREFIX + "connections_closed",
            "HTTP connections the server closed on a slow client or past its connection limit",
            ["reason"],
            registry=r,
        )
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        for reason in CLOSE_REASONS:
            self.connections_closed.labels(reason)

    def add_model(
        self,
        name: str,
        variant: str,
        provider: str,
        running: Callable[[], float],
        waiting: Callable[[], float],
        prefix_cache: PrefixCache | None = None,
        kv_usage: Callable[[], float] | None = None,
    ) -> None:
        """Declare a model: its info gauge, and gauges read from its engine at scrape time."""
        if prefix_cache is not None:
            self.prefix_caches[name] = prefix_cache
        self.model_info.labels(name, variant, provider).set(1)
        self.requests_running.labels(name).set_function(running)
        self.requests_waiting.labels(name).set_function(waiting)
        if kv_usage is not None:
            self.kv_cache_usage.labels(name).set_function(kv_usage)
        for outcome in Outcome:
            self.requests_ended.labels(name, outcome.value)

    def observe_step(self, model: str, events: StepEvents) -> None:
        """The engine thread's report of one scheduler step."""
        if events.batch_rows:
            self.batch_rows.labels(model).observe(events.batch_rows)
            self.decode_step.labels(model).observe(events.step_seconds)
        for request in events.ended:
            outcome = request.outcome or Outcome.FAILED
            self.requests_ended.labels(model, outcome.value).inc()
            if request.admitted is not None:
                self.queue_wait.labels(model).observe(request.admitted - request.arrived)
            if outcome is not Outcome.DONE:
                continue
            output = request.output_tokens
            self.input_tokens.labels(model).inc(len(request.source))
            self.output_tokens.labels(model).inc(output)
            if request.first_token is not None:
                self.time_to_first_token.labels(model).observe(
                    request.first_token - request.arrived
                )
                if request.finished is not None and output > 1:
                    per_token = (request.finished - request.first_token) / (output - 1)
                    self.time_per_output_token.labels(model).observe(per_token)

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.request_duration.labels(route).observe(seconds)

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def connection_closed(self, reason: str) -> None:
        self.connections_closed.labels(reason).inc()

    def render(self) -> tuple[bytes, str]:
        """The text exposition format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
