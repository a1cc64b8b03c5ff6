"""AsyncEngine: lets many asyncio callers share one `Engine`, whose step loop runs on its own thread.

The event loop only validates inputs (cheap), queues them and awaits futures; the engine thread tokenizes,
batches whatever has arrived from every connection, runs the model and resolves the futures with
`loop.call_soon_threadsafe`. A failing request fails alone (`Engine.step` isolates it). The loop is
supervised: should `step` itself raise (a bug, an out-of-memory error), every caller waiting at that moment
gets `EngineRestarted`, the engine's queues are reset and the loop starts again; after `max_restarts` within
`restart_window_s` it gives up, reports unhealthy and calls `on_fatal` (`wde serve` then exits non-zero so a
process supervisor can restart it). No caller waits forever: stopping drains the queue, then fails what is left,
and a call given a `timeout` is aborted in the scheduler when it passes (`EngineTimeout`).

The loop beats a heartbeat (`wde.core.heartbeat`) after every step and every second while idle, so
`seconds_since_step` grows only while a step runs or the loop is stuck; the server's /health reads it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from typing import Any, Callable, Sequence

from wde.components.image_decode import ImageDecoder
from wde.core.heartbeat import Heartbeat
from wde.engine import BatchStats, Engine, EngineLoad
from wde.engine_info import EngineInfo
from wde.request import PoolingParams, Request, RequestOutput
from wde.restarts import RestartBudget

log = logging.getLogger("wde.async_engine")


class EngineOverloaded(Exception):
    """More calls are in flight than `max_concurrent_requests`; the caller should retry later."""


class EngineUnavailable(Exception):
    """The engine thread is stopped or died; nothing can be served."""


class EngineRestarted(EngineUnavailable):
    """The engine loop failed while this request was waiting and was restarted; retrying the request is safe."""


class EngineTimeout(EngineUnavailable):
    """The call's `timeout` passed before its answer was ready; its inputs were aborted in the engine (those already
    running finish, and their results are dropped). Retrying later is safe."""


IDLE_BEAT_S = 0.25
"""How often an idle engine loop beats its heartbeat (a busy one beats after every step)."""


RESTARTED = "the engine restarted after an internal error while this request was waiting; retrying it is safe"


InputNames = str | Sequence[str | tuple[str, str]]
"""How errors name the inputs: one field name for all (`input`, then `input[i]` when there are several), or
one name per input, a pair naming each side (e.g. ``("query", "documents[3]")``)."""

_Resolution = tuple["asyncio.Future[RequestOutput]", RequestOutput | BaseException]


class AsyncEngine:
    """Async front of an `Engine`. `start()` it before use and `stop()` it when done."""

    def __init__(self, engine: Engine, max_concurrent_requests: int = 512,
                 on_batch: Callable[[BatchStats], None] | None = None, *, max_restarts: int = 5,
                 restart_window_s: float = 60.0, on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.info: EngineInfo = engine.info
        self.tokenizer = engine.tokenizer
        self.input_processor = engine.input_processor
        self.max_concurrent_requests = max_concurrent_requests
        self.restarts = RestartBudget(max_restarts, restart_window_s)
        self.on_fatal = on_fatal
        """Called on the engine thread when the loop gives up (too many restarts, or a non-Exception)."""
        engine.on_batch = on_batch
        self._pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[RequestOutput]]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._closed = False
        """Set (under `_lock`) when the loop stopped or gave up: nothing more is added."""
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.active_calls = 0
        """`encode` calls admitted and not finished (touched only on the event loop)."""
        self.num_aborted = 0
        self.num_timed_out = 0
        """`encode` calls that ran past their `timeout`."""
        self.error: BaseException | None = None
        """Set when the engine loop itself died (not a single batch); the engine is then unhealthy."""
        self.heartbeat = Heartbeat()
        self.images = ImageDecoder.of(engine)
        """Decodes a call's images before they are queued, so the engine loop never decodes (None: texts only)."""

    def start(self) -> None:
        self.heartbeat.beat()
        self._thread = threading.Thread(target=self._run, name="wde-engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish what is queued (up to `timeout` seconds), stop the loop, and fail whatever is still waiting."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_all(EngineUnavailable("the server is shutting down"), close=True)
        if self.images is not None:
            self.images.close()

    @property
    def num_restarts(self) -> int:
        return self.restarts.used

    @property
    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping and self.error is None

    @property
    def seconds_since_step(self) -> float:
        """Seconds since the engine loop last finished a step or looked at an empty queue: near 0 unless a step
        is running or the loop is stuck."""
        return self.heartbeat.age()

    @property
    def queue_depth(self) -> int:
        """Requests accepted and not yet scheduled into a batch."""
        return int(self.engine.scheduler.num_waiting)

    @property
    def load(self) -> EngineLoad:
        """Queued and running inputs and tokens of the engine (`Engine.load`)."""
        return self.engine.load()

    @property
    def num_pending(self) -> int:
        """Requests accepted whose result has not been delivered yet."""
        return len(self._pending)

    async def encode(self, inputs: Sequence[Any], params: PoolingParams | Sequence[PoolingParams],
                     fields: InputNames = "input", request_id: str | None = None,
                     timeout: float | None = None) -> list[RequestOutput]:
        """Run inputs through the engine (batched with everyone else's); outputs come back in input order.

        Raises `RequestError` (naming the input, see `InputNames`) for invalid input, `EngineOverloaded` or
        `EngineUnavailable` (`EngineRestarted` when the loop failed while waiting, `EngineTimeout` when `timeout`
        seconds passed first); a request our code failed on comes back with an error of kind "internal". Engine
        request ids are `{request_id}.{n}-{i}`. Cancelling the await, or the timeout, aborts the requests that have
        not been scheduled yet.
        """
        # Unique even when clients reuse an id (x-request-id is theirs to choose): a clash would orphan a future.
        requests = admit(self, self.engine.make_request, inputs, params, fields,
                         f"{request_id or 'srv'}.{next(self._ids)}")
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in requests]
        self.active_calls += 1
        try:
            if self.images is not None and self.images.wanted(requests):  # decoded before the engine sees them
                started = loop.time()
                requests = await await_within(self.images.prepare(requests), timeout)
                timeout = None if timeout is None else timeout - (loop.time() - started)
            queued = []
            for r, f in zip(requests, futures):
                if isinstance(r, RequestOutput):  # refused as it was decoded (a truncated file)
                    f.set_result(r)
                else:
                    queued.append((r, f))
            with self._lock:  # with `_fail_all`'s reset, a request is either failed and dropped, or kept whole
                if self._closed:
                    raise EngineUnavailable("the engine is not running" + (f": {self.error}" if self.error else ""))
                for r, f in queued:
                    self._pending[r.request_id] = (loop, f)
                for r, _ in queued:
                    self.engine.scheduler.add(r)
            self._wake.set()
            return list(await await_within(asyncio.gather(*futures), timeout))
        except BaseException as e:
            unfinished = [r.request_id for r, f in zip(requests, futures) if f.cancelled() or not f.done()]
            for rid in unfinished:
                self.engine.abort(rid)
            if isinstance(e, asyncio.CancelledError):
                self.num_aborted += len(unfinished)
            if isinstance(e, asyncio.TimeoutError):
                self.num_timed_out += 1
                raise timed_out(timeout) from None
            raise
        finally:
            self.active_calls -= 1
            with self._lock:
                for r in requests:
                    self._pending.pop(r.request_id, None)

    def _run(self) -> None:
        """The supervisor: runs the step loop, and restarts it after a failure (see the module docstring)."""
        while True:
            try:
                self._loop()
                return
            except Exception as e:  # noqa: BLE001 - recorded, callers told, loop restarted or given up
                if not self._restart(e):
                    return
            except BaseException as e:  # noqa: BLE001 - e.g. SystemExit from a plugin: never restarted
                self._give_up(e)
                return

    def _loop(self) -> None:
        engine = self.engine
        beat = self.heartbeat.beat
        while not self._stopping or engine.has_unfinished():
            self._wake.clear()
            outputs = engine.step()
            beat()
            if outputs:
                self._resolve([(o.request_id, o) for o in outputs])
            elif not engine.has_unfinished() and not self._stopping:
                while not self._wake.wait(IDLE_BEAT_S):
                    beat()
                beat()

    def _restart(self, error: Exception) -> bool:
        """Fail every waiting caller, reset the engine's queues; False when the restart budget is spent."""
        log.error("the engine loop failed (%s: %s); restarting it", type(error).__name__, error, exc_info=error)
        granted = self.restarts.spend()  # counted before any caller hears of the restart (`num_restarts`)
        self._fail_all(EngineRestarted(RESTARTED), reset=True)
        if not granted:
            self._give_up(error)
            return False
        return True

    def _give_up(self, error: BaseException) -> None:
        log.critical("the engine loop failed %d times in %.0f s (last: %s: %s); giving up", self.restarts.recent,
                     self.restarts.window_s, type(error).__name__, error)
        self.error = error
        self._fail_all(EngineUnavailable("the engine is not running: it failed repeatedly; see the server log"),
                       close=True)
        if self.on_fatal is not None:
            try:
                self.on_fatal(error)
            except Exception:  # noqa: BLE001 - nothing more can be done from here
                log.exception("the on_fatal callback failed")

    def _fail_all(self, failure: BaseException, *, reset: bool = False, close: bool = False) -> None:
        """Fail every waiting caller; `reset` empties the engine's queues in the same step (a request added while
        the callers were being failed would be dropped by the reset and wait for ever), `close` refuses more."""
        with self._lock:
            if reset:
                self.engine.reset()
            if close:
                self._closed = True
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


def check_capacity(handle: Any) -> None:
    """`EngineOverloaded` when `handle` (an `AsyncEngine` or a `CoreClient`) already has `max_concurrent_requests`
    calls in flight: the one limit an `encode` call and a request fetching its images both take a slot of."""
    if handle.active_calls >= handle.max_concurrent_requests:
        raise EngineOverloaded(f"the server is overloaded: {handle.active_calls} requests in flight,"
                               f" the limit is {handle.max_concurrent_requests}; retry later")


def admit(handle: Any, make_request: Callable[..., Request], inputs: Sequence[Any],
          params: PoolingParams | Sequence[PoolingParams], fields: InputNames, prefix: str) -> list[Request]:
    """The start of an `encode` call (`AsyncEngine`'s or an API server's `CoreClient`'s): refuse it when the engine
    is down or the call limit is reached, then validate each input into a request `{prefix}-{i}`, named for errors."""
    if not handle.healthy:
        raise EngineUnavailable("the engine is not running" + (f": {handle.error}" if handle.error else ""))
    check_capacity(handle)
    per_input = [params] * len(inputs) if isinstance(params, PoolingParams) else list(params)
    names = input_names(fields, len(inputs))
    requests = [make_request(x, p, f"{prefix}-{i}", names[i]) for i, (x, p) in enumerate(zip(inputs, per_input))]
    handle.input_processor.check_request(requests, names)  # e.g. one call's images within a pixel budget

    return requests


async def await_within(work: "asyncio.Future[Any]", timeout: float | None) -> Any:
    """Await `work`, cancelling it and raising `asyncio.TimeoutError` after `timeout` seconds (None: no limit)."""
    if timeout is None:
        return await work
    work.add_done_callback(_retrieved)  # cancelled with its waiter, `wait_for` would leave its error unread
    return await asyncio.wait_for(work, max(0.0, timeout))


def _retrieved(future: "asyncio.Future[Any]") -> None:
    if not future.cancelled():
        future.exception()


def timed_out(timeout: float | None) -> EngineTimeout:
    return EngineTimeout(f"no answer within the request timeout of {timeout:g} s (wde serve --request-timeout): the"
                         " engine is overloaded or stalled; the request was aborted, retrying it later is safe")


def input_names(fields: InputNames, n: int) -> list[str | tuple[str, str]]:
    """One name per input: a single field name becomes `field` (one input) or `field[i]`."""
    if isinstance(fields, str):
        return [fields] if n == 1 else [f"{fields}[{i}]" for i in range(n)]
    if len(fields) != n:
        raise ValueError(f"{len(fields)} input names for {n} inputs")
    return list(fields)


def _set_results(items: list[_Resolution]) -> None:
    for future, result in items:
        if future.done():
            continue
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
