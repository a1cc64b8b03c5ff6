"""Fetching image URLs for an image-text model, only from the hosts `wde serve --allow-image-fetch` names.

Off by default: a server that fetches whatever URL a request names can be made to reach services only it can see
(server-side request forgery), so an image URL is refused unless its host is listed. When it is, the fetch is
held to the same limits as an image sent inline: http or https only; no connection to a host outside the list,
ever (a redirect is followed only to a listed host, checked before connecting, and proxies from the environment
are not used, as they are other hosts); the body is read as it streams and refused (413) as soon as it passes
`max_image_bytes`, never buffered beyond it; compressed bodies are not asked for (an encoded body is refused, so a
small gzip stream cannot decode to gigabytes); and the whole fetch, redirects included, must finish within the
timeout. It runs on the event loop (httpx's async client), so a slow host holds no thread.
"""

from __future__ import annotations

import asyncio
from typing import Sequence

import httpx

from wde.server.errors import ApiError

MAX_REDIRECTS = 3
CONCURRENT_FETCHES = 8
"""Fetches one request runs at once."""

_REDIRECTS = frozenset({301, 302, 303, 307, 308})


class ImageFetcher:
    """GETs image URLs whose host is in `hosts`; every refusal is an `ApiError` naming the input's field."""

    def __init__(self, hosts: Sequence[str], max_bytes: int, timeout: float) -> None:
        self.hosts = frozenset(hosts)
        self.max_bytes = max_bytes
        self.timeout = timeout

    def check(self, url: str, field: str, redirected_from: str | None = None) -> httpx.URL:
        """The URL parsed, if it may be fetched: http(s) and a listed host; else the 400 that says why."""
        via = f" (redirected from {redirected_from})" if redirected_from else ""
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, TypeError, ValueError) as e:
            raise ApiError("bad_image", f"{field}: {_short(url)}{via} is not a valid URL: {e}", field) from None
        if parsed.scheme not in ("http", "https"):
            raise ApiError("bad_image", f"{field}: {_short(url)}{via} is not an http(s) URL; images are fetched over"
                           " http and https only", field)
        host = parsed.host.lower().rstrip(".")
        if host not in self.hosts:
            raise ApiError("bad_image", f"{field}: {_short(url)}{via} is on host {host!r}, which is not one this"
                           " server fetches images from (wde serve --allow-image-fetch; the list is not shown to"
                           " clients); send the image as a data:image/...;base64,... URI", field)
        return parsed

    async def fetch_all(self, urls: Sequence[str], fields: Sequence[str]) -> list[bytes]:
        """The bodies of `urls`, fetched at once (up to `CONCURRENT_FETCHES`); the first refusal cancels the rest."""
        for url, field in zip(urls, fields):
            self.check(url, field)  # every URL is vetted before anything connects
        gate = asyncio.Semaphore(CONCURRENT_FETCHES)
        async with httpx.AsyncClient(follow_redirects=False, trust_env=False,
                                     timeout=httpx.Timeout(self.timeout)) as client:
            async def one(url: str, field: str) -> bytes:
                async with gate:
                    return await self.fetch(client, url, field)

            try:
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(one(u, f)) for u, f in zip(urls, fields)]
            except BaseExceptionGroup as failed:
                raise _first(failed) from None
        return [t.result() for t in tasks]

    async def fetch(self, client: httpx.AsyncClient, url: str, field: str) -> bytes:
        """One image, within the timeout, the byte limit and the host list (redirects included)."""
        try:
            async with asyncio.timeout(self.timeout):
                return await self._follow(client, url, field)
        except (TimeoutError, httpx.TimeoutException):
            raise ApiError("bad_image", f"{field}: fetching {_short(url)} took longer than {self.timeout:g} s (wde"
                           " serve --image-fetch-timeout)", field) from None
        except httpx.HTTPError as e:
            raise ApiError("bad_image", f"{field}: cannot fetch {_short(url)}: {type(e).__name__}: {e}",
                           field) from None

    async def _follow(self, client: httpx.AsyncClient, url: str, field: str) -> bytes:
        current, previous = self.check(url, field), None
        for _ in range(MAX_REDIRECTS + 1):
            async with client.stream("GET", current, headers={"accept": "image/*", "accept-encoding": "identity"}) \
                    as response:
                if response.status_code in _REDIRECTS and "location" in response.headers:
                    previous = str(current)
                    target = current.join(response.headers["location"])
                    current = self.check(str(target), field, redirected_from=previous)
                    continue
                return await self._body(response, url, field)
        raise ApiError("bad_image", f"{field}: {_short(url)} redirects more than {MAX_REDIRECTS} times", field)

    async def _body(self, response: httpx.Response, url: str, field: str) -> bytes:
        if response.status_code != 200:
            raise ApiError("bad_image", f"{field}: fetching {_short(url)} was answered {response.status_code}"
                           f" {response.reason_phrase}".rstrip(), field)
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise ApiError("bad_image", f"{field}: {_short(url)} was sent with Content-Encoding {encoding!r}, which"
                           " was not asked for; image files are fetched as they are", field)
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            raise self._too_large(url, field, f"{int(declared)} bytes (its Content-Length)")
        chunks, size = [], 0
        async for chunk in response.aiter_raw():
            size += len(chunk)
            if size > self.max_bytes:
                raise self._too_large(url, field, f"over {self.max_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self, url: str, field: str, size: str) -> ApiError:
        return ApiError("image_too_large", f"{field}: {_short(url)} is {size}; the image size limit is"
                        f" {self.max_bytes} bytes (input_processor.params.max_image_bytes)", field)


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


def _short(url: str, at_most: int = 200) -> str:
    return url if len(url) <= at_most else f"{url[:at_most]}..."
