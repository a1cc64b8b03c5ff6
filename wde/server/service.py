"""What every route shares: the engine behind the API, limits, the model-name check, and `run`, which turns
inputs into outputs (or into the right `ApiError`) while watching for the client going away."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from fastapi import Request

from wde.async_engine import AsyncEngine, EngineOverloaded, EngineUnavailable
from wde.errors import RequestError
from wde.model_source import DEFAULT_MODEL
from wde.request import PoolingParams, RequestOutput
from wde.server.config import ServerConfig
from wde.server.errors import ApiError
from wde.server.metrics import ServerMetrics

_NEEDS = {
    "dense": "an embedding model (output 'dense')",
    "score": "a cross-encoder reranker (output 'score')",
    "probs": "a sequence classifier (output 'probs')",
    "sparse": "a sparse-embedding model such as bge-m3 (output 'sparse')",
}


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready; its requests were aborted."""


@dataclass
class Result:
    """Outputs in input order plus TEI's timing headers."""

    outputs: list[RequestOutput]
    headers: dict[str, str]

    @property
    def prompt_tokens(self) -> int:
        return sum(o.num_prompt_tokens for o in self.outputs)

    @property
    def dense(self) -> list[np.ndarray]:
        return [o.outputs["dense"] for o in self.outputs]


class Service:
    def __init__(self, engine: AsyncEngine, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.model_name = config.served_model_name or config.model or DEFAULT_MODEL
        self.created = int(time.time())

    @property
    def supported(self) -> tuple[str, ...]:
        return self.engine.engine.supported_outputs

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError("not_found", f"model {name!r} is not served here; this server serves"
                           f" {self.model_name!r}", "model")

    def require(self, output: str, route: str) -> None:
        if output not in self.supported:
            raise ApiError("unsupported", f"{route} needs {_NEEDS.get(output, repr(output))}, but workflow"
                           f" {self.engine.engine.workflow.name!r} produces {list(self.supported)}")

    def labels(self) -> list[str]:
        """Class names in class-id order: the pooler's `labels`, else the model config's id2label."""
        labels = getattr(self.engine.engine.components["pooler"], "labels", None)
        if labels is None:
            labels = getattr(self.engine.engine.source.hf_config, "id2label", None) or {}
        if isinstance(labels, dict):
            return [str(labels[k]) for k in sorted(labels, key=int)]
        return [str(x) for x in labels]

    async def run(self, request: Request, inputs: Sequence[Any], params: PoolingParams | Sequence[PoolingParams],
                  field: str) -> Result:
        """Validate the batch, run it, and map every failure to its status code."""
        start = time.perf_counter()
        if not inputs:
            raise ApiError("empty", f"{field} is empty: send at least one input", field)
        limit = self.config.max_client_batch_size
        if len(inputs) > limit:
            raise ApiError("validation", f"batch size {len(inputs)} > maximum allowed batch size {limit}"
                           f" ({field} has {len(inputs)} inputs; the limit is {limit})", field)
        for i, x in enumerate(inputs):
            if _is_empty(x):
                where = field if len(inputs) == 1 else f"{field}[{i}]"
                raise ApiError("empty", f"{where} is empty (after stripping whitespace); send non-empty text", where)
        try:
            outputs = await _unless_disconnected(request, self.engine.encode(inputs, params, field))
        except RequestError as e:
            raise ApiError("validation", str(e), e.field) from None
        except EngineOverloaded as e:
            raise ApiError("overloaded", str(e)) from None
        except EngineUnavailable as e:
            raise ApiError("unhealthy", str(e)) from None
        failed = [o.error for o in outputs if o.error is not None and o.error.kind == "internal"]
        if failed:
            raise ApiError("backend", str(failed[0]))
        for i, out in enumerate(outputs):
            if out.error is not None:
                where = field if len(outputs) == 1 else f"{field}[{i}]"
                kind = "too_long" if out.error.kind == "too_long" else "validation"
                raise ApiError(kind, f"{where}: {out.error}", where)
        self.metrics.on_outputs(outputs)
        return Result(outputs, _timing_headers(outputs, start, inputs))


def _is_empty(item: Any) -> bool:
    """An input that is blank text, a pair with a blank side, or an empty token list."""
    if isinstance(item, dict):
        return not item.get("token_ids")
    texts = item if isinstance(item, tuple) else (item,)
    return any(isinstance(t, str) and not t.strip() for t in texts)


async def _unless_disconnected(request: Request, work: Any) -> list[RequestOutput]:
    """Await the engine, but give up (cancelling, hence aborting, the work) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        raise ClientDisconnected()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _timing_headers(outputs: list[RequestOutput], start: float, inputs: Sequence[Any]) -> dict[str, str]:
    """TEI's headers: milliseconds, per-input times averaged over the batch."""
    def ms(seconds: float) -> str:
        return str(int(seconds * 1000))

    n = len(outputs)
    total = time.perf_counter() - start
    chars = sum(len(t) for x in inputs for t in (x if isinstance(x, tuple) else (x,)) if isinstance(t, str))
    return {
        "x-compute-type": "wde",
        "x-compute-time": ms(total),
        "x-total-time": ms(total),
        "x-compute-tokens": str(sum(o.num_prompt_tokens for o in outputs)),
        "x-compute-characters": str(chars),
        "x-tokenization-time": ms(sum(o.tokenization_time for o in outputs) / n),
        "x-queue-time": ms(sum(o.queue_time for o in outputs) / n),
        "x-inference-time": ms(sum(o.inference_time for o in outputs) / n),
    }


def to_json(value: Any) -> Any:
    """numpy outputs to JSON: arrays to lists, sparse {token_id: weight} dicts to string-keyed dicts."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): float(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def scalar(value: Any) -> float:
    return float(np.asarray(value, dtype=np.float32).reshape(-1)[0])
