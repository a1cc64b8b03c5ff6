"""ASGI middleware: request ids, the body-size limit, optional bearer-token auth and per-route request metrics.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, so the handlers still see the client disconnect.
"""

from __future__ import annotations

import hmac
import json
import re
import time
import uuid
from typing import Any, Awaitable, Callable

from wde.server.errors import TEI_PATHS, ApiError, error_body
from wde.server.metrics import ServerMetrics

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/ping"})
_SANE_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


async def send_error(send: Send, scope: Scope, error: ApiError, headers: list[tuple[bytes, bytes]] = ()) -> None:
    """Answer with `error` in the shape the path's clients expect, before any handler ran."""
    body = json.dumps(error_body(error, "tei" if scope["path"] in TEI_PATHS else "openai")).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), *headers]})
    await send({"type": "http.response.body", "body": body})


class RequestIdMiddleware:
    """Gives every request an id, the client's `x-request-id` when it sends a sane one, and echoes it in the
    response's `x-request-id` header; error messages and the log name requests by it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _SANE_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class _TooLarge(Exception):
    pass


class PayloadLimitMiddleware:
    """Refuses bodies over `limit` bytes with 413: at once from Content-Length, else while the body streams in."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _error(self) -> ApiError:
        return ApiError("too_large", f"the request body is larger than the limit of {self.limit} bytes"
                        " (wde serve --payload-limit)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await send_error(send, scope, ApiError("bad_json", "the Content-Length header is not a number"))
                return
            if int(declared) > self.limit:
                await send_error(send, scope, self._error())
                return
        received = 0
        started = False

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise _TooLarge()
            return message

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await send_error(send, scope, self._error())


class ApiKeyMiddleware:
    """Requires `Authorization: Bearer KEY` on every route but /health."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        error = ApiError("unauthorized", "missing or invalid API key: send 'Authorization: Bearer <key>'")
        await send_error(send, scope, error, [(b"www-authenticate", b"Bearer")])


class MetricsMiddleware:
    """Counts requests by route and status and times them; unknown paths share one label."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: frozenset[str]) -> None:
        self.app = app
        self._metrics = metrics
        self._routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope["path"] if scope["path"] in self._routes else "other"
            self._metrics.on_request(route, status, time.perf_counter() - start)
