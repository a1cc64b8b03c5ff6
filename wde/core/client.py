"""An API server's handle on an engine core in another process, with `AsyncEngine`'s interface.

`encode` validates and tokenizes on this side (`Frontend`), sends token ids to the core and awaits the results,
which a receiver task hands to the waiting callers. Images are decoded and preprocessed on this side too, never on
the event loop (a call holding an image runs its request processor on a pool of `Frontend.image_workers` threads,
as a call with a huge text runs on the tokenize thread), and travel as raw float32 pixel values (docs/images.md).
A socket monitor watches the link: if the core process goes away, every waiting caller gets `EngineUnavailable` at
once (a 503, never a hang), the client reports unhealthy and calls `on_fatal` (the API server then shuts down; the
launcher sees the core's exit and stops the rest). A call given a `timeout` sends the core an abort when it passes
and raises `EngineTimeout`; the core's heartbeat file (`wde.core.heartbeat`) tells how long ago its loop last made
progress, even while it is frozen.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from wde.async_engine import (EngineRestarted, EngineUnavailable, InputNames, admit, await_within,
                              timed_out)
from wde.core import wire
from wde.core.engine_core import socket
from wde.core.heartbeat import Heartbeat, heartbeat_path
from wde.core.frontend import Frontend
from wde.engine_info import EngineInfo
from wde.errors import RequestError
from wde.request import PoolingParams, Request, RequestOutput, SchedulableRequest

log = logging.getLogger("wde.core")


class _Waiting:
    __slots__ = ("future", "token_ids", "tokenization_time")

    def __init__(self, future: "asyncio.Future[RequestOutput]", token_ids: list[int], tokenization_time: float):
        self.future = future
        self.token_ids = token_ids
        self.tokenization_time = tokenization_time


class CoreClient:
    """`start()` it on the event loop that will call `encode`, `stop()` it when done."""

    def __init__(self, frontend: Frontend, address: str, max_concurrent_requests: int = 512, *,
                 tag: str = "", routing_id: bytes | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.frontend = frontend
        self.info: EngineInfo = frontend.info
        self.tokenizer = frontend.tokenizer
        self.input_processor = frontend.input_processor
        self.address = address
        self.max_concurrent_requests = max_concurrent_requests
        self.on_fatal = on_fatal
        self.active_calls = 0
        self.num_aborted = 0
        self.num_timed_out = 0
        self.num_restarts = 0
        """Restarts of the core's loop this API server saw fail its requests (the core's own count is a metric)."""
        self.error: BaseException | None = None
        self._tag = tag
        self.routing_id = routing_id
        """How the core names this client (unique per API-server process: the launcher names a dead one in
        `wire.Gone`); None: ZeroMQ picks one."""
        self._ids = itertools.count()
        self._waiting: dict[str, _Waiting] = {}
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wde-tokenize")
        self._image_pool: ThreadPoolExecutor | None = None
        """Calls holding images (started with the first one: text workflows never have it)."""
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        path = heartbeat_path(address)
        self._heartbeat = Heartbeat(path, writer=False) if path is not None else None

    def start(self) -> None:
        self._sock = socket(self.address, zmq.DEALER, bind=False, context=zmq.asyncio.Context.instance(),
                            routing_id=self.routing_id)
        monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._tasks = [asyncio.ensure_future(self._receive()), asyncio.ensure_future(self._watch(monitor))]

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        self._fail_all(EngineUnavailable("the server is shutting down"))
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self._tokenize_pool.shutdown(wait=False)
        if self._image_pool is not None:
            self._image_pool.shutdown(wait=False)
        if self._heartbeat is not None:
            self._heartbeat.close()

    @property
    def healthy(self) -> bool:
        return self._sock is not None and self.error is None

    @property
    def num_pending(self) -> int:
        return len(self._waiting)

    @property
    def seconds_since_step(self) -> float:
        """Seconds since the core's loop last finished a step or looked at an empty queue (its heartbeat): near 0
        unless a step is running or the core is stuck or frozen; 0 when the core publishes no heartbeat."""
        return self._heartbeat.age() if self._heartbeat is not None else 0.0

    @property
    def queue_depth(self) -> int:
        """Not known here: the core reports its queue as a metric."""
        return 0

    async def encode(self, inputs: Sequence[Any], params: PoolingParams | Sequence[PoolingParams],
                     fields: InputNames = "input", request_id: str | None = None,
                     timeout: float | None = None) -> list[RequestOutput]:
        """As `AsyncEngine.encode`: outputs in input order; `RequestError`, `EngineOverloaded`, `EngineUnavailable`
        (`EngineTimeout` after `timeout` seconds, tokenization on this side included)."""
        requests = admit(self, self.frontend.make_request, inputs, params, fields,
                         f"{request_id or 'srv'}.{self._tag}{next(self._ids)}")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        self.active_calls += 1
        outputs: list[RequestOutput | None] = [None] * len(requests)
        futures: list[tuple[int, asyncio.Future[RequestOutput]]] = []
        try:
            pool = self._pool_for(requests)
            if pool is not None:
                preparing = loop.run_in_executor(pool, _prepare, self.frontend, requests)
                tokenized, payloads = await await_within(preparing, _left(deadline, loop))
            else:
                tokenized, payloads = _prepare(self.frontend, requests)
            for i, (r, t) in enumerate(zip(requests, tokenized)):
                if isinstance(t, RequestError):
                    outputs[i] = RequestOutput(r.request_id, error=t, tokenization_time=r.tokenization_time)
                    continue
                future = loop.create_future()
                self._waiting[r.request_id] = _Waiting(future, t.token_ids, r.tokenization_time)
                futures.append((i, future))
            if futures:
                for payload in payloads:
                    await self._send_payload(payload)
                results = await await_within(asyncio.gather(*(f for _, f in futures)), _left(deadline, loop))
                for i, out in zip((i for i, _ in futures), results):
                    outputs[i] = out
            return outputs  # type: ignore[return-value]
        except BaseException as e:
            unfinished = [r.request_id for r in requests if _unfinished(self._waiting.get(r.request_id))]
            if unfinished and self.healthy:
                asyncio.ensure_future(self._send(wire.Abort(unfinished)))
            if isinstance(e, asyncio.CancelledError):
                self.num_aborted += len(unfinished)
            if isinstance(e, asyncio.TimeoutError):
                self.num_timed_out += 1
                raise timed_out(timeout) from None
            raise
        finally:
            self.active_calls -= 1
            for r in requests:
                self._waiting.pop(r.request_id, None)

    def _pool_for(self, requests: list[Request]) -> ThreadPoolExecutor | None:
        """Where these requests are tokenized: images on the image pool, a huge text on the tokenize thread, the
        rest inline (on the event loop: cheaper than a hop to a thread)."""
        if self.frontend.holds_images(requests):
            if self._image_pool is None:
                self._image_pool = ThreadPoolExecutor(self.frontend.image_workers, thread_name_prefix="wde-image-call")
            return self._image_pool
        return self._tokenize_pool if self.frontend.is_large(requests) else None

    async def _send(self, message: wire.Submit | wire.Abort) -> None:
        await self._send_payload(wire.encoder.encode(message))

    async def _send_payload(self, payload: bytes) -> None:
        if self._sock is None:
            raise EngineUnavailable("the server is shutting down")
        await self._sock.send(payload, copy=False)  # zero-copy past pyzmq's copy_threshold (images)

    async def _receive(self) -> None:
        assert self._sock is not None
        while True:
            results = wire.from_core.decode(await self._sock.recv())
            failure = EngineRestarted(results.failure) if results.failure else None
            if failure is not None:
                self.num_restarts += 1
            for out in results.outputs:
                waiting = self._waiting.get(out.request_id)
                if waiting is None or waiting.future.done():
                    continue
                if failure is not None:
                    waiting.future.set_exception(failure)
                    continue
                output = wire.unpack_output(out, waiting.token_ids)
                output.tokenization_time += waiting.tokenization_time
                waiting.future.set_result(output)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """The link to the core dropped: its process is gone (it never closes the link otherwise)."""
        try:
            while parse_monitor_message(await monitor.recv_multipart())["event"] != zmq.EVENT_DISCONNECTED:
                pass
        finally:
            monitor.close(0)
        if self._stopping:
            return
        self.error = EngineUnavailable("the engine core process exited; see the server log")
        log.critical("the engine core at %s went away; failing %d waiting requests", self.address,
                     len(self._waiting))
        self._fail_all(self.error)
        if self.on_fatal is not None:
            self.on_fatal(self.error)

    def _fail_all(self, failure: BaseException) -> None:
        for waiting in list(self._waiting.values()):
            if not waiting.future.done():
                waiting.future.set_exception(failure)


def _prepare(frontend: Frontend, requests: list[Request]) -> tuple[list[SchedulableRequest | RequestError],
                                                                    list[bytes]]:
    """Tokenize (and decode images), then encode what goes to the core: one result per request, and the messages
    that submit the admitted ones. Texts go in a `Submit` (the bytes they had before images existed), images in a
    `SubmitImages` with their pixel values as raw bytes; encoding a call's images (600 kB each at 224 px) happens
    here, on the pool thread that decoded them, not on the event loop."""
    tokenized = frontend.tokenize(requests)
    texts: list[wire.Admitted] = []
    images: list[wire.AdmittedImage] = []
    for r, t in zip(requests, tokenized):
        if isinstance(t, RequestError):
            continue
        if t.pixel_values is None:
            texts.append(wire.Admitted(r.request_id, t.token_ids, t.token_type_ids, r.params))
        else:
            images.append(wire.AdmittedImage(r.request_id, t.pixel_values, t.image_tokens, r.params))
    messages = ([wire.Submit(texts)] if texts else []) + ([wire.SubmitImages(images)] if images else [])
    return tokenized, [wire.encoder.encode(m) for m in messages]


def _left(deadline: float | None, loop: asyncio.AbstractEventLoop) -> float | None:
    return None if deadline is None else deadline - loop.time()


def _unfinished(waiting: _Waiting | None) -> bool:
    """Sent to the core and not answered (a cancelled `gather` cancels its futures: that is not an answer)."""
    return waiting is not None and (waiting.future.cancelled() or not waiting.future.done())
