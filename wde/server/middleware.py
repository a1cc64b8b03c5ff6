"""ASGI middleware: request ids, per-route request metrics, the browser-origin check (CORS), optional bearer-token
auth, the JSON content type, and the body-size limit (gzip bodies decoded under it).

Plain ASGI rather than Starlette's BaseHTTPMiddleware, so the handlers still see the client disconnect.

Why the origin and content-type checks: a web page the user visits can make the browser POST to a `wde serve` on
localhost. A "simple" cross-origin request (`text/plain`, form data, no custom header) needs no CORS preflight,
so the browser sends it, and a server that ignored the content type would do the work. So POST routes take only
JSON (415 otherwise), which a page can send cross-origin only after a preflight, and any request carrying an
`Origin` header (a browser's) is refused 403 unless `--allowed-origins` lists that origin; preflights are
answered for the listed origins only.
"""

from __future__ import annotations

import hmac
import json
import re
import time
import uuid
import zlib
from urllib.parse import urlsplit
from typing import Any, Awaitable, Callable

from wde.server.errors import TEI_PATHS, ApiError, error_body
from wde.server.metrics import ServerMetrics

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/ping"})
WEAVIATE_VECTORS_PATHS = frozenset({"/vectors", "/vectors/"})
"""Weaviate's text2vec-transformers POST routes (wde/server/weaviate_routes.py): Weaviate's client sends its body
without a Content-Type, so there a missing one is taken as JSON (`JsonContentTypeMiddleware`); and its errors
come in TEI's shape, whose `error` string that client reads."""
_SANE_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


async def send_error(send: Send, scope: Scope, error: ApiError, headers: list[tuple[bytes, bytes]] = ()) -> None:
    """Answer with `error` in the shape the path's clients expect, before any handler ran."""
    tei = scope["path"] in TEI_PATHS or scope["path"] in WEAVIATE_VECTORS_PATHS
    body = json.dumps(error_body(error, "tei" if tei else "openai")).encode()
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
    def __init__(self, decoded: bool = False) -> None:
        super().__init__()
        self.decoded = decoded


class _BadBody(Exception):
    """The body cannot be decoded (a corrupt or truncated gzip stream); carries the error to answer."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


GZIP_ENCODINGS = frozenset({"gzip", "x-gzip"})


class _GzipBody:
    """Decodes a gzip body as it streams in, never holding more than `limit` + 1 decoded bytes: a decompression
    bomb (a few KB that inflate to gigabytes) stops as soon as its decoded size passes the limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.decoded = 0
        self.seen = 0
        self._inflate = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)  # gzip framing only

    def feed(self, data: bytes, last: bool) -> bytes:
        out = []
        self.seen += len(data)
        while data:
            if self._inflate.eof:
                raise _BadBody(ApiError("bad_json", "the gzip request body has data after its end"))
            try:
                chunk = self._inflate.decompress(data, self.limit - self.decoded + 1)
            except zlib.error as e:
                raise _BadBody(ApiError("bad_json", f"the request body is not valid gzip ({e})")) from None
            self.decoded += len(chunk)
            if self.decoded > self.limit:
                raise _TooLarge(decoded=True)
            out.append(chunk)
            data = self._inflate.unconsumed_tail
        if self._inflate.eof and self._inflate.unused_data:
            raise _BadBody(ApiError("bad_json", "the gzip request body has data after its end"))
        if last and self.seen and not self._inflate.eof:
            raise _BadBody(ApiError("bad_json", "the gzip request body is truncated"))
        return b"".join(out)


class PayloadLimitMiddleware:
    """Refuses bodies over `limit` bytes with 413: at once from Content-Length, else while the body streams in.

    A `Content-Encoding: gzip` body is decoded as it streams in, and the limit applies to what it sent and to
    what it decodes to (413 as soon as either passes it; a corrupt or truncated stream is a 400); other
    encodings are 415 with `Accept-Encoding: gzip`.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _error(self, decoded_size: bool = False) -> ApiError:
        decoded = " once decoded (Content-Encoding: gzip)" if decoded_size else ""
        return ApiError("too_large", f"the request body is larger than the limit of {self.limit} bytes{decoded}"
                        " (wde serve --payload-limit)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await send_error(send, scope, ApiError("bad_json", "the Content-Length header is not a number"))
                return
            if int(declared) > self.limit:
                await send_error(send, scope, self._error())
                return
        encoding = headers.get(b"content-encoding", b"").decode("latin-1").strip().lower()
        gzip: _GzipBody | None = None
        if encoding in GZIP_ENCODINGS:
            gzip = _GzipBody(self.limit)
            dropped = (b"content-encoding", b"content-length")  # both describe the encoded body
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k.lower() not in dropped]}
        elif encoding not in ("", "identity"):
            error = ApiError("unsupported_media", f"Content-Encoding {encoding!r} is not supported: send the body"
                             " as it is, or gzip-compressed with Content-Encoding: gzip")
            await send_error(send, scope, error, [(b"accept-encoding", b"gzip")])
            return
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                body = message.get("body", b"")
                received += len(body)
                if received > self.limit:
                    raise _TooLarge()
                if gzip is not None:
                    message = {**message, "body": gzip.feed(body, last=not message.get("more_body", False))}
            return message

        tracked = TrackedSend(send)
        try:
            await self.app(scope, limited_receive, tracked)
        except _TooLarge as e:
            if not tracked.started:
                await send_error(send, scope, self._error(e.decoded))
        except _BadBody as e:
            if not tracked.started:
                await send_error(send, scope, e.error)


class TrackedSend:
    """An ASGI `send` that remembers whether the response has started: a middleware that fails the request after
    the app began answering must not send a second response."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False

    async def __call__(self, message: dict) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self.send(message)


JSON_TYPE = "application/json"


def json_content_problem(content_type: bytes | None) -> str | None:
    """Why a request's Content-Type is not JSON, or None when it is: `application/json` or `application/*+json`,
    with no charset or a UTF-8 one (JSON is UTF-8, RFC 8259)."""
    if content_type is None or not content_type.strip():
        return f"the request has no Content-Type: send Content-Type: {JSON_TYPE} with a JSON body"
    text = content_type.decode("latin-1")
    media, *params = (part.strip() for part in text.split(";"))
    kind, _, subtype = media.lower().partition("/")
    if kind != "application" or not (subtype == "json" or subtype.endswith("+json")):
        return f"Content-Type {text!r} is not JSON: send Content-Type: {JSON_TYPE} with a JSON body"
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            return f"Content-Type {text!r}: JSON bodies are UTF-8; send charset=utf-8 or no charset"
    return None


class JsonContentTypeMiddleware:
    """POST routes (`paths`) take JSON only: another Content-Type, or none, is 415 before the body is read.

    Without this a web page could make a browser POST `text/plain` or form data to the server, a cross-origin
    request that needs no CORS preflight.

    One exception, for Weaviate, whose client sends no Content-Type: a POST to `WEAVIATE_VECTORS_PATHS` without
    the header is read as JSON (a wrong one is still 415). A page can send a body without a type (a Blob), but a
    browser's fetch carries `Origin`, which `OriginMiddleware` refuses before this check unless allowed."""

    def __init__(self, app: ASGIApp, paths: frozenset[str]) -> None:
        self.app = app
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        content_type = dict(scope["headers"]).get(b"content-type")
        problem = json_content_problem(content_type)
        if problem is None or content_type is None and scope["path"] in WEAVIATE_VECTORS_PATHS:
            await self.app(scope, receive, send)
            return
        await send_error(send, scope, ApiError("unsupported_media", problem), [(b"accept-post", JSON_TYPE.encode())])


def normalize_origin(origin: str) -> str:
    """`scheme://host[:port]` as browsers send it in `Origin` (lower case, no path, no trailing slash), or `*`;
    anything else raises ValueError naming it."""
    text = origin.strip()
    if text == "*":
        return text
    parts = urlsplit(text.rstrip("/"))
    try:
        parts.port  # noqa: B018 - validates the port
    except ValueError:
        parts = None  # type: ignore[assignment]
    if (parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query
            or parts.fragment or parts.username or parts.password):
        raise ValueError(f"allowed origin {origin!r} is not an origin: give scheme://host[:port] (e.g."
                         " https://app.example.com or http://localhost:3000), or * for any")
    default = {"http": 80, "https": 443}[parts.scheme]
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    port = f":{parts.port}" if parts.port is not None and parts.port != default else ""
    return f"{parts.scheme}://{host}{port}"  # as browsers send it: no default port


_CORS_METHODS = b"GET, POST, OPTIONS"
_CORS_MAX_AGE = b"600"


class OriginMiddleware:
    """Requests from web pages: a request with an `Origin` header (browsers send it on cross-origin requests and
    on POSTs) is refused 403 unless its origin is in `allowed` (`*`: any). For an allowed origin a CORS preflight
    (`OPTIONS` with `Access-Control-Request-Method`) is answered 204 with the CORS headers, and every response
    carries `Access-Control-Allow-Origin`, so the page can read it. Requests without `Origin` (curl, SDKs,
    servers) pass untouched."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...] = ()) -> None:
        self.app = app
        self.any = "*" in allowed
        self.allowed = frozenset(allowed)

    def allows(self, origin: str) -> bool:
        if origin.lower() == "null":  # sandboxed frames, file:// pages: nobody can be told apart
            return False
        return self.any or origin.lower().rstrip("/") in self.allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        raw = headers.get(b"origin")
        if raw is None:
            await self.app(scope, receive, send)
            return
        origin = raw.decode("latin-1")
        preflight = scope["method"] == "OPTIONS" and b"access-control-request-method" in headers
        if not self.allows(origin):
            what = "CORS preflight" if preflight else "request"
            error = ApiError("forbidden", f"{what} from a web page refused: origin {origin!r} is not allowed to call"
                             " this server (wde serve --allowed-origins)")
            await send_error(send, scope, error, [(b"vary", b"origin")])
            return
        cors = [(b"access-control-allow-origin", raw), (b"vary", b"origin")]
        if preflight:
            asked = headers.get(b"access-control-request-headers")
            await send({"type": "http.response.start", "status": 204, "headers": [
                *cors, (b"access-control-allow-methods", _CORS_METHODS),
                *([(b"access-control-allow-headers", asked)] if asked else []),
                (b"access-control-max-age", _CORS_MAX_AGE)]})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_cors(message: dict) -> None:
            if message["type"] == "http.response.start":
                kept = [h for h in message.get("headers", []) if h[0].lower() != b"access-control-allow-origin"]
                message = {**message, "headers": [*kept, *cors, (b"access-control-expose-headers", b"*")]}
            await send(message)

        await self.app(scope, receive, send_with_cors)


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
