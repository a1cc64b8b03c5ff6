"""The one serving front end: per-call bookkeeping over an engine core, wherever the core runs.

`ServingFrontEnd.encode` admits a call (engine up, call limit, each input validated into a request), has the core
prepare it (decode images, or tokenize for a core in another process), registers each request's future, submits
them and awaits the answers within the call's `timeout`; a cancelled await (the client went away) or a timeout
aborts what the core has not answered, and the counts the server reports (`active_calls`, `num_aborted`,
`num_timed_out`) are kept here, once. The core is reached through a `CoreTransport`: `InProcessCore`
(wde/async_engine.py: an `Engine` stepped on a thread of this process) or `ZmqCore` (wde/core/client.py: an engine
core process over ZeroMQ). A transport hands results back with `resolve` (from any thread) and reports a dead core
with `fatal`; `AsyncEngine` and `CoreClient` are this front end over each transport.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from wde.engine_info import EngineInfo
from wde.model_source import ModelSource
from wde.request import PoolingParams, Request, RequestOutput

log = logging.getLogger("wde.serving")


class EngineOverloaded(Exception):
    """More calls are in flight than `max_concurrent_requests`; the caller should retry later."""


class EngineUnavailable(Exception):
    """The engine is stopped or died; nothing can be served."""


class EngineRestarted(EngineUnavailable):
    """The engine loop failed while this request was waiting and was restarted; retrying the request is safe."""


class EngineTimeout(EngineUnavailable):
    """The call's `timeout` passed before its answer was ready; its inputs were aborted in the engine (those already
    running finish, and their results are dropped). Retrying later is safe."""

InputNames = str | Sequence[str | tuple[str, str]]
"""How errors name the inputs: one field name for all (`input`, then `input[i]` when there are several), or
one name per input, a pair naming each side (e.g. ``("query", "documents[3]")``)."""


@dataclass
class Admitted:
    """A request the core accepted to run: what its output is completed with when it comes back."""

    request_id: str
    token_ids: list[int] | None = None
    """The token ids tokenized on this side (the core sends outputs without them); None in process."""
    tokenization_time: float = 0.0


Result = RequestOutput | BaseException | Callable[[Admitted], RequestOutput]
"""What a transport resolves a request with: its output, the error its caller gets, or a function of the request's
`Admitted` that completes the output (called on the caller's event loop)."""


class CoreTransport(Protocol):
    """How the front end reaches an engine core. Every method but `prepare` and `send` is called on the event loop
    without awaiting; `submit` runs under the front end's lock (with `fail_all`'s reset, a request is either failed
    and dropped or queued whole)."""

    info: EngineInfo
    source: ModelSource
    """The model folder the core serves."""
    tokenizer: Any
    input_processor: Any
    num_restarts: int

    @property
    def running(self) -> bool:
        """Whether the core can take requests (the front end is healthy while this holds and no fatal error)."""

    @property
    def seconds_since_step(self) -> float:
        """Seconds since the core's loop last finished a step or looked at an empty queue."""

    @property
    def queue_depth(self) -> int:
        """Requests the core accepted and has not scheduled (0 where it is not known here)."""

    def make_request(self, inputs: Any, params: PoolingParams, request_id: str, field: Any) -> Request: ...

    def start(self, front: "ServingFrontEnd") -> None: ...

    def stop(self, timeout: float) -> None: ...

    async def prepare(self, requests: list[Request], timeout: float | None) -> tuple[list[RequestOutput | Admitted],
                                                                                    Any]:
        """Per request its output (refused while preparing: a truncated image, an over-long text) or `Admitted`,
        and what `submit` and `send` take; raises `asyncio.TimeoutError` after `timeout` seconds."""

    def submit(self, submission: Any) -> None:
        """Queue the admitted requests (called under the front end's lock)."""

    async def send(self, submission: Any) -> None:
        """Deliver them (after `submit`, outside the lock)."""

    def abort(self, request_ids: list[str]) -> None:
        """Drop requests the core has not answered (unknown ids are ignored)."""

    def reset(self) -> None:
        """Forget every queued request (called under the lock when every waiting caller is failed at once)."""


@dataclass
class _Waiting:
    loop: asyncio.AbstractEventLoop
    future: "asyncio.Future[RequestOutput]"
    admitted: Admitted


class ServingFrontEnd:
    """Serves `encode` calls over `core`. `start()` it on the event loop that calls `encode`, `stop()` it when done."""

    def __init__(self, core: CoreTransport, max_concurrent_requests: int = 512, *, tag: str = "",
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.core = core
        self.info: EngineInfo = core.info
        self.source: ModelSource = core.source
        """The served model's folder."""
        self.tokenizer = core.tokenizer
        self.input_processor = core.input_processor
        self.max_concurrent_requests = max_concurrent_requests
        self.on_fatal = on_fatal
        """Called when the core is gone for good (the loop gave up, the core process exited)."""
        self.active_calls = 0
        """`encode` calls admitted and not finished (touched only on the event loop)."""
        self.num_aborted = 0
        """Requests of calls cancelled before their answer (a client that went away)."""
        self.num_timed_out = 0
        """`encode` calls that ran past their `timeout`."""
        self.error: BaseException | None = None
        """Set when the core died for good; the front end is then unhealthy."""
        self._tag = tag
        self._ids = itertools.count()
        self._pending: dict[str, _Waiting] = {}
        self._lock = threading.Lock()
        self._closed = False
        """Set (under `_lock`) once the core stopped or died: nothing more is queued."""

    def start(self) -> None:
        self.core.start(self)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the core (in process: after finishing what is queued, up to `timeout` seconds) and fail whatever is
        still waiting."""
        self.core.stop(timeout)
        self.fail_all(EngineUnavailable("the server is shutting down"), close=True)

    @property
    def healthy(self) -> bool:
        return self.core.running and self.error is None

    @property
    def num_restarts(self) -> int:
        return self.core.num_restarts

    @property
    def seconds_since_step(self) -> float:
        return self.core.seconds_since_step

    @property
    def queue_depth(self) -> int:
        return self.core.queue_depth

    @property
    def num_pending(self) -> int:
        """Requests submitted whose result has not been delivered yet."""
        return len(self._pending)

    async def encode(self, inputs: Sequence[Any], params: PoolingParams | Sequence[PoolingParams],
                     fields: InputNames = "input", request_id: str | None = None,
                     timeout: float | None = None) -> list[RequestOutput]:
        """Run inputs through the engine (batched with everyone else's); outputs come back in input order.

        Raises `RequestError` (naming the input, see `InputNames`) for invalid input, `EngineOverloaded` or
        `EngineUnavailable` (`EngineRestarted` when the core's loop failed while waiting, `EngineTimeout` when
        `timeout` seconds passed first, preparing included); a request our code failed on comes back with an error
        of kind "internal". Engine request ids are `{request_id}.{tag}{n}-{i}`. Cancelling the await, or the
        timeout, aborts the requests the core has not answered.
        """
        # Unique even when clients reuse an id (x-request-id is theirs to choose): a clash would orphan a future.
        requests = admit(self, self.core.make_request, inputs, params, fields,
                         f"{request_id or 'srv'}.{self._tag}{next(self._ids)}")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        outputs: list[RequestOutput | None] = [None] * len(requests)
        waiting: list[tuple[int, _Waiting]] = []
        self.active_calls += 1
        try:
            entries, submission = await self.core.prepare(requests, _left(deadline, loop))
            for i, entry in enumerate(entries):
                if isinstance(entry, RequestOutput):
                    outputs[i] = entry
                else:
                    waiting.append((i, _Waiting(loop, loop.create_future(), entry)))
            if waiting:
                with self._lock:
                    if self._closed:
                        raise EngineUnavailable("the engine is not running" + (f": {self.error}" if self.error else ""))
                    for _, w in waiting:
                        self._pending[w.admitted.request_id] = w
                    self.core.submit(submission)
                await self.core.send(submission)
                futures = [w.future for _, w in waiting]
                if len(futures) == 1:  # most calls: no gathering future to make
                    results = [await await_within(futures[0], _left(deadline, loop))]
                else:
                    results = await await_within(asyncio.gather(*futures), _left(deadline, loop))
                for (i, _), out in zip(waiting, results):
                    outputs[i] = out
            return outputs  # type: ignore[return-value]
        except BaseException as e:
            sent = [w.admitted.request_id for _, w in waiting if w.future.cancelled() or not w.future.done()]
            if sent:
                self.core.abort(sent)
            if isinstance(e, asyncio.CancelledError):  # every input without an answer, queued or still preparing
                self.num_aborted += sum(1 for out in outputs if out is None) - (len(waiting) - len(sent))
            if isinstance(e, asyncio.TimeoutError):
                self.num_timed_out += 1
                raise timed_out(timeout) from None
            raise
        finally:
            self.active_calls -= 1
            with self._lock:
                for _, w in waiting:
                    self._pending.pop(w.admitted.request_id, None)

    def resolve(self, results: list[tuple[str, Result]]) -> None:
        """Hand results to their callers' event loops, one callback per loop (from any thread); results of callers
        that are gone are dropped."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Waiting, Result]]] = {}
        with self._lock:
            for rid, result in results:
                entry = self._pending.get(rid)
                if entry is not None:
                    by_loop.setdefault(entry.loop, []).append((entry, result))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_set_results, items)
            except RuntimeError:
                log.warning("dropping %d results: their event loop is closed", len(items))

    def fail_all(self, failure: BaseException, *, reset: bool = False, close: bool = False) -> None:
        """Fail every waiting caller; `reset` empties the core's queues in the same step (a request added while the
        callers were being failed would be dropped by the reset and wait for ever), `close` refuses more."""
        with self._lock:
            if reset:
                self.core.reset()
            if close:
                self._closed = True
            ids = list(self._pending)
        self.resolve([(rid, failure) for rid in ids])

    def fatal(self, error: BaseException, failure: BaseException, *, reset: bool = False) -> None:
        """The core is gone for good: record `error`, fail every waiting caller with `failure` (`reset`: emptying the
        core's queues in the same step, see `fail_all`), refuse more and call `on_fatal`."""
        self.error = error
        self.fail_all(failure, reset=reset, close=True)
        if self.on_fatal is not None:
            try:
                self.on_fatal(error)
            except Exception:  # noqa: BLE001 - nothing more can be done from here
                log.exception("the on_fatal callback failed")


def check_capacity(handle: Any) -> None:
    """`EngineOverloaded` when `handle` (a front end) already has `max_concurrent_requests` calls in flight: the one
    limit an `encode` call and a request fetching its images both take a slot of."""
    if handle.active_calls >= handle.max_concurrent_requests:
        raise EngineOverloaded(f"the server is overloaded: {handle.active_calls} requests in flight,"
                               f" the limit is {handle.max_concurrent_requests}; retry later")


def admit(handle: Any, make_request: Callable[..., Request], inputs: Sequence[Any],
          params: PoolingParams | Sequence[PoolingParams], fields: InputNames, prefix: str) -> list[Request]:
    """The start of an `encode` call: refuse it when the engine is down or the call limit is reached, then validate
    each input into a request `{prefix}-{i}`, named for errors."""
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


def _left(deadline: float | None, loop: asyncio.AbstractEventLoop) -> float | None:
    return None if deadline is None else deadline - loop.time()


def _set_results(items: list[tuple[_Waiting, Result]]) -> None:
    for entry, result in items:
        future = entry.future
        if future.done():
            continue
        if isinstance(result, BaseException):
            future.set_exception(result)
        elif isinstance(result, RequestOutput):
            future.set_result(result)
        else:
            future.set_result(result(entry.admitted))
