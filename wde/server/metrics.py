"""Prometheus metrics of one server (its own registry, so several apps can live in one process).

Tokens per second is `rate(wde_prompt_tokens_total[1m])`; the mean server-formed batch size is
`wde_batch_size_sum / wde_batch_size_count`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from wde.async_engine import AsyncEngine
from wde.engine import BatchStats
from wde.request import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("wde_requests", "HTTP requests by route and status code", ["route", "status"],
                                registry=r)
        self.latency = Histogram("wde_request_latency_seconds", "HTTP request latency by route", ["route"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("wde_queue_time_seconds", "time an input waited before its batch started",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.inference_time = Histogram("wde_inference_time_seconds", "model time of the batch an input ran in",
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("wde_batch_size", "inputs per server-formed batch", buckets=_BATCH_BUCKETS,
                                    registry=r)
        self.batch_tokens = Histogram("wde_batch_tokens", "tokens per server-formed batch",
                                      buckets=tuple(2 ** i for i in range(4, 17)), registry=r)
        self.prompt_tokens = Counter("wde_prompt_tokens", "prompt tokens processed", registry=r)
        self.device_seconds = Counter("wde_device_seconds", "seconds batches spent on the device, copies included"
                                      " (busy fraction = rate(wde_device_seconds_total[1m]))", registry=r)
        self.inputs = Counter("wde_inputs", "inputs processed (one request may carry many)", registry=r)
        self.queue_depth = Gauge("wde_queue_depth", "inputs waiting to be scheduled", registry=r)
        self.pending = Gauge("wde_pending_inputs", "inputs accepted and not answered yet", registry=r)
        self.active = Gauge("wde_active_requests", "HTTP requests being served by the engine", registry=r)
        self.aborted = Gauge("wde_aborted_inputs", "inputs aborted because their client went away", registry=r)
        self.restarts = Gauge("wde_engine_restarts", "times the engine loop failed and was restarted", registry=r)
        self.healthy = Gauge("wde_engine_healthy", "1 while the engine loop runs, 0 once it gave up", registry=r)

    def bind(self, engine: AsyncEngine) -> None:
        """Gauges read the live engine at scrape time."""
        self.queue_depth.set_function(lambda: engine.queue_depth)
        self.pending.set_function(lambda: engine.num_pending)
        self.active.set_function(lambda: engine.active_calls)
        self.aborted.set_function(lambda: engine.num_aborted)
        self.restarts.set_function(lambda: engine.num_restarts)
        self.healthy.set_function(lambda: float(engine.healthy))

    def on_batch(self, stats: BatchStats) -> None:
        """Called on the engine thread after each batch (prometheus-client metrics are thread-safe)."""
        self.batch_size.observe(stats.num_requests)
        self.batch_tokens.observe(stats.num_tokens)
        self.prompt_tokens.inc(stats.num_tokens)
        self.device_seconds.inc(stats.seconds)
        self.inputs.inc(stats.num_requests)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            self.queue_time.observe(o.queue_time)
            self.inference_time.observe(o.inference_time)

    def on_request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
