"""Prometheus metrics of one server (its own registry, so several apps can live in one process).

With the engine core in its own process (`wde serve --api-servers N`) every process writes its samples to
prometheus-client's multiprocess directory and any API server's /metrics sums them: counters and histograms add
up over processes, the core sets the queue and restart gauges, each API server its own in-flight gauges, and
`wde_engine_healthy` is the minimum over processes.

Engine series carry a `model` label, the served model's name (`wde serve --model A --model B`: each model is its
own engine, with its own queue and token budget, `wde_token_budget`, and its weights' memory,
`wde_model_weight_bytes`); HTTP series (`wde_requests_total`, latency) are by route.

`wde_engine_seconds_since_step` is read from the engine's heartbeat when scraped (an API server reads the core's), so it keeps growing while the core is frozen.

What an autoscaler reads (KEDA, an HPA, Ray Serve's autoscaling: docs/scaling.md): `wde_queue_depth` and
`wde_queued_tokens` (waiting), `wde_running_inputs` and `wde_running_tokens` (on the device), from `Engine.load`.

Tokens per second is `rate(wde_prompt_tokens_total[1m])`; the mean server-formed batch size is
`wde_batch_size_sum / wde_batch_size_count` (per model; `sum without (model)` for the server).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess, values

from wde.engine import BatchStats, EngineLoad
from wde.request import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def multiprocess_mode() -> bool:
    """Whether this process writes its samples to a multiprocess directory (set up before its first import of
    prometheus-client, as the launcher does for the processes it starts)."""
    return values.ValueClass is not values.MutexValue


ENGINE = ["model"]
"""The label of every engine series: which served model's engine (`wde serve --model A --model B`)."""


class ServerMetrics:
    """The server's metrics: HTTP series by route, engine series by `model` (`for_model`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.multiprocess = multiprocess_mode()
        self._models: dict[str, ModelMetrics] = {}
        r = self.registry
        self.requests = Counter("wde_requests", "HTTP requests by route and status code", ["route", "status"],
                                registry=r)
        self.latency = Histogram("wde_request_latency_seconds", "HTTP request latency by route", ["route"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("wde_queue_time_seconds", "time an input waited before its batch started",
                                    ENGINE, buckets=_LATENCY_BUCKETS, registry=r)
        self.inference_time = Histogram("wde_inference_time_seconds", "model time of the batch an input ran in",
                                        ENGINE, buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("wde_batch_size", "inputs per server-formed batch", ENGINE,
                                    buckets=_BATCH_BUCKETS, registry=r)
        self.batch_tokens = Histogram("wde_batch_tokens", "tokens per server-formed batch", ENGINE,
                                      buckets=tuple(2 ** i for i in range(4, 17)), registry=r)
        self.prompt_tokens = Counter("wde_prompt_tokens", "prompt tokens processed", ENGINE, registry=r)
        self.device_seconds = Counter("wde_device_seconds", "seconds batches spent on the device, copies included"
                                      " (busy fraction = rate(wde_device_seconds_total[1m]))", ENGINE, registry=r)
        self.inputs = Counter("wde_inputs", "inputs processed (one request may carry many)", ENGINE, registry=r)
        self.queue_depth = Gauge("wde_queue_depth", "inputs waiting to be scheduled", ENGINE, registry=r,
                                 multiprocess_mode="livesum")
        self.queued_tokens = Gauge("wde_queued_tokens", "tokens of the waiting inputs tokenized so far (the"
                                   " scheduler tokenizes about a batch ahead; wde_queue_depth counts every input)",
                                   ENGINE, registry=r, multiprocess_mode="livesum")
        self.running_inputs = Gauge("wde_running_inputs", "inputs in batches on the device", ENGINE, registry=r,
                                    multiprocess_mode="livesum")
        self.running_tokens = Gauge("wde_running_tokens", "tokens in batches on the device", ENGINE, registry=r,
                                    multiprocess_mode="livesum")
        self.pending = Gauge("wde_pending_inputs", "inputs accepted and not answered yet", ENGINE, registry=r,
                             multiprocess_mode="livesum")
        self.active = Gauge("wde_active_requests", "HTTP requests being served by the engine", ENGINE, registry=r,
                            multiprocess_mode="livesum")
        self.aborted = Gauge("wde_aborted_inputs", "inputs aborted because their client went away", ENGINE,
                             registry=r, multiprocess_mode="sum")
        self.restarts = Gauge("wde_engine_restarts", "times the engine loop failed and was restarted", ENGINE,
                              registry=r, multiprocess_mode="max")
        self.healthy = Gauge("wde_engine_healthy", "1 while the engine loop runs, 0 once it gave up", ENGINE,
                             registry=r, multiprocess_mode="min")
        self.since_step = Gauge("wde_engine_seconds_since_step", "seconds since the engine loop last finished a step"
                                " or looked at an empty queue: near 0 unless a step runs or the loop is hung or frozen"
                                " (/health answers 503 past --stall-timeout)", ENGINE, registry=r,
                                multiprocess_mode="mostrecent")
        self.timeouts = Counter("wde_request_timeouts", "requests answered 503 because --request-timeout passed"
                                " (their inputs aborted in the engine)", ENGINE, registry=r)
        self.token_budget = Gauge("wde_token_budget", "tokens one batch of the model's engine may hold (its"
                                  " scheduler's budget; every model's engine has its own)", ENGINE, registry=r,
                                  multiprocess_mode="max")
        self.weight_bytes = Gauge("wde_model_weight_bytes", "bytes of the model's weights in memory", ENGINE,
                                  registry=r, multiprocess_mode="max")

    def for_model(self, model: str) -> ModelMetrics:
        """The engine series of served model `model` (one object per model)."""
        if model not in self._models:
            self._models[model] = ModelMetrics(self, model)
        return self._models[model]

    def refresh(self) -> None:
        """Write this API server's gauges (multiprocess mode; the core writes its own in `on_core_step`)."""
        for each in self._models.values():
            each.refresh()

    def on_request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)
        if self.multiprocess:
            self.refresh()

    def render(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        self.refresh()
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)
        return generate_latest(merged)


class ModelMetrics:
    """The engine series of one served model: `ServerMetrics`' labelled with `model`."""

    def __init__(self, metrics: ServerMetrics, model: str) -> None:
        self.multiprocess = metrics.multiprocess
        self._engine: Any = None
        m = metrics
        (self.queue_time, self.inference_time, self.batch_size, self.batch_tokens, self.prompt_tokens,
         self.device_seconds, self.inputs, self.queue_depth, self.pending, self.active, self.aborted, self.restarts,
         self.healthy, self.since_step, self.timeouts, self.token_budget, self.weight_bytes, self.queued_tokens,
         self.running_inputs, self.running_tokens) = (
            series.labels(model) for series in (
                m.queue_time, m.inference_time, m.batch_size, m.batch_tokens, m.prompt_tokens, m.device_seconds,
                m.inputs, m.queue_depth, m.pending, m.active, m.aborted, m.restarts, m.healthy, m.since_step,
                m.timeouts, m.token_budget, m.weight_bytes, m.queued_tokens, m.running_inputs, m.running_tokens))

    def bind(self, engine: Any) -> None:
        """Gauges read the live engine (an `AsyncEngine`, or an API server's `CoreClient`) at scrape time; in
        multiprocess mode they are written as requests finish (see `refresh`)."""
        if engine.info.token_budget is not None:
            self.token_budget.set(engine.info.token_budget)
        if self.multiprocess:
            self._engine = engine
            self.healthy.set(1.0)  # every process writes each gauge; 0, the initial value, would win the minimum
            return
        self.queue_depth.set_function(lambda: engine.queue_depth)
        self.restarts.set_function(lambda: engine.num_restarts)
        if hasattr(engine, "load"):  # an engine in this process (an API server's client reads the core's queue)
            self.queued_tokens.set_function(lambda: engine.load.queued_tokens)
            self.running_inputs.set_function(lambda: engine.load.running_inputs)
            self.running_tokens.set_function(lambda: engine.load.running_tokens)
        for gauge, read in self._api_gauges(engine):
            gauge.set_function(read)

    def _api_gauges(self, engine: Any) -> tuple[tuple[Gauge, Any], ...]:
        """The gauges the API side of the engine knows (the queue and restarts are the engine loop's)."""
        return ((self.pending, lambda: engine.num_pending), (self.active, lambda: engine.active_calls),
                (self.aborted, lambda: engine.num_aborted), (self.healthy, lambda: float(engine.healthy)),
                (self.since_step, lambda: engine.seconds_since_step))

    def refresh(self) -> None:
        """Write this API server's gauges of the model (multiprocess mode)."""
        if self._engine is not None:
            for gauge, read in self._api_gauges(self._engine):
                gauge.set(read())

    def on_weights(self, model: Any) -> None:
        """Record the bytes of `model`'s weights, where the engine is loaded (`weight_bytes`)."""
        self.weight_bytes.set(weight_bytes(model))

    def on_core_step(self, load: EngineLoad, restarts: int) -> None:
        """The engine core's gauges, written after each step."""
        self.queue_depth.set(load.queued_inputs)
        self.queued_tokens.set(load.queued_tokens)
        self.running_inputs.set(load.running_inputs)
        self.running_tokens.set(load.running_tokens)
        self.restarts.set(restarts)
        self.healthy.set(1.0)

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


def weight_bytes(model: Any) -> int:
    """Bytes of the tensors a model module holds: its parameters and buffers, and the plain tensor attributes of
    its submodules (weights prepacked for a CPU kernel are no parameters), each storage counted once."""
    import torch

    if not isinstance(model, torch.nn.Module):
        return 0
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        owned = [*module.parameters(recurse=False), *module.buffers(recurse=False),
                 *(v for v in vars(module).values() if isinstance(v, torch.Tensor))]
        for tensor in owned:
            try:
                storage = tensor.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # an opaque (mkldnn) tensor: no storage to share
                key, size = id(tensor), tensor.numel() * tensor.element_size()
            if key not in seen:
                seen.add(key)
                total += size
    return total
