"""An API server's handle on an engine core in another process: the serving front end (wde/serving.py) over
`ZmqCore`, the ZeroMQ transport.

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
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from wde.core import wire
from wde.core.engine_core import socket
from wde.core.frontend import Frontend
from wde.core.heartbeat import Heartbeat, heartbeat_path
from wde.errors import RequestError
from wde.request import Request, RequestOutput, SchedulableRequest
from wde.serving import Admitted, EngineRestarted, EngineUnavailable, ServingFrontEnd, await_within

log = logging.getLogger("wde.core")


class ZmqCore:
    """The transport to an engine core process: requests are validated and tokenized on this side (`Frontend`),
    sent as token ids (images as pixel values) over a DEALER socket, and answered by a receiver task; a socket
    monitor reports the core's exit."""

    def __init__(self, frontend: Frontend, address: str, *, routing_id: bytes | None = None) -> None:
        self.frontend = frontend
        self.info = frontend.info
        self.source = frontend.source
        self.tokenizer = frontend.tokenizer
        self.input_processor = frontend.input_processor
        self.make_request = frontend.make_request
        self.address = address
        self.routing_id = routing_id
        """How the core names this client (unique per API-server process: the launcher names a dead one in
        `wire.Gone`); None: ZeroMQ picks one."""
        self.num_restarts = 0
        """Restarts of the core's loop this API server saw fail its requests (the core's own count is a metric)."""
        self._front: ServingFrontEnd | None = None
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wde-tokenize")
        self._image_pool: ThreadPoolExecutor | None = None
        """Calls holding images (started with the first one: text workflows never have it)."""
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        path = heartbeat_path(address)
        self._heartbeat = Heartbeat(path, writer=False) if path is not None else None

    @property
    def running(self) -> bool:
        return self._sock is not None

    @property
    def seconds_since_step(self) -> float:
        """Seconds since the core's loop last finished a step or looked at an empty queue (its heartbeat): near 0
        unless a step is running or the core is stuck or frozen; 0 when the core publishes no heartbeat."""
        return self._heartbeat.age() if self._heartbeat is not None else 0.0

    @property
    def queue_depth(self) -> int:
        """Not known here: the core reports its queue as a metric."""
        return 0

    def start(self, front: ServingFrontEnd) -> None:
        self._front = front
        self._sock = socket(self.address, zmq.DEALER, bind=False, context=zmq.asyncio.Context.instance(),
                            routing_id=self.routing_id)
        monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._tasks = [asyncio.ensure_future(self._receive()), asyncio.ensure_future(self._watch(monitor))]

    def stop(self, timeout: float) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self._tokenize_pool.shutdown(wait=False)
        if self._image_pool is not None:
            self._image_pool.shutdown(wait=False)
        if self._heartbeat is not None:
            self._heartbeat.close()

    async def prepare(self, requests: list[Request], timeout: float | None) -> tuple[list[Any], list[bytes]]:
        """Tokenize (and decode images) on this side: on the image pool, on the tokenize thread for a huge text, or
        inline (cheaper than a hop to a thread); the messages that submit the admitted requests."""
        pool = self._pool_for(requests)
        if pool is not None:
            preparing = asyncio.get_running_loop().run_in_executor(pool, _prepare, self.frontend, requests)
            tokenized, payloads = await await_within(preparing, timeout)
        else:
            tokenized, payloads = _prepare(self.frontend, requests)
        entries: list[Any] = []
        for r, t in zip(requests, tokenized):
            if isinstance(t, RequestError):
                entries.append(RequestOutput(r.request_id, error=t, tokenization_time=r.tokenization_time))
            else:
                entries.append(Admitted(r.request_id, t.token_ids, r.tokenization_time))
        return entries, payloads

    def submit(self, submission: list[bytes]) -> None:
        """Nothing to queue here: `send` delivers."""

    async def send(self, submission: list[bytes]) -> None:
        for payload in submission:
            await self._send_payload(payload)

    def abort(self, request_ids: list[str]) -> None:
        if self._sock is not None and self._front is not None and self._front.error is None:
            asyncio.ensure_future(self._send_payload(wire.encoder.encode(wire.Abort(request_ids))))

    def reset(self) -> None:
        """The core resets its own queues (it reports a restart in its results)."""

    def _pool_for(self, requests: list[Request]) -> ThreadPoolExecutor | None:
        if self.frontend.holds_images(requests):
            if self._image_pool is None:
                self._image_pool = ThreadPoolExecutor(self.frontend.image_workers, thread_name_prefix="wde-image-call")
            return self._image_pool
        return self._tokenize_pool if self.frontend.is_large(requests) else None

    async def _send_payload(self, payload: bytes) -> None:
        if self._sock is None:
            raise EngineUnavailable("the server is shutting down")
        await self._sock.send(payload, copy=False)  # zero-copy past pyzmq's copy_threshold (images)

    async def _receive(self) -> None:
        assert self._sock is not None and self._front is not None
        while True:
            results = wire.from_core.decode(await self._sock.recv())
            if results.failure:
                self.num_restarts += 1
                failure = EngineRestarted(results.failure)
                self._front.resolve([(out.request_id, failure) for out in results.outputs])
                continue
            self._front.resolve([(out.request_id, _completing(out)) for out in results.outputs])

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """The link to the core dropped: its process is gone (it never closes the link otherwise)."""
        try:
            while parse_monitor_message(await monitor.recv_multipart())["event"] != zmq.EVENT_DISCONNECTED:
                pass
        finally:
            monitor.close(0)
        if self._stopping or self._front is None:
            return
        error = EngineUnavailable("the engine core process exited; see the server log")
        log.critical("the engine core at %s went away; failing %d waiting requests", self.address,
                     self._front.num_pending)
        self._front.fatal(error, error)


class CoreClient(ServingFrontEnd):
    """The serving front end over an engine core process. `start()` it on the event loop that will call `encode`,
    `stop()` it when done."""

    def __init__(self, frontend: Frontend, address: str, max_concurrent_requests: int = 512, *,
                 tag: str = "", routing_id: bytes | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        core = ZmqCore(frontend, address, routing_id=routing_id)
        super().__init__(core, max_concurrent_requests, tag=tag, on_fatal=on_fatal)
        self.core: ZmqCore = core
        self.frontend = frontend
        self.address = address
        self.routing_id = routing_id


def _completing(out: Any) -> Callable[[Admitted], RequestOutput]:
    """The output of a core's answer, completed with what this side knows of its request (token ids, time)."""
    def complete(admitted: Admitted) -> RequestOutput:
        output = wire.unpack_output(out, admitted.token_ids)
        output.tokenization_time += admitted.tokenization_time
        return output
    return complete


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
