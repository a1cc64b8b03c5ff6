"""AsyncEngine: lets many asyncio callers share one `Engine`, whose step loop runs on its own thread.

The event loop only validates inputs (cheap), queues them and awaits futures; the engine thread tokenizes,
batches whatever has arrived from every connection, runs the model and resolves the futures with
`loop.call_soon_threadsafe`. A batch that fails fails only its own requests; the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
from typing import Any, Callable, Sequence

from wde.engine import BatchStats, Engine
from wde.errors import RequestError
from wde.request import PoolingParams, RequestOutput

log = logging.getLogger("wde.async_engine")


class EngineOverloaded(Exception):
    """More calls are in flight than `max_concurrent_requests`; the caller should retry later."""


class EngineUnavailable(Exception):
    """The engine thread is stopped or died; nothing can be served."""


_OPTION_FIELDS = frozenset(f.name for f in dataclasses.fields(PoolingParams))

_Resolution = tuple["asyncio.Future[RequestOutput]", RequestOutput | BaseException]


class AsyncEngine:
    """Async front of an `Engine`. `start()` it before use and `stop()` it when done."""

    def __init__(self, engine: Engine, max_concurrent_requests: int = 512,
                 on_batch: Callable[[BatchStats], None] | None = None) -> None:
        self.engine = engine
        self.max_concurrent_requests = max_concurrent_requests
        engine.on_batch = on_batch
        self._pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[RequestOutput]]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.active_calls = 0
        """`encode` calls admitted and not finished (touched only on the event loop)."""
        self.num_aborted = 0
        self.error: BaseException | None = None
        """Set when the engine loop itself died (not a single batch); the engine is then unhealthy."""

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="wde-engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping and self.error is None

    @property
    def queue_depth(self) -> int:
        """Requests accepted and not yet scheduled into a batch."""
        return int(getattr(self.engine.scheduler, "num_waiting", 0))

    @property
    def num_pending(self) -> int:
        """Requests accepted whose result has not been delivered yet."""
        return len(self._pending)

    async def encode(self, inputs: Sequence[Any], params: PoolingParams | Sequence[PoolingParams],
                     field: str = "input") -> list[RequestOutput]:
        """Run inputs through the engine (batched with everyone else's); outputs come back in input order.

        Raises `RequestError` (naming `field[i]`) for invalid input, `EngineOverloaded` or `EngineUnavailable`;
        a request whose batch failed comes back with an error of kind "internal". Cancelling the await aborts the requests that have not been scheduled yet.
        """
        if not self.healthy:
            raise EngineUnavailable("the engine is not running" + (f": {self.error}" if self.error else ""))
        if self.active_calls >= self.max_concurrent_requests:
            raise EngineOverloaded(f"the server is overloaded: {self.active_calls} requests in flight,"
                                   f" the limit is {self.max_concurrent_requests}; retry later")
        per_input = [params] * len(inputs) if isinstance(params, PoolingParams) else list(params)
        requests = []
        for i, (x, p) in enumerate(zip(inputs, per_input)):
            try:
                requests.append(self.engine.make_request(x, p, f"srv-{next(self._ids)}"))
            except RequestError as e:
                if e.field in _OPTION_FIELDS:
                    raise  # about an option every input shares (e.g. dimensions): it names that option itself
                where = field if len(inputs) == 1 else f"{field}[{i}]"
                raise RequestError(f"{where}: {e}", where, e.kind) from None
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in requests]
        self.active_calls += 1
        try:
            with self._lock:
                for r, f in zip(requests, futures):
                    self._pending[r.request_id] = (loop, f)
            for r in requests:
                self.engine.scheduler.add(r)
            self._wake.set()
            return list(await asyncio.gather(*futures))
        except BaseException as e:
            unfinished = [r.request_id for r, f in zip(requests, futures) if f.cancelled() or not f.done()]
            for rid in unfinished:
                self.engine.abort(rid)
            if isinstance(e, asyncio.CancelledError):
                self.num_aborted += len(unfinished)
            raise
        finally:
            self.active_calls -= 1
            with self._lock:
                for r in requests:
                    self._pending.pop(r.request_id, None)

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._wake.clear()
                outputs = engine.step()
                if outputs:
                    self._resolve([(o.request_id, o) for o in outputs])
                elif not engine.has_unfinished():
                    self._wake.wait()
        except BaseException as e:  # noqa: BLE001 - recorded, reported as unhealthy, pending requests failed
            log.exception("the engine loop died")
            self.error = e
            self._fail_all(e)

    def _fail_all(self, error: BaseException) -> None:
        failure = EngineUnavailable(f"the engine loop died: {type(error).__name__}: {error}")
        with self._lock:
            ids = list(self._pending)
        self._resolve([(rid, failure) for rid in ids])

    def _resolve(self, results: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand results to their event loops, one callback per loop (requests of gone callers are dropped)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[_Resolution]] = {}
        with self._lock:
            for rid, result in results:
                entry = self._pending.get(rid)
                if entry is not None:
                    by_loop.setdefault(entry[0], []).append((entry[1], result))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_set_results, items)
            except RuntimeError:
                log.warning("dropping %d results: their event loop is closed", len(items))


def _set_results(items: list[_Resolution]) -> None:
    for future, result in items:
        if future.done():
            continue
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
