"""What one request's image URLs may make the server spend, bounded before it is spent (issue 33 item 6).

A local web server stands in for an image host: 1 MB bodies, bodies that never finish (held until the test lets
them go or the fetcher hangs up, counting the connections open at once), and redirects to malformed `Location`s.
Each limit is checked against the server it bounds: the batch size and the URL count before the first
connection; the bytes a request fetches in all (and the server's RSS while many requests fetch many big URLs, in
a `wde serve` process of its own); the connections all requests hold at once (and a server with 256 file
descriptors serving 32 requests of 8 URLs each); the request slot a fetching request holds; one deadline for all
of a request's fetches; fetches cancelled when the client hangs up; every malformed URL or `Location` a 400
naming the field. After each refusal the server answers the next request.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.test_image_http import GOOD, PNG, ImageSite, close, error, post, vectors
from tests.test_server import free_port, serve, stop_server, wait_healthy
from wde import Engine

MB = 1_000_000
PAUSE = 0.5
"""Seconds `/pause/N` holds its response: enough for many fetches to overlap."""
BIG = b"\x89PNG\r\n\x1a\n" + b"\0" * (MB - 8)
"""A 1 MB body (not an image: every request that fetches it is refused before decoding)."""


class LimitSite:
    """An image host for the limits: `/mb/N` 1 MB with its Content-Length, `/unsized/N` 1 MB streamed without
    one, `/cat.png/N` a real PNG, `/hold/N` a PNG that stops after its first bytes until `release` is set or the
    fetcher closes the connection (`open` counts those held now, `peak` the most at once), `/pause/N` the same
    for `PAUSE` seconds only, and `/to/K` a redirect to `LOCATIONS[K]` as it is, byte for byte."""

    def __init__(self) -> None:
        self.requests = 0
        self.kinds: dict[str, int] = {}
        """Requests by kind (the path's first part): a test's own, where the fetches a test before cancelled
        may still arrive."""
        self.open = 0
        self.peak = 0
        self.hung_up = 0
        """Held responses ended because the fetcher closed the connection."""
        self.release = threading.Event()
        self.lock = threading.Lock()
        site = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                kind = self.path.split("/")[1]
                with site.lock:
                    site.requests += 1
                    site.kinds[kind] = site.kinds.get(kind, 0) + 1
                if kind == "mb":
                    ImageSite._send(self, BIG)
                elif kind == "unsized":
                    ImageSite._send(self, BIG, length=False)
                elif kind == "cat.png":
                    ImageSite._send(self, PNG)
                elif kind == "hold":
                    site._hold(self)
                elif kind == "pause":
                    site._hold(self, PAUSE)
                elif kind == "to":
                    ImageSite._redirect(self, LOCATIONS[self.path.split("/")[2]])
                else:
                    self.send_error(404)

        class Server(ThreadingHTTPServer):
            request_queue_size = 256  # many fetches connect at once
            daemon_threads = True

            def handle_error(self, *args: Any) -> None:
                pass  # a fetcher that stopped reading (a refusal, a cancelled fetch) is what these tests cause

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def urls(self, kind: str, n: int) -> list[str]:
        return [self.url(f"/{kind}/{i}") for i in range(n)]

    def _hold(self, h: BaseHTTPRequestHandler, pause: float | None = None) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "image/png")
        h.send_header("Content-Length", str(len(PNG)))
        h.end_headers()
        h.wfile.write(PNG[:20])
        h.wfile.flush()
        with self.lock:
            self.open += 1
            self.peak = max(self.peak, self.open)
        h.connection.settimeout(0.05)
        until = None if pause is None else time.monotonic() + pause
        try:
            while not self.release.is_set() and (until is None or time.monotonic() < until):
                try:
                    if h.connection.recv(1) == b"":  # the fetcher closed the connection
                        with self.lock:
                            self.hung_up += 1
                        return
                except TimeoutError:
                    continue
                except OSError:
                    return
        finally:  # counted while the fetcher surely holds the connection: before it can have the whole image
            with self.lock:
                self.open -= 1
        h.wfile.write(PNG[20:])

    def reset(self) -> None:
        with self.lock:
            self.release.clear()
            self.requests = self.peak = self.hung_up = 0
            self.kinds = {}

    def wait(self, condition: Any, timeout: float = 60) -> bool:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def settle(self, quiet: float = 0.2) -> None:
        """Wait until no request has arrived for `quiet` seconds: cancelled fetches may still be on their way."""
        seen, since = -1, time.monotonic()
        while time.monotonic() - since < quiet:
            if self.requests != seen:
                seen, since = self.requests, time.monotonic()
            time.sleep(0.02)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


LOCATIONS = {
    "backslashes": "\\\\evil.example\\x.png",
    "slash-backslash": "/\\evil.example/x.png",
    "scheme-backslashes": "http:\\\\127.0.0.1\\x.png",
    "port-65536": "http://127.0.0.1:65536/x",
    "port-0": "http://127.0.0.1:0/x",
    "port-huge": "http://127.0.0.1:99999999999999999999/x",
    "bracket": "http://[::1/x",
    "bad-host": "http://%zz/x",
    "space": "/a b.png",
    "tab": "/a\tb.png",
    "idna": "http://xn--/x",
}


@pytest.fixture(scope="module")
def site() -> Iterator[LimitSite]:
    running = LimitSite()
    yield running
    running.close()


LIMITS = dict(allow_image_fetch=("127.0.0.1",), image_fetch_max_urls=16, image_fetch_max_bytes=3 * MB + 100,
              image_fetch_connections=4, image_fetch_timeout=60.0, max_concurrent_requests=4)
"""The limits served here: 16 URLs and 3 MB a request, 4 connections and 4 requests in all; one fetch may take
a minute, so only the request's deadline (set by each fixture) or the test ends a held one."""


@pytest.fixture(scope="module")
def fetching(clip_path: Path, site: LimitSite) -> Iterator[str]:
    with Engine.from_workflow(None, clip_path) as engine, \
            serve(engine, **LIMITS, image_fetch_deadline=3.0) as (base, _):
        yield base


@pytest.fixture(scope="module")
def patient(clip_path: Path, site: LimitSite) -> Iterator[str]:
    """A server whose requests may fetch for a minute: only the test (or the client leaving) ends a held fetch."""
    with Engine.from_workflow(None, clip_path) as engine, \
            serve(engine, **LIMITS, image_fetch_deadline=60.0) as (base, _):
        yield base


@pytest.fixture(autouse=True)
def fresh(site: LimitSite) -> Iterator[None]:
    site.reset()
    yield
    site.release.set()
    assert site.wait(lambda: site.open == 0, 30), "held responses were never closed"
    site.settle()


def images(urls: list[str]) -> dict:
    return {"input": urls, "modality": "image"}


def serves(base: str, clip: Engine) -> bool:
    """The server still answers a good request right (`clip`: an engine of the same model, not the served one)."""
    return close(vectors(post(base, "/v2/embed", {"images": [GOOD]})), clip.embed([PNG]))


# -- counts, checked before the first fetch ---------------------------------------------------------------------------

def test_batch_over_the_limit_fetches_nothing(fetching: str, site: LimitSite, clip: Engine) -> None:
    r = post(fetching, "/embeddings", images(site.urls("cat.png", 2100)))
    message, param, _ = error(r)
    assert r.status_code == 422 and "batch size 2100 > maximum allowed batch size 2048" in message, r.text
    assert param == "input" and site.requests == 0
    texts = [{"content": [{"type": "text", "text": "a cat"}]}] * 2047
    urls = [{"content": [{"type": "image_url", "image_url": {"url": u}}]} for u in site.urls("cat.png", 2)]
    r = post(fetching, "/v2/embed", {"inputs": texts + urls, "input_type": "search_document"})
    message, param, _ = error(r)  # the texts count too: 2,049 inputs, of which 2 are URLs
    assert r.status_code == 422 and "batch size 2049" in message and param == "inputs", r.text
    assert site.requests == 0 and serves(fetching, clip)


def test_too_many_urls_fetch_nothing(fetching: str, site: LimitSite, clip: Engine) -> None:
    r = post(fetching, "/v2/embed", {"images": site.urls("cat.png", 17)})
    message, param, _ = error(r)
    assert r.status_code == 422 and "17 image URLs" in message and "at most 16" in message, r.text
    assert "--image-fetch-max-urls" in message and param == "images" and site.requests == 0
    got = vectors(post(fetching, "/v2/embed", {"images": site.urls("cat.png", 16)}))  # the limit itself is served
    assert close(got, clip.embed([PNG] * 16)) and site.requests == 16


# -- bytes -------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["mb", "unsized"])
def test_fetched_bytes_of_a_request_are_bounded(fetching: str, site: LimitSite, clip: Engine, kind: str) -> None:
    """Sixteen 1 MB images under a 3 MB total: refused (413) once the fourth would pass it, by its Content-Length
    or while it streams, naming the limit and the image that passed it; the fetches left are never made."""
    r = post(fetching, "/embeddings", images(site.urls(kind, 16)))
    message, param, code = error(r)
    assert r.status_code == 413 and code == "image_too_large", r.text
    assert f"may total {3 * MB + 100} bytes (wde serve --image-fetch-max-bytes)" in message
    assert param.startswith("input[") and message.startswith(param)
    assert site.requests < 16  # the first refusal cancelled the rest
    assert serves(fetching, clip)


def test_within_the_total_is_served(fetching: str, site: LimitSite) -> None:
    """Three 1 MB bodies fit the 3 MB total: fetched, then refused as images (they are not), not for their size."""
    r = post(fetching, "/embeddings", images(site.urls("mb", 3)))
    message, _, code = error(r)
    assert r.status_code == 400 and code == "bad_image" and "--image-fetch-max-bytes" not in message, r.text
    assert site.requests == 3


# -- connections, slots, time ------------------------------------------------------------------------------------------

def _at_once(base: str, bodies: list[dict], path: str = "/embeddings", timeout: float = 120) -> list[httpx.Response]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: httpx.post(f"{base}{path}", json=b, timeout=timeout), bodies))


def test_connections_are_bounded_server_wide_and_one_deadline_ends_a_request(
        fetching: str, site: LimitSite, clip: Engine) -> None:
    """Four requests of 8 held URLs each (32 fetches): never more than the 4 connections the server may hold at
    once, and each request ends at its 3 s deadline (one fetch alone may take 60 s), with a 400 naming it; every
    connection is closed after. Fetches cancelled mid-body before (a request over its byte total cancels its
    others) gave their connections back: all 4 are there."""
    for _ in range(3):
        assert post(fetching, "/embeddings", images(site.urls("unsized", 16))).status_code == 413
    start = time.monotonic()
    answers = _at_once(fetching, [images(site.urls("hold", 8)) for _ in range(4)])
    elapsed = time.monotonic() - start
    for r in answers:
        message, param, code = error(r)
        assert r.status_code == 400 and code == "bad_image" and param == "input", r.text
        assert "longer than 3 s in all (wde serve --image-fetch-deadline)" in message
    assert site.peak == 4, site.peak  # every fetch wanted a connection; 4 is the server's limit
    assert 2.5 < elapsed < 30, elapsed  # the deadline, not a fetch's 60 s timeout
    assert site.wait(lambda: site.open == 0, 10)  # cancelled: their connections closed, none kept alive
    assert serves(fetching, clip)


def test_a_fetching_request_holds_a_request_slot(patient: str, site: LimitSite, clip: Engine) -> None:
    """With 4 request slots held by 4 fetching requests, a fifth request is answered 429 at once, fetching
    nothing, as a text is: fetching requests count as requests in flight. Once the images arrive all 4 succeed."""
    with ThreadPoolExecutor(4) as pool:
        holders = [pool.submit(httpx.post, f"{patient}/embeddings", json=images([site.url(f"/hold/{i}")]),
                               timeout=120) for i in range(4)]
        assert site.wait(lambda: site.open == 4), site.open
        asked = site.requests
        r = post(patient, "/embeddings", images([site.url("/cat.png/x")]))
        assert r.status_code == 429 and "4 requests in flight, the limit is 4" in error(r)[0], r.text
        r = post(patient, "/v2/embed", {"images": [GOOD]})
        assert r.status_code == 429, r.text
        assert site.requests == asked
        site.release.set()
        assert all(close(vectors(h.result()), clip.embed([PNG])) for h in holders)
    assert serves(patient, clip)


def test_fetches_stop_when_the_client_hangs_up(patient: str, site: LimitSite, clip: Engine) -> None:
    """A client that gives up after 1 s: the server closes its 4 held fetches at once (their deadline is a minute
    away) and frees its slot."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{patient}/embeddings", json=images(site.urls("hold", 4)), timeout=httpx.Timeout(60, read=1.0))
    assert site.wait(lambda: site.hung_up == 4, 20), (site.hung_up, site.open)
    assert site.open == 0 and site.peak == 4
    for _ in range(4):  # its slot is free again: as many requests as there are slots are served
        assert serves(patient, clip)


# -- malformed URLs and Locations ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("link", [
    "http://127.0.0.1:65536/x", "http://127.0.0.1:0/x", "http://127.0.0.1:99999999999999999999/x",
    "http://127.0.0.1\\@evil.example/x", "http://127.0.0.1/a\\b.png", "http://[::1/x", "http://%zz/x",
    "http://xn--/x", "http:///x", "http://127.0.0.1/a b.png", "http://127.0.0.1/\x00",
])
def test_malformed_url_is_a_400_and_never_connects(fetching: str, site: LimitSite, clip: Engine, link: str) -> None:
    r = post(fetching, "/v2/embed", {"images": [GOOD, link]})
    message, param, code = error(r)
    assert r.status_code == 400 and code == "bad_image" and param == "images[1]", r.text
    assert message.startswith("images[1]: ") and ("not a valid URL" in message or "not an http(s)" in message)
    assert "Traceback" not in r.text and len(message) < 600 and site.requests == 0
    assert serves(fetching, clip)


@pytest.mark.parametrize("key", sorted(LOCATIONS))
def test_malformed_location_is_a_400(fetching: str, site: LimitSite, clip: Engine, key: str) -> None:
    r = post(fetching, "/v1/embeddings", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": site.url(f"/to/{key}")}}]}]})
    message, param, code = error(r)
    assert r.status_code == 400 and code == "bad_image" and param == "messages[0].content[0].image_url", r.text
    assert "not a valid URL" in message and "Traceback" not in r.text, message
    assert site.requests == 1  # the redirect was read; where it pointed was never asked
    assert serves(fetching, clip)


# -- a server of its own: memory and file descriptors --------------------------------------------------------------------

def rss(pid: int) -> int:
    """Resident bytes of process `pid` now (/proc/PID/status VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


class PeakRss:
    """Samples a process's RSS every 5 ms while in use; `peak` is the most seen."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, rss(pid), threading.Event()

    def __enter__(self) -> "PeakRss":
        def sample() -> None:
            while not self._stop.wait(0.005):
                self.peak = max(self.peak, rss(self.pid))
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss(self.pid))


FILES = 256
"""The server process's file descriptor limit: under the 32 x 8 fetches the test makes at once."""


@contextmanager
def wde_serve(model: Path, *args: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """`wde serve` in a process of its own with at most `FILES` open files, fetching from 127.0.0.1."""
    port = free_port()

    def few_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FILES, FILES))

    proc = subprocess.Popen([sys.executable, "-m", "wde.cli", "serve", "--model", str(model), "--port", str(port),
                             "--allow-image-fetch", "127.0.0.1", "--log-level", "warning", *args],
                            preexec_fn=few_files, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, lambda: proc.poll() is None, timeout=300)
        yield url, proc
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def own_server(clip_path: Path) -> Iterator[tuple[str, int]]:
    with wde_serve(clip_path, "--image-fetch-max-bytes", str(8 * MB), "--max-concurrent-requests", "64") as (
            url, proc):
        yield url, proc.pid


def test_many_big_urls_cost_bounded_memory(own_server: tuple[str, int], site: LimitSite) -> None:
    """The issue's case, 1,000 URLs of 1 MB from a 38 KB body, is refused before a byte is fetched; eight
    requests at once of the most URLs one may name (64 x 1 MB: 512 MB unbounded) grow the server's RSS by under
    the 8 x 8 MB they may fetch in all plus 60 MB, as each stops at its 8 MB total."""
    url, pid = own_server
    assert post(url, "/embeddings", images(site.urls("cat.png", 1))).status_code == 200  # warm: the client exists
    before = rss(pid)
    with PeakRss(pid) as one:
        r = post(url, "/embeddings", images(site.urls("mb", 1000)))
    assert r.status_code == 422 and "--image-fetch-max-urls" in error(r)[0] and site.requests == 1, r.text
    with PeakRss(pid) as many:
        answers = _at_once(url, [images(site.urls("mb", 64)) for _ in range(8)])
    assert all(r.status_code == 413 and "--image-fetch-max-bytes" in error(r)[0] for r in answers)
    grown = many.peak - before
    print(f"RSS {before / MB:.0f} MB; 1,000 URLs refused: +{(one.peak - before) / MB:.1f} MB; 8 x 64 x 1 MB URLs:"
          f" +{grown / MB:.1f} MB at the peak, {site.requests - 1} fetches started")
    assert one.peak - before < 20 * MB
    assert grown < 8 * 8 * MB + 60 * MB, grown
    assert site.requests - 1 < 8 * 64  # each request stopped at its total


def test_file_descriptors_never_run_out(own_server: tuple[str, int], site: LimitSite) -> None:
    """32 requests at once, each of 8 URLs that take half a second, to a server that may open 256 files: 256
    fetches at once plus 32 client connections would not fit, but the server holds at most 32 fetching
    connections (--image-fetch-connections), so every request is served."""
    url, pid = own_server
    limits = Path(f"/proc/{pid}/limits").read_text()
    assert any(line.startswith("Max open files") and line.split()[3] == str(FILES) for line in limits.splitlines())
    answers = _at_once(url, [images([site.url(f"/pause/{r}-{i}") for i in range(8)]) for r in range(32)])
    assert [r.status_code for r in answers] == [200] * 32, [r.text for r in answers if r.status_code != 200][:2]
    assert site.kinds["pause"] == 32 * 8 and 8 < site.peak <= 32, (site.kinds, site.peak)  # overlapping, bounded
    assert len(os.listdir(f"/proc/{pid}/fd")) < FILES // 2  # nothing left open after


# -- configuration -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "value"), [("image_fetch_max_urls", 0), ("image_fetch_max_bytes", 0),
                                             ("image_fetch_connections", 0), ("image_fetch_deadline", 0)])
def test_fetch_limits_that_would_refuse_everything_are_refused_at_start(name: str, value: int) -> None:
    from click.testing import CliRunner

    from wde.cli import main
    from wde.server import ServerConfig
    from wde.server.config import LimitError

    with pytest.raises(LimitError, match=name):
        ServerConfig(**{name: value})
    option = "--" + name.replace("_", "-")
    assert option in CliRunner().invoke(main, ["serve", "--help"]).output
    bad = CliRunner().invoke(main, ["serve", option, str(value), "--api-servers", "0"])
    assert bad.exit_code == 1 and option in bad.output, bad.output
