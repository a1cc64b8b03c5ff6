"""Fetching image URLs for an image-text model, only from the hosts `wde serve --allow-image-fetch` names.

Off by default: a server that fetches whatever URL a request names can be made to reach services only it can see
(server-side request forgery), so an image URL is refused unless its host is listed. When it is, the fetch is
held to the same limits as an image sent inline: http or https only; no connection to a host outside the list,
ever (a redirect is followed only to a listed host, checked before connecting, and proxies from the environment
are not used, as they are other hosts); the body is read as it streams and refused (413) as soon as it passes
`max_image_bytes`, never buffered beyond it; compressed bodies are not asked for (an encoded body is refused, so a
small gzip stream cannot decode to gigabytes); and the whole fetch, redirects included, must finish within the
timeout. It runs on the event loop (httpx's async transport), so a slow host holds no thread.

A small body can name many URLs, so what one request may make the server spend is bounded before it is spent
(`FetchLimits`): the number of URLs is checked before the first connection; the bytes all of a request's fetches
bring in are counted as they stream and the request refused (413) when they pass a total, so a request never
holds more than that total of fetched bytes; one deadline covers all of a request's fetches; at most 8 of them run
at once, and all requests together hold at most `connections` connections (slots shared by the process, each held
from before a fetch connects until its connection is closed; no keep-alive, so a finished fetch leaves no idle
socket behind; each request's connection pool closed when its fetching ends, so a fetch cancelled halfway, whose
connection httpcore may not give back, leaves nothing open either), so file descriptors cannot run out however
many requests fetch at once. A URL or redirect `Location` that is not plainly well formed (a backslash, which
browsers read as a slash and httpx as a path character; a space or control character; a port outside 1-65535; a
host that is not a host name or IP address) is refused by name with a 400 before anything connects.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import re
import ssl
from dataclasses import dataclass
from typing import Sequence

import httpx

from wde.server.errors import ApiError

MAX_REDIRECTS = 3
CONCURRENT_FETCHES = 8
"""Fetches one request runs at once."""

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_HEADERS = {"accept": "image/*", "accept-encoding": "identity", "user-agent": "wde-image-fetch"}
"""Images only, as they are (a compressed body is refused), and a name: some image hosts refuse a request without
a User-Agent."""
_HOST_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*\.?")
"""A DNS name as it goes on the wire (IDNA already applied): labels of letters, digits, hyphens, underscores."""


@dataclass(frozen=True)
class FetchLimits:
    """What the image URLs of one request may make the server spend, and what all requests together may."""

    image_bytes: int
    """One image's bytes (the engine's `input_processor.params.max_image_bytes`)."""
    timeout: float = 10.0
    """Seconds one fetch may take, redirects included, once it has a connection slot (--image-fetch-timeout)."""
    max_urls: int = 64
    """Image URLs one request may name (--image-fetch-max-urls); checked before the first fetch."""
    total_bytes: int = 32 * 2**20
    """Bytes all the fetches of one request may bring in together (--image-fetch-max-bytes)."""
    deadline: float = 30.0
    """Seconds all the fetches of one request may take together, waiting for a connection included
    (--image-fetch-deadline)."""
    connections: int = 32
    """Connections the whole process holds for fetching at once (--image-fetch-connections)."""


class ImageFetcher:
    """GETs image URLs whose host is in `hosts`, within `limits`; every refusal is an `ApiError` naming the
    input's field."""

    def __init__(self, hosts: Sequence[str], limits: FetchLimits) -> None:
        self.hosts = frozenset(hosts)
        self.limits = limits
        self._shared: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    def check_count(self, count: int, field: str) -> None:
        """The 422 for a request naming more image URLs than `max_urls` (before any is fetched)."""
        if count > self.limits.max_urls:
            raise ApiError("validation", f"{field} names {count} image URLs; a request may name at most"
                           f" {self.limits.max_urls} (wde serve --image-fetch-max-urls): send fewer per request, or"
                           " the images as data:image/...;base64,... URIs", field)

    def check(self, url: str, field: str, redirected_from: str | None = None) -> httpx.URL:
        """The URL parsed, if it may be fetched: well formed, http(s) and a listed host; else the 400 saying why."""
        via = f" (redirected from {_short(redirected_from)})" if redirected_from else ""

        def bad(why: str) -> ApiError:
            return ApiError("bad_image", f"{field}: {_short(url)}{via} is not a valid URL: {why}", field)

        if not isinstance(url, str):
            raise ApiError("bad_image", f"{field}: the image URL is a {type(url).__name__}, not a string", field)
        odd = _odd_char(url)
        if odd is not None:
            raise bad(f"it holds {odd!r} at position {url.index(odd)} (a URL has no backslashes, spaces or control"
                      " characters; percent-encode them)")
        try:
            parsed = httpx.URL(url)
            host, port = parsed.raw_host.decode("ascii").lower(), parsed.port
            listed = parsed.host.lower().rstrip(".")  # decodes IDNA, which can fail
        except (httpx.InvalidURL, TypeError, ValueError) as e:  # UnicodeError (IDNA) is a ValueError
            raise bad(str(e)) from None
        if parsed.scheme not in ("http", "https"):
            raise ApiError("bad_image", f"{field}: {_short(url)}{via} is not an http(s) URL; images are fetched over"
                           " http and https only", field)
        if not host:
            raise bad("it has no host")
        if ":" in host:
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                raise bad(f"its host {host!r} is not an IPv6 address") from None
        elif not _HOST_NAME.fullmatch(host):
            raise bad(f"its host {host!r} is not a host name or IP address")
        if port is not None and not 0 < port < 65536:
            raise bad(f"its port {port} is not between 1 and 65535")
        if listed not in self.hosts:
            raise ApiError("bad_image", f"{field}: {_short(url)}{via} is on host {listed!r}, which is not one this"
                           " server fetches images from (wde serve --allow-image-fetch; the list is not shown to"
                           " clients); send the image as a data:image/...;base64,... URI", field)
        return parsed

    def vet(self, urls: Sequence[str], fields: Sequence[str], where: str) -> None:
        """Refuse a request's URLs before anything connects: too many of them (named by `where`, the request's
        field of images), or any one malformed or off the host list."""
        self.check_count(len(urls), where)
        for url, field in zip(urls, fields):
            self.check(url, field)

    async def fetch_all(self, urls: Sequence[str], fields: Sequence[str], where: str) -> list[bytes]:
        """The bodies of `urls`, fetched at once (up to `CONCURRENT_FETCHES`), within the request's limits; the
        first refusal cancels the rest. `where` names the request's field of images in the refusals about all
        of them (the deadline). The caller has `vet`ted them first, before taking a request slot."""
        slots = self._slots()
        at_once = min(CONCURRENT_FETCHES, self.limits.connections)
        gate = asyncio.Semaphore(at_once)
        budget = _Budget(self.limits.total_bytes)
        transport = httpx.AsyncHTTPTransport(verify=_tls(), trust_env=False, limits=httpx.Limits(
            max_connections=at_once, max_keepalive_connections=0))

        async def one(url: str, field: str) -> bytes:
            async with gate, slots:
                return await self.fetch(transport, url, field, budget)

        try:
            async with asyncio.timeout(self.limits.deadline):
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(one(u, f)) for u, f in zip(urls, fields)]
        except TimeoutError:
            raise ApiError("bad_image", f"{where}: fetching the request's {len(urls)} image URL(s) took longer than"
                           f" {self.limits.deadline:g} s in all (wde serve --image-fetch-deadline)", where) from None
        except BaseExceptionGroup as failed:
            raise _first(failed) from None
        finally:  # every connection of the request closed, even one a cancelled fetch left behind
            await asyncio.shield(transport.aclose())
        return [t.result() for t in tasks]

    async def fetch(self, transport: httpx.AsyncBaseTransport, url: str, field: str, budget: "_Budget") -> bytes:
        """One image, within the timeout, the byte limits and the host list (redirects included)."""
        try:
            async with asyncio.timeout(self.limits.timeout):
                return await self._follow(transport, url, field, budget)
        except (TimeoutError, httpx.TimeoutException):
            raise ApiError("bad_image", f"{field}: fetching {_short(url)} took longer than {self.limits.timeout:g}"
                           " s (wde serve --image-fetch-timeout)", field) from None
        except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError) as e:  # what a host or network can do
            raise ApiError("bad_image", f"{field}: cannot fetch {_short(url)}: {type(e).__name__}: {e}",
                           field) from None

    async def _follow(self, transport: httpx.AsyncBaseTransport, url: str, field: str, budget: "_Budget") -> bytes:
        """GET `url` on the transport itself, not through an `httpx.AsyncClient`: a client parses a redirect's
        `Location` as soon as the response arrives, even when it does not follow it, and fails there in its own
        ways (an `InvalidURL` that is no `HTTPError`), before this fetcher can vet it."""
        current = self.check(url, field)
        for _ in range(MAX_REDIRECTS + 1):
            request = httpx.Request("GET", current, headers=_HEADERS)
            response = await transport.handle_async_request(request)
            try:
                locations = response.headers.get_list("location")
                if response.status_code in _REDIRECTS and locations:
                    current = self._redirect(current, locations, field)
                    continue
                return await self._body(response, url, field, budget)
            finally:  # to its end even when the fetch is cancelled: httpcore gives the pool's place back only then
                await asyncio.shield(response.aclose())
        raise ApiError("bad_image", f"{field}: {_short(url)} redirects more than {MAX_REDIRECTS} times", field)

    def _redirect(self, current: httpx.URL, locations: list[str], field: str) -> httpx.URL:
        """Where a redirect from `current` leads, checked as a URL of the request's own would be."""
        if len(locations) > 1:
            raise ApiError("bad_image", f"{field}: {_short(str(current))} redirects with {len(locations)} Location"
                           " headers; a redirect names one", field)
        location = locations[0].strip()
        self.check_location(location, str(current), field)
        try:
            target = str(current.join(location))
        except (httpx.InvalidURL, TypeError, ValueError) as e:
            raise ApiError("bad_image", f"{field}: the redirect from {_short(str(current))} has Location"
                           f" {_short(location)!r}, which is not a valid URL: {e}", field) from None
        return self.check(target, field, redirected_from=str(current))

    @staticmethod
    def check_location(location: str, source: str, field: str) -> None:
        """The 400 for a `Location` that readers disagree on before it is resolved (`\\evil.com` is a path to
        httpx and another host to a browser): backslashes, spaces and control characters are refused."""
        odd = _odd_char(location)
        if odd is not None or not location:
            why = "it is empty" if odd is None else f"it holds {odd!r} at position {location.index(odd)}"
            raise ApiError("bad_image", f"{field}: the redirect from {_short(source)} has Location"
                           f" {_short(location)!r}, which is not a valid URL: {why}", field)

    async def _body(self, response: httpx.Response, url: str, field: str, budget: "_Budget") -> bytes:
        if response.status_code != 200:
            raise ApiError("bad_image", f"{field}: fetching {_short(url)} was answered {response.status_code}"
                           f" {response.reason_phrase}".rstrip(), field)
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise ApiError("bad_image", f"{field}: {_short(url)} was sent with Content-Encoding {encoding!r}, which"
                           " was not asked for; image files are fetched as they are", field)
        declared = response.headers.get("content-length", "").strip()
        if declared.isdigit():
            if int(declared) > self.limits.image_bytes:
                raise self._too_large(url, field, f"{int(declared)} bytes (its Content-Length)")
            budget.check(int(declared), url, field)
        chunks, size = [], 0
        async for chunk in response.aiter_raw():
            size += len(chunk)
            if size > self.limits.image_bytes:
                raise self._too_large(url, field, f"over {self.limits.image_bytes} bytes")
            budget.take(len(chunk), url, field)
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self, url: str, field: str, size: str) -> ApiError:
        return ApiError("image_too_large", f"{field}: {_short(url)} is {size}; the image size limit is"
                        f" {self.limits.image_bytes} bytes (input_processor.params.max_image_bytes)", field)

    def _slots(self) -> asyncio.Semaphore:
        """The connection slots all requests share, `connections` of them: a fetch holds one from before it
        connects until its connection is closed. One set per event loop (one loop per process when serving; a
        test that serves the same app on a new loop gets new ones, as asyncio objects belong to one loop)."""
        loop = asyncio.get_running_loop()
        if self._shared is None or self._shared[0] is not loop:
            self._shared = (loop, asyncio.Semaphore(self.limits.connections))
        return self._shared[1]


@functools.cache
def _tls() -> ssl.SSLContext:
    """The TLS settings of every fetch (the system's CA certificates as httpx reads them, not the environment's),
    made once: each request's transport would otherwise load the certificates again."""
    return httpx.create_ssl_context(trust_env=False)


class _Budget:
    """The bytes all the fetches of one request have brought in, refused (413) as they pass `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def check(self, size: int, url: str, field: str) -> None:
        """Refuse a body whose Content-Length alone would pass what is left, before reading it."""
        if self.used + size > self.limit:
            raise self._error(url, field, f"{size} bytes (its Content-Length) would bring the request's fetched"
                              f" images to {self.used + size} bytes")

    def take(self, size: int, url: str, field: str) -> None:
        self.used += size
        if self.used > self.limit:
            raise self._error(url, field, "brings the request's fetched images over it")

    def _error(self, url: str, field: str, what: str) -> ApiError:
        return ApiError("image_too_large", f"{field}: {_short(url)}: {what}; the images one request fetches may"
                        f" total {self.limit} bytes (wde serve --image-fetch-max-bytes)", field)


def _first(group: BaseExceptionGroup) -> BaseException:
    """The first refusal in a task group's failures (an `ApiError` when there is one)."""
    leaves: list[BaseException] = []

    def walk(error: BaseException) -> None:
        if isinstance(error, BaseExceptionGroup):
            for inner in error.exceptions:
                walk(inner)
        else:
            leaves.append(error)

    walk(group)
    return next((e for e in leaves if isinstance(e, ApiError)), leaves[0])


def _odd_char(url: str) -> str | None:
    """The first character no URL or `Location` may hold as is (readers disagree on them: `\\evil.com` is a path
    to httpx and another host to a browser): a backslash, white space or a control character; None if none."""
    return next((c for c in url if c == "\\" or c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F), None)


def _short(url: str, at_most: int = 200) -> str:
    return url if len(url) <= at_most else f"{url[:at_most]}..."
