"""Slow and abandoned clients: a header-read timeout, a body-read timeout, and hang-ups counted as 499 in one line.

uvicorn has no header-read timeout. Its `timeout_keep_alive` closes a connection idle *between* requests, and
any byte received cancels it; h11 bounds the size of a header block, not the time it takes. So a client that
connects and sends nothing, or sends a request's headers a byte at a time (slowloris), holds its connection for
ever. Two pieces close the gap, each at the level that can see it:

- `slow_client_protocol` subclasses the HTTP protocol class uvicorn would use (`http="auto"`: h11, or
  httptools when installed; both start a new request cycle, `self.cycle`, once a request's headers are parsed).
  A timer is armed when a connection opens and when the first bytes of a next request arrive on a kept-alive
  one, and disarmed when a new cycle starts. On expiry the connection gets a 408 (when what it sent looks like
  the start of a request; a connection that sent nothing is just closed) and is closed: half-closed first, what
  the client still sends dropped for `LINGER_S`, so a client trickling bytes reads the 408 rather than a reset.
  This is below the ASGI app, so the metrics count it through a callback
  (`wde_requests_total{route="other",status="408"}`).
- `BodyTimeoutMiddleware` (ASGI) gives a request's body `body_timeout` seconds from its headers: `receive()`
  waits at most the time left, then the request is answered 408 in its route's error shape with `Connection:
  close`; uvicorn closes the connection after it, and the protocol makes that close linger too (the middleware
  marks the request, `LINGER`). A body nobody reads (the answer came first, e.g. a 413) is bounded by the
  protocol: bytes trickling in after the answer re-arm the header timer, and uvicorn's keep-alive timer covers
  silence.

`client_gone` answers a client that hung up, mid-body (Starlette's `ClientDisconnect`) or while its answer was
computed (`ClientDisconnected`, its inputs already aborted in the engine): 499 (nginx's "client closed request")
in the metrics and one INFO line in the log, never a 500 and a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import TYPE_CHECKING, Callable

from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from wde.server.errors import TEI_PATHS, ApiError, error_body, request_id
from wde.server.middleware import ASGIApp, Receive, Scope, Send, TrackedSend, send_error

if TYPE_CHECKING:
    from wde.server.config import ServerConfig
    from wde.server.metrics import ServerMetrics

log = logging.getLogger("wde.server")

_REQUEST_LINE = re.compile(rb"[A-Z]{3,10} (/[^ ?\r\n]*)")
"""The start of a request line (method and path) in what a slow connection has sent so far."""
_HEAD_KEPT = 1024
"""Bytes of a pending request head kept to name its path in the 408 (the path decides the error shape)."""
LINGER_S = 2.0
"""After a header-timeout 408 the connection is half-closed and what the client still sends is read and dropped for
this long, so a client that keeps trickling bytes reads the 408 instead of a reset (nginx's lingering close)."""


def header_message(timeout: float) -> str:
    return f"the request headers did not arrive within {timeout:g} s (wde serve --header-timeout)"


def body_message(timeout: float) -> str:
    return f"the request body did not arrive within {timeout:g} s of its headers (wde serve --body-timeout)"


LINGER = "wde.linger"
"""Set in a request's `scope["state"]` by a handler whose answer should end in a lingering close (a 408)."""


class _LingeringTransport:
    """The transport uvicorn's protocol writes to and closes: `close()` half-closes it instead, and closes it
    `LINGER_S` later (or when the client does), when the protocol asks for it (`lingers()`)."""

    def __init__(self, transport: asyncio.Transport, lingers: Callable[[], bool],
                 loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._lingers = lingers
        self._loop = loop
        self.lingering = False

    def __getattr__(self, name: str) -> object:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.is_closing():
            return
        if self._lingers() and self._transport.can_write_eof():
            self.lingering = True
            self._transport.write_eof()
            self._loop.call_later(LINGER_S, self._transport.close)
        else:
            self._transport.close()


def slow_client_protocol(header_timeout: float, on_timeout: Callable[[], None] | None = None,
                         base: type[asyncio.Protocol] | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (`base`, default the one `http="auto"` picks) with a header-read timeout of
    `header_timeout` seconds (0: none) and a lingering close after a 408; `on_timeout` is called for each
    connection the header timeout closes."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol

    class SlowClientProtocol(base):  # type: ignore[valid-type, misc]
        _header_timer: asyncio.TimerHandle | None = None
        _armed_cycle: object = None
        _head = b""
        _linger = False

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(_LingeringTransport(transport, self._lingers, self.loop))  # type: ignore[arg-type]
            if header_timeout:
                self._arm()

        def data_received(self, data: bytes) -> None:
            if self.transport.lingering:
                return  # answered and half-closed: what still trickles in is read and dropped
            if header_timeout and self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the first bytes of a next request on a kept-alive connection
            if self._header_timer is not None and len(self._head) < _HEAD_KEPT:
                self._head += data[:_HEAD_KEPT]
            super().data_received(data)
            if self._header_timer is not None and self.cycle is not self._armed_cycle:
                self._disarm()  # a new request cycle: its headers are in

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _lingers(self) -> bool:
            return self._linger or bool(self.scope and self.scope.get("state", {}).get(LINGER))

        def _arm(self) -> None:
            self._armed_cycle = self.cycle
            self._head = b""
            self._header_timer = self.loop.call_later(header_timeout, self._expired)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            self._head = b""

        def _expired(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.cycle is not self._armed_cycle:
                return
            started = _REQUEST_LINE.match(self._head)
            self._head = b""
            if started is not None:
                path = started.group(1).decode("latin-1")
                body = json.dumps(error_body(ApiError("client_timeout", header_message(header_timeout)),
                                             "tei" if path in TEI_PATHS else "openai")).encode()
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                     b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
                self._linger = True
            self.transport.close()
            if on_timeout is not None:
                try:
                    on_timeout()
                except Exception:  # noqa: BLE001 - a metrics failure must not break the event loop's callback
                    log.exception("the header-timeout callback failed")

    SlowClientProtocol.__name__ = SlowClientProtocol.__qualname__ = f"SlowClient{base.__name__}"
    return SlowClientProtocol


def http_protocol(config: ServerConfig, metrics: ServerMetrics) -> type[asyncio.Protocol]:
    """The `http` argument of `uvicorn.Config` for `wde serve`: uvicorn's protocol with `config.header_timeout`,
    each connection it closes counted as a 408 of route "other"."""
    return slow_client_protocol(config.header_timeout,
                                lambda: metrics.on_request("other", 408, config.header_timeout))


class BodyTimeout(Exception):
    """The request body did not arrive in time (raised from `receive` inside the app)."""


class BodyTimeoutMiddleware:
    """Answers 408 (and closes the connection) when a request's body has not arrived `timeout` seconds after its
    headers; 0: no limit. Waiting for the client to go away after the body (as `Service.run` does) is not timed."""

    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.timeout:
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        body_done = False

        async def timed_receive() -> dict:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise BodyTimeout() from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        tracked = TrackedSend(send)
        try:
            await self.app(scope, timed_receive, tracked)
        except BodyTimeout:
            log.info("%s %s (request id %s): %s; answered 408 and closed the connection", scope.get("method"),
                     scope.get("path"), scope.get("state", {}).get("request_id", "-"), body_message(self.timeout))
            if not tracked.started:
                scope.setdefault("state", {})[LINGER] = True  # the client may still be sending: let it read the 408
                await send_error(send, scope, ApiError("client_timeout", body_message(self.timeout)),
                                 [(b"connection", b"close")])


async def client_gone(request: Request, exc: Exception) -> Response:
    """A client hung up before its answer: nobody reads this one. 499 keeps it apart in the metrics (it is not
    our failure), and one log line says what happened."""
    when = "while sending its body" if isinstance(exc, ClientDisconnect) else "before its answer was ready"
    log.info("%s %s (request id %s): the client closed the connection %s (499)", request.method, request.url.path,
             request_id(request), when)
    return Response(status_code=499)

