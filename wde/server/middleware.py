"""ASGI middleware: optional bearer-token auth and per-route request metrics.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, so the handlers still see the client disconnect.
"""

from __future__ import annotations

import hmac
import json
import time
from typing import Any, Awaitable, Callable

from wde.server.errors import TEI_PATHS, ApiError, error_body
from wde.server.metrics import ServerMetrics

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})


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
        body = json.dumps(error_body(error, "tei" if scope["path"] in TEI_PATHS else "openai")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


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
