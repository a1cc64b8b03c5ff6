"""Soak test of `wde serve`: many requests from many clients, hostile inputs, clients that hang up, injected
engine faults, and a SIGTERM at the end. Nothing a well-formed request sends may be lost.

The server runs as a subprocess (this file with ``--serve``) so its RSS, its SIGTERM handling and its exit code
are real. It serves the bundled all-MiniLM-L6-v2 with the `bert` workflow and the `fault_torch` runner of
tests/faults.py, which raises an injected fault every `--fail-every` batches (default 500); the engine splits a
failed batch in halves and retries it, so a transient fault must cost no request.

The driver sends `--requests` requests (default 10,000) from `--clients` concurrent keep-alive connections
(default 64, a bare asyncio HTTP/1.1 client so the load generator takes little of the CPU it shares with the
server):

- ~90% good: 1-16 inputs of random length (a few words to a few hundred, `truncate: true` when over the
  model's 256 tokens), spread over /v1/embeddings, /embed, /pooling, /score and /tokenize; each answer must be
  200 with the right number of rows (and vector width);
- ~5% hostile, each on its own connection, each with the status it is designed to get: a lone surrogate as an
  escape or as raw UTF-8 bytes, an empty text, `[true, false]` as input, `"truncate": "yes"`,
  `"dimensions": true`, an over-long text without truncate, bad JSON, JSON nested 100,000 deep, a body over the
  2 MB limit, an unknown route;
- ~5% disconnecting early: the client sends a request and closes the connection a few ms later (abandoned);
- ~2% hanging up mid-body: headers and half the body, then the connection closes (the server counts a 499);
- ~1% slow clients, each on its own connection: a body that stops half way (designed answer: 408 after the body
  timeout, connection closed) or headers sent a line every 0.5 s and never finished (408 after the header
  timeout, connection closed).

Faults on a schedule (`--faults`, default on): a slowloris wave of `--slowloris` connections (default 200) that
trickle header lines and must all be closed within the header timeout (plus a margin), and two engine freezes of
`--freeze` seconds (default 6): with `--api-servers N` the engine core process is SIGSTOPped and SIGCONTed; in
one process a SIGUSR1 makes the runner hang in its step until SIGUSR2. During each freeze /health must turn 503
(the engine makes no step for longer than the stall timeout) and be 200 again after it; good requests wait and
are answered (the freeze is shorter than the request timeout). The server runs with short timeouts so the faults
show within the run: `--request-timeout 30 --stall-timeout 3 --header-timeout 2 --body-timeout 3`.

It prints completed / rejected-as-designed / abandoned / lost (no answer, a connection error, a 5xx or a status
other than the designed one) / wrong (200 with the wrong rows or vector width), p50/p99 latency of the good
requests (all, those in flight during a freeze, the others), the server's RSS (every process of it: with
`--api-servers` the launcher, the core and the API servers) after warm-up (5% of the requests), at 50% and at the
end, the batches the engine ran (its /metrics), the 499s it counted and the faults it logged (its stderr); then it
sends a last wave of requests, SIGTERMs the server while they are in flight, and checks every one is answered 200
and the server exits 0 within 30 s.
Exit status 1 when any request was lost or answered wrongly, the server counted a 5xx, RSS grew more than
`--max-rss-growth` (10%) from 50% to the end (judged in runs of 5,000 requests or more), or the shutdown was
not clean; each lost or wrong request is printed with what was sent and what came back.

    python benchmarks/soak.py                    # the full soak: 10,000 requests, 64 clients
    python benchmarks/soak.py --requests 1000    # a quick smoke run
    python benchmarks/soak.py --api-servers 2    # the engine core behind 2 API-server processes
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Awaitable, Callable

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
DIM = 384                  # all-MiniLM-L6-v2's embedding width
MAX_TOKENS = 256           # its max length; every generated word is one token (workload._WORDS)
PAYLOAD_LIMIT = 2_000_000  # the server's --payload-limit here (TEI's default)
FAULT_LINE = "retrying it in halves"
LONE_FAILURE = re.compile(r"request \S+ failed in ")
RSS_JUDGED_FROM = 5_000
"""Shorter runs end before the allocator's high-water mark settles (it rose for the first ~4,000 requests)."""
REQUEST_TIMEOUT_S = 30.0
STALL_TIMEOUT_S = 3.0
HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 3.0
SLOW_MARGIN_S = 10.0
"""A slow client must be answered 408 and closed within its timeout plus this."""
FREEZE_AT = (0.35, 0.70)
SLOWLORIS_AT = 0.15
SERVER_ENV = "WDE_SOAK_SERVER"
"""Set in the server's environment: every process of it (the API servers and core too, which re-import this file
as their main module) registers the fault components at import."""


# --------------------------------------------------------------------------------------------------- server


FROZEN = threading.Event()
"""Set by SIGUSR1 in a one-process server: the runner hangs in its step until SIGUSR2 clears it."""


def register_components() -> None:
    """tests/faults.py's components and `soak_torch`: `fault_torch` that also hangs while `FROZEN` is set."""
    sys.path.insert(0, str(ROOT))
    from tests import faults
    from wde.registry import get_registry

    faults.register()

    class SoakRunner(faults.FaultRunner):
        name = "soak_torch"

        def run(self, batch: Any) -> Any:
            while FROZEN.is_set():
                time.sleep(0.01)
            return super().run(batch)

    registry = get_registry()
    if SoakRunner.name not in registry.components.get("runner", {}):
        registry.add_component(SoakRunner, plugin="benchmarks.soak")


if os.environ.get(SERVER_ENV) == "1":
    register_components()


def serve(port: int, fail_every: int, max_concurrent: int, api_servers: int, overrides: list[str]) -> None:
    """The server under test (`--serve`): `wde serve` with the fault-injecting runner, in one process or with the
    engine core behind `api_servers` API-server processes."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    register_components()
    from wde.server import ServerConfig, run_server

    config = ServerConfig(workflow="bert", port=port, max_concurrent_requests=max_concurrent,
                          payload_limit=PAYLOAD_LIMIT, request_timeout=REQUEST_TIMEOUT_S, stall_timeout=STALL_TIMEOUT_S,
                          header_timeout=HEADER_TIMEOUT_S, body_timeout=BODY_TIMEOUT_S,
                          overrides=["runner.name=soak_torch", f"runner.params.fail_every={fail_every}", *overrides])
    if api_servers:
        from wde.server.processes import run_split_server

        sys.exit(run_split_server(config, api_servers))
    signal.signal(signal.SIGUSR1, lambda *_: FROZEN.set())
    signal.signal(signal.SIGUSR2, lambda *_: FROZEN.clear())
    run_server(config)


# --------------------------------------------------------------------------------------------------- client


class Closed(Exception):
    """The server closed the connection before a whole answer came back."""


@dataclass
class Answer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes
    keep_alive: bool


class Conn:
    """One HTTP/1.1 keep-alive connection, bare asyncio: little CPU, and exact control of bytes and hang-ups."""

    IDLE_S = 2.0
    """Reopen a connection idle longer than this: uvicorn closes idle keep-alive connections after 5 s, and a
    request written as the server closes it would be lost by the client, not the server (clients do the same)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.last = 0.0

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(HOST, self.port, limit=1 << 20)
        self.last = time.monotonic()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    def head(self, method: str, path: str, body: bytes | None) -> bytes:
        head = f"{method} {path} HTTP/1.1\r\nHost: {HOST}:{self.port}\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        return head.encode() + b"\r\n"

    def send(self, method: str, path: str, body: bytes | None) -> None:
        assert self.writer is not None
        self.writer.write(self.head(method, path, body) + (body or b""))

    async def receive(self) -> Answer:
        assert self.reader is not None
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            headers = {}
            for line in lines[1:]:
                if ":" in line:
                    k, v = line.split(":", 1)
                    headers[k.strip().lower().encode()] = v.strip().encode()
            if b"content-length" in headers:
                body = await self.reader.readexactly(int(headers[b"content-length"]))
            elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
                parts = []
                while True:
                    size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                    parts.append(await self.reader.readexactly(size + 2))
                    if size == 0:
                        break
                body = b"".join(p[:-2] for p in parts)
            else:
                body = await self.reader.read()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, IndexError, ValueError) as e:
            raise Closed(f"{type(e).__name__}: {e}") from None
        keep = headers.get(b"connection", b"").lower() != b"close"
        return Answer(status, headers, body, keep)

    async def request(self, method: str, path: str, body: bytes | None) -> Answer:
        stale = self.reader is not None and (self.reader.at_eof() or time.monotonic() - self.last > self.IDLE_S)
        if stale:
            self.close()
        if self.writer is None:
            await self.open()
        self.send(method, path, body)
        answer = await self.receive()
        self.last = time.monotonic()
        if not answer.keep_alive:
            self.close()
        return answer


# --------------------------------------------------------------------------------------------------- workload


def _words() -> tuple[str, ...]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from workload import _WORDS

    return tuple(_WORDS)


WORDS = _words()


@dataclass
class Spec:
    """One request to send, and what must come back."""

    kind: str                     # "good", "hostile", "abandon", "hangup" (mid-body) or "slow"
    name: str                     # route for good requests, the hostile kind's name otherwise
    method: str
    path: str
    body: bytes | None
    expect: int = 200
    check: Callable[[Any], str | None] | None = None
    """For good requests: None when the parsed JSON answer has the right shape, else what is wrong."""


def text(rng: random.Random) -> str:
    """A few words (most) up to a few hundred (few); one token per word (see MAX_TOKENS)."""
    r = rng.random()
    n = rng.randint(3, 40) if r < 0.75 else rng.randint(40, 200) if r < 0.95 else rng.randint(200, 450)
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def needs_truncate(texts: list[str]) -> bool:
    return any(t.count(" ") + 4 > MAX_TOKENS for t in texts)


def _shape(rows: list, n: int, width: int) -> str | None:
    """None when `rows` are `n` rows of `width` values, else what is wrong."""
    widths = sorted({len(r) for r in rows})
    if len(rows) == n and widths == [width]:
        return None
    return f"expected {n} rows of {width}, got {len(rows)} rows of widths {widths}"


def good(rng: random.Random) -> Spec:
    route = rng.choices(["/v1/embeddings", "/embed", "/pooling", "/score", "/tokenize"],
                        weights=[35, 25, 15, 15, 10])[0]
    n = rng.choices(range(1, 17), weights=[16, 8, 6, 5, 4, 3, 3, 2, 2, 2, 1, 1, 1, 1, 1, 1])[0]
    n = max(n, 2) if route == "/score" else n  # text_1 and at least one text_2
    texts = [text(rng) for _ in range(n)]
    truncate = needs_truncate(texts) or rng.random() < 0.2
    body: dict[str, Any]
    check: Callable[[Any], str | None]
    if route == "/v1/embeddings":
        dims = rng.choice([DIM, DIM, DIM, 128, 64])
        body = {"input": texts[0] if n == 1 and rng.random() < 0.5 else texts, "truncate": truncate,
                "model": "sentence-transformers/all-MiniLM-L6-v2"}
        if dims != DIM:
            body["dimensions"] = dims
        b64 = rng.random() < 0.2
        if b64:
            body["encoding_format"] = "base64"
        width = 4 * -(-dims * 4 // 3) if b64 else dims  # base64 of `dims` float32s, or `dims` floats

        def check(a: Any, n: int = n, width: int = width) -> str | None:
            return _shape([d["embedding"] for d in a["data"]], n, width)
    elif route == "/embed":
        body = {"inputs": texts[0] if n == 1 and rng.random() < 0.5 else texts, "truncate": truncate,
                "normalize": rng.random() < 0.8}

        def check(a: Any, n: int = n) -> str | None:
            return _shape(a, n, DIM)
    elif route == "/pooling":
        body = {"input": texts, "truncate": truncate}

        def check(a: Any, n: int = n) -> str | None:
            return _shape([d["dense"] for d in a["data"]], n, DIM)
    elif route == "/score":
        body = {"text_1": texts[0], "text_2": texts[1:], "truncate": truncate}

        def check(a: Any, pairs: int = len(body["text_2"])) -> str | None:
            scores = [d["score"] for d in a["data"]]
            if len(scores) == pairs and all(-1.001 <= x <= 1.001 for x in scores):
                return None
            return f"expected {pairs} cosine scores, got {scores[:20]}"
    else:  # /tokenize: no length limit, answered off the engine thread
        body = {"inputs": texts}

        def check(a: Any, n: int = n) -> str | None:
            if isinstance(a, list) and len(a) == n and all(len(r) >= 3 for r in a):
                return None
            return f"expected {n} token lists, got {len(a)}"
    return Spec("good", route, "POST", route, json.dumps(body).encode(), 200, check)


_OVERSIZED: dict[str, bytes] = {}
"""One over-limit body per field name, shared by every request that sends it (it is 2 MB)."""


def hostile(rng: random.Random, which: int) -> Spec:
    """The `which`-th kind of hostile request (kinds cycle), with the status it is designed to get."""
    ok = text(rng)
    route = rng.choice(["/v1/embeddings", "/embed"])
    key = "input" if route == "/v1/embeddings" else "inputs"

    def js(**body: Any) -> bytes:
        return json.dumps(body).encode()

    kinds: list[tuple[str, str, int, Callable[[], bytes]]] = [
        ("lone surrogate (escape)", route, 400, lambda: js(**{key: [ok, "\ud800"]})),
        ("lone surrogate (raw bytes)", route, 400,
         lambda: b'{"' + key.encode() + b'": ["' + ok.encode() + b'", "abc\xed\xa0\x80def"]}'),
        ("empty string", route, 400, lambda: js(**{key: [ok, ""]})),
        ("input [true, false]", "/v1/embeddings", 422, lambda: js(input=[True, False])),
        ('truncate "yes"', route, 422, lambda: js(**{key: ok, "truncate": "yes"})),
        ("dimensions true", route, 422, lambda: js(**{key: ok, "dimensions": True})),
        ("too long, no truncate", route, 422,
         lambda: js(**{key: [ok, " ".join(rng.choice(WORDS) for _ in range(600))]})),
        ("bad JSON", route, 400, lambda: b'{"' + key.encode() + b'": ["unterminated'),
        ("nested 100,000 deep", route, 400, lambda: b"[" * 100_000),
        ("body over 2 MB", route, 413, lambda: _OVERSIZED.setdefault(key, js(**{key: ["word " * 1000] * 401}))),
        ("unknown route", "/v1/nope", 404, lambda: js(input=ok)),
    ]
    name, path, status, body = kinds[which % len(kinds)]
    return Spec("hostile", name, "POST", path, body(), status)


def workload(n: int, seed: int, hostile_share: float, abandon_share: float, hangup_share: float = 0.0,
             slow_share: float = 0.0) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    n_hostile = n_slow = 0
    for _ in range(n):
        r = rng.random()
        if r < hostile_share:
            specs.append(hostile(rng, n_hostile))
            n_hostile += 1
        elif r < hostile_share + abandon_share:
            spec = good(rng)
            specs.append(Spec("abandon", spec.name, spec.method, spec.path, spec.body))
        elif r < hostile_share + abandon_share + hangup_share:
            spec = good(rng)
            specs.append(Spec("hangup", spec.name, spec.method, spec.path, spec.body, 499))
        elif r < hostile_share + abandon_share + hangup_share + slow_share:
            spec = good(rng)
            name = "slow body" if n_slow % 2 == 0 else "slow headers"
            specs.append(Spec("slow", name, spec.method, spec.path, spec.body, 408))
            n_slow += 1
        else:
            specs.append(good(rng))
    return specs


# --------------------------------------------------------------------------------------------------- driver


@dataclass
class Tally:
    completed: int = 0
    rejected: int = 0
    abandoned: int = 0
    lost: list[str] = field(default_factory=list)
    """One line per lost request (no answer, connection error, 5xx, a status other than the designed one): what
    was sent and what (if anything) came back."""
    wrong: list[str] = field(default_factory=list)
    """One line per good request answered 200 with the wrong shape (rows, vector width)."""
    latencies: dict[str, list[float]] = field(default_factory=dict)
    spans: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) in `time.monotonic()` of every completed good request, to tell those in flight during a
    freeze from the others."""
    hung_up: int = 0
    slow: dict[str, list[float]] = field(default_factory=dict)
    """Slow-client kind -> seconds until the server answered 408 and closed."""
    hostile: dict[str, list[int]] = field(default_factory=dict)
    """Hostile kind -> [count, designed status]."""
    done: int = 0

    def lose(self, spec: Spec, what: str) -> None:
        self.lost.append(self.describe(spec, what))

    @staticmethod
    def describe(spec: Spec, what: str) -> str:
        body = spec.body or b""
        if len(body) > 600:
            body = body[:300] + b" ... " + body[-200:]
        return f"{spec.kind} {spec.name}: {spec.method} {spec.path} {len(spec.body or b'')} bytes {body!r} -> {what}"


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (a split server: the launcher, the core and the API servers)."""
    pids = [pid]
    for p in pids:
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    pids.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return pids


def rss_by_pid(pid: int) -> dict[int, int]:
    """VmRSS (KiB) of `pid` and of each of its descendants."""
    sizes = {}
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                found = re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M)
        except OSError:
            continue
        sizes[p] = int(found.group(1)) if found else 0
    return sizes


def rss_kib(pid: int) -> int:
    """VmRSS of `pid` and its descendants, summed."""
    return sum(rss_by_pid(pid).values())


async def send_and_leave(port: int, spec: Spec, tally: Tally, rng: random.Random, half: bool) -> bool:
    """On a connection of its own, send `spec`'s request (with `half`, its headers and only half its body), wait
    1-50 ms and close the connection; False (the request counted lost) when it could not even be sent."""
    side = Conn(port)
    body = spec.body or b""
    try:
        await side.open()
        assert side.writer is not None
        head = side.head(spec.method, spec.path, body if half else spec.body)  # a hang-up always declares a length
        side.writer.write(head + (body[:len(body) // 2] if half else body))
        await side.writer.drain()
        await asyncio.sleep(rng.uniform(0.001, 0.05))
    except ConnectionError as e:
        tally.lose(spec, f"could not even send: {e}")
        return False
    finally:
        side.close()
    return True


async def one(conn: Conn, spec: Spec, tally: Tally, rng: random.Random, timeout: float) -> None:
    """Send `spec` and account for what comes back."""
    if spec.kind == "abandon":  # the whole request, then gone before the answer
        if await send_and_leave(conn.port, spec, tally, rng, half=False):
            tally.abandoned += 1
        return
    if spec.kind == "hangup":  # headers and half the body, then gone: the server must count a 499
        if await send_and_leave(conn.port, spec, tally, rng, half=True):
            tally.hung_up += 1
        return
    if spec.kind == "slow":
        await slow_client(conn.port, spec, tally)
        return
    if spec.kind == "hostile":
        side = Conn(conn.port)
        try:
            answer = await asyncio.wait_for(side.request(spec.method, spec.path, spec.body), timeout)
        except (Closed, ConnectionError, asyncio.TimeoutError) as e:
            tally.lose(spec, f"no answer ({type(e).__name__}: {e})")
            return
        finally:
            side.close()
        entry = tally.hostile.setdefault(spec.name, [0, spec.expect])
        try:
            json.loads(answer.body)
            is_json = True
        except ValueError:
            is_json = False
        if answer.status == spec.expect and is_json:
            tally.rejected += 1
            entry[0] += 1
        else:
            tally.lose(spec, f"unexpected: {answer.status} (designed {spec.expect}) {answer.body[:300]!r}")
        return
    start = time.perf_counter()
    began = time.monotonic()
    try:
        answer = await asyncio.wait_for(conn.request(spec.method, spec.path, spec.body), timeout)
    except (Closed, ConnectionError, asyncio.TimeoutError) as e:
        conn.close()
        tally.lose(spec, f"no answer ({type(e).__name__}: {e})")
        return
    elapsed = time.perf_counter() - start
    if answer.status != 200:
        tally.lose(spec, f"unexpected: {answer.status} {answer.body[:300]!r}")
        return
    try:
        wrong = spec.check(json.loads(answer.body)) if spec.check is not None else None
    except (ValueError, KeyError, TypeError) as e:
        wrong = f"unreadable answer ({type(e).__name__}: {e}): {answer.body[:300]!r}"
    if wrong is not None:
        tally.wrong.append(tally.describe(spec, f"200 with a wrong answer: {wrong}"))
        return
    tally.completed += 1
    tally.latencies.setdefault(spec.name, []).append(elapsed)
    tally.spans.append((began, time.monotonic()))


async def slow_client(port: int, spec: Spec, tally: Tally) -> None:
    """A body that stops half way, or headers trickled a line every 0.5 s: the server must answer 408 and close the
    connection within its timeout plus `SLOW_MARGIN_S`."""
    side = Conn(port)
    body = spec.body or b""
    limit = (BODY_TIMEOUT_S if spec.name == "slow body" else HEADER_TIMEOUT_S) + SLOW_MARGIN_S
    start = time.monotonic()
    trickling: asyncio.Future | None = None
    try:
        await side.open()
        assert side.writer is not None and side.reader is not None
        head = side.head(spec.method, spec.path, body)
        if spec.name == "slow body":
            side.writer.write(head + body[:len(body) // 2])
        else:
            side.writer.write(head.split(b"\r\n")[0] + b"\r\n")
            trickling = asyncio.ensure_future(trickle(side.writer, b"X-Slow: 1\r\n", 0.5))
        answer = await asyncio.wait_for(side.receive(), limit)
        closed = await asyncio.wait_for(side.reader.read(), max(0.1, limit - (time.monotonic() - start))) == b""
    except (Closed, ConnectionError, asyncio.TimeoutError) as e:
        tally.lose(spec, f"no 408 and close within {limit:.0f} s ({type(e).__name__}: {e})")
        return
    finally:
        if trickling is not None:
            trickling.cancel()
        side.close()
    took = time.monotonic() - start
    try:
        json.loads(answer.body)
        is_json = True
    except ValueError:
        is_json = False
    if answer.status != 408 or not is_json or not closed or answer.keep_alive:
        tally.lose(spec, f"unexpected: {answer.status} (designed 408 and a closed connection; closed: {closed})"
                         f" {answer.body[:300]!r}")
        return
    tally.rejected += 1
    tally.slow.setdefault(spec.name, []).append(took)


async def trickle(writer: asyncio.StreamWriter, data: bytes, every: float = 0.25) -> None:
    """Send `data` (a header line, a body byte) every `every` seconds until the connection is closed (the slow
    clients here and in tests/test_deadlines.py)."""
    try:
        while not writer.is_closing():
            await asyncio.sleep(every)
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass


@dataclass
class Freeze:
    start: float
    resumed: float
    unhealthy_after: float | None
    """Seconds into the freeze when /health first answered 503 (None: it never did)."""
    healthy_after: float | None
    """Seconds after the resume when /health answered 200 again (None: not within 30 s)."""


@dataclass
class FaultReport:
    freezes: list[Freeze] = field(default_factory=list)
    slowloris: tuple[int, int, float, int] | None = None
    """(connections, answered 408, seconds until the last was closed, still open at the limit)."""
    rss_by_process: dict[str, dict[int, int]] = field(default_factory=dict)
    """Progress mark ("5%", "50%", "100%") -> pid -> VmRSS (KiB) of every process of the server."""


async def slowloris_wave(port: int, n: int, report: FaultReport) -> None:
    """`n` connections sending a request line, then a header line every 0.5 s, never finishing."""
    conns = [await asyncio.open_connection(HOST, port) for _ in range(n)]
    for _, writer in conns:
        writer.write(f"POST /v1/embeddings HTTP/1.1\r\nHost: {HOST}:{port}\r\n".encode())
    start = time.monotonic()
    tricklers = [asyncio.ensure_future(trickle(w, b"X-Slow: 1\r\n", 0.5)) for _, w in conns]
    reads = [asyncio.ensure_future(r.read()) for r, _ in conns]
    done, pending = await asyncio.wait(reads, timeout=HEADER_TIMEOUT_S + SLOW_MARGIN_S)
    took = time.monotonic() - start
    for task in tricklers + list(pending):
        task.cancel()
    for _, writer in conns:
        writer.close()
    answered = sum(1 for t in done if not t.cancelled() and t.exception() is None
                   and t.result().startswith(b"HTTP/1.1 408 "))
    report.slowloris = (n, answered, took, len(pending))
    print(f"  slowloris: {n} connections, {answered} answered 408, all closed after {took:.1f} s"
          f" ({len(pending)} still open)", flush=True)


async def freeze(port: int, pid: int, split: bool, seconds: float, report: FaultReport) -> None:
    """Freeze the engine for `seconds` (SIGSTOP of the core process, or a hung step in one process), watching
    /health turn 503 and back."""
    start = time.monotonic()
    os.kill(pid, signal.SIGSTOP if split else signal.SIGUSR1)
    unhealthy = None
    try:
        while time.monotonic() - start < seconds:
            try:
                if (await get(port, "/health", 2)).status == 503 and unhealthy is None:
                    unhealthy = time.monotonic() - start
            except (OSError, Closed, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.2)
    finally:
        os.kill(pid, signal.SIGCONT if split else signal.SIGUSR2)
    resumed = time.monotonic()
    healthy = None
    while time.monotonic() - resumed < 30:
        try:
            if (await get(port, "/health", 2)).status == 200:
                healthy = time.monotonic() - resumed
                break
        except (OSError, Closed, asyncio.TimeoutError):
            pass
        await asyncio.sleep(0.1)
    report.freezes.append(Freeze(start, resumed, unhealthy, healthy))
    print(f"  froze the engine{' core' if split else ''} for {resumed - start:.1f} s: /health 503 after"
          f" {unhealthy if unhealthy is None else round(unhealthy, 1)} s, 200 again"
          f" {healthy if healthy is None else round(healthy, 1)} s after the resume", flush=True)


async def fault_schedule(port: int, freeze_pid: int, split: bool, tally: Tally, total: int,
                         args: argparse.Namespace) -> FaultReport:
    """The scheduled faults: a slowloris wave at `SLOWLORIS_AT` of the run, engine freezes at `FREEZE_AT`."""
    report = FaultReport()
    events = sorted([(SLOWLORIS_AT, "slowloris")] + [(at, "freeze") for at in FREEZE_AT])
    for at, what in events:
        while tally.done < total * at:
            await asyncio.sleep(0.05)
        if tally.done >= total:
            break
        if what == "slowloris" and args.slowloris:
            await slowloris_wave(port, args.slowloris, report)
        elif what == "freeze" and args.freeze:
            await freeze(port, freeze_pid, split, args.freeze, report)
    return report


async def get(port: int, path: str, timeout: float = 10) -> Answer:
    conn = Conn(port)
    try:
        return await asyncio.wait_for(conn.request("GET", path, None), timeout)
    finally:
        conn.close()


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def server_status(text: str, status: int) -> int:
    """Answers with `status` the server counted, over every route."""
    return int(sum(float(v) for v in re.findall(rf'^wde_requests_total\{{[^}}]*status="{status}"[^}}]*\}} (\S+)$',
                                                text, re.M)))


def server_5xx(text: str) -> int:
    """5xx answers the server counted, but /health's 503s (designed, while the engine is frozen)."""
    return int(sum(float(v) for route, v in re.findall(
        r'^wde_requests_total\{route="([^"]*)",status="5\d\d"\} (\S+)$', text, re.M) if route != "/health"))


async def soak(port: int, pid: int, specs: list[Spec], clients: int, seed: int, timeout: float,
               schedule: Callable[[Tally, int], Awaitable[FaultReport]] | None = None,
               ) -> tuple[Tally, dict[str, int], float, FaultReport]:
    """Run `specs` from `clients` connections, and the `schedule` of faults beside them; the tally, the server's RSS
    (KiB) at every 5%, the seconds and what the faults saw."""
    tally = Tally()
    queue = list(reversed(specs))
    total = len(specs)
    rss: dict[str, int] = {}
    by_process: dict[str, dict[int, int]] = {}
    marks = {max(1, total * p // 100): p for p in range(5, 101, 5)}
    t0 = time.perf_counter()

    def progress() -> None:
        tally.done += 1
        p = marks.get(tally.done)
        if p is None:
            return
        sizes = rss_by_pid(pid)
        kib = sum(sizes.values())
        rss[f"{p}%"] = kib
        if p in (5, 50, 100):
            by_process[f"{p}%"] = sizes
        if p % 10 == 0 or p == 5:
            el = time.perf_counter() - t0
            print(f"  {tally.done:>6}/{total} {el:7.1f} s  {tally.done / el:6.1f} req/s"
                  f"  server RSS {kib / 1024:7.1f} MiB  lost {len(tally.lost)}  wrong {len(tally.wrong)}", flush=True)

    async def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        conn = Conn(port)
        try:
            while queue:
                await one(conn, queue.pop(), tally, rng, timeout)
                progress()
        finally:
            conn.close()

    faults = asyncio.ensure_future(schedule(tally, total)) if schedule is not None else None
    await asyncio.gather(*(client(i) for i in range(clients)))
    report = await faults if faults is not None else FaultReport()
    report.rss_by_process = by_process
    return tally, rss, time.perf_counter() - t0, report


async def drain_wave(port: int, proc: subprocess.Popen, n: int, seed: int,
                     timeout: float) -> tuple[int, list[str], float]:
    """Send `n` requests, SIGTERM the server while they are in flight; (answered 200, problems, exit seconds)."""
    rng = random.Random(seed + 7)
    conns = [Conn(port) for _ in range(n)]
    for c in conns:
        await c.open()
    bodies = [json.dumps({"input": [text(rng) for _ in range(rng.randint(2, 6))], "truncate": True}).encode()
              for _ in range(n)]
    tasks = [asyncio.ensure_future(asyncio.wait_for(c.request("POST", "/v1/embeddings", b), timeout))
             for c, b in zip(conns, bodies)]
    # Wait until the server has them (in the engine), then SIGTERM.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        active = metric((await get(port, "/metrics")).body.decode(), "wde_active_requests")
        if active >= n * 0.9 or all(t.done() for t in tasks):
            break
        await asyncio.sleep(0.01)
    in_flight = sum(not t.done() for t in tasks)
    sent_at = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    problems = []
    answered = 0
    for i, result in enumerate(await asyncio.gather(*tasks, return_exceptions=True)):
        if isinstance(result, BaseException):
            problems.append(f"drain request {i}: no answer ({type(result).__name__}: {result})")
        elif result.status != 200:
            problems.append(f"drain request {i}: {result.status} {result.body[:300]!r}")
        else:
            answered += 1
    for c in conns:
        c.close()
    try:
        await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30)
    except subprocess.TimeoutExpired:
        problems.append("the server did not exit within 30 s of SIGTERM")
    print(f"  SIGTERM sent with {in_flight} of {n} requests in flight", flush=True)
    return answered, problems, time.monotonic() - sent_at


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def machine() -> str:
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        found = None
    cpu = found.group(1) if found else platform.processor() or "unknown CPU"
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "?"
    return (f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch},"
            f" {datetime.date.today().isoformat()}")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))] * 1000 if s else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hostile", type=float, default=0.05, help="share of hostile requests")
    parser.add_argument("--abandon", type=float, default=0.05, help="share of clients disconnecting early")
    parser.add_argument("--hangup", type=float, default=0.02, help="share of clients hanging up mid-body")
    parser.add_argument("--slow", type=float, default=0.01, help="share of slow clients (body or headers)")
    parser.add_argument("--api-servers", type=int, default=0,
                        help="API-server processes in front of an engine core process (0: one process)")
    parser.add_argument("--faults", action=argparse.BooleanOptionalAction, default=True,
                        help="the scheduled faults: a slowloris wave and two engine freezes")
    parser.add_argument("--freeze", type=float, default=6.0, help="seconds each engine freeze lasts")
    parser.add_argument("--slowloris", type=int, default=200, help="connections in the slowloris wave")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a workflow override for the server, e.g. model.params.cpu_linear=torch (repeatable)")
    parser.add_argument("--fail-every", type=int, default=500, help="inject a fault every N batches (0: never)")
    parser.add_argument("--max-concurrent-requests", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=120, help="seconds before a request counts as unanswered")
    parser.add_argument("--max-rss-growth", type=float, default=0.10,
                        help=f"allowed RSS growth from 50%% to the end (judged from {RSS_JUDGED_FROM:,} requests)")
    parser.add_argument("--drain", type=int, default=None, help="requests in flight at SIGTERM (default: --clients)")
    parser.add_argument("--log", default=None, help="server log file (default: a temp file, kept)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.port, args.fail_every, args.max_concurrent_requests, args.api_servers, args.overrides)
        return 0
    if args.faults and args.freeze and args.freeze < STALL_TIMEOUT_S + 2:
        parser.error(f"--freeze must be at least {STALL_TIMEOUT_S + 2:g} s, so /health can see the stall")

    specs = workload(args.requests, args.seed, args.hostile, args.abandon, args.hangup, args.slow)
    counts = {k: sum(s.kind == k for s in specs) for k in ("good", "hostile", "abandon", "hangup", "slow")}
    port = free_port()
    log_path = args.log or tempfile.NamedTemporaryFile(prefix="wde-soak-", suffix=".log", delete=False).name
    shape = f"{args.api_servers} API servers and an engine core" if args.api_servers else "one process"
    scheduled = (f"; a slowloris wave of {args.slowloris} connections, {len(FREEZE_AT)} engine freezes of"
                 f" {args.freeze:g} s" if args.faults else "; no scheduled faults")
    print(f"{args.requests} requests ({counts['good']} good, {counts['hostile']} hostile, {counts['abandon']}"
          f" disconnecting early, {counts['hangup']} hanging up mid-body, {counts['slow']} slow) from {args.clients}"
          f" clients to {shape}{''.join(f' --set {o}' for o in args.overrides)}; a fault every {args.fail_every}"
          f" batches{scheduled}; server log {log_path}",
          flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", SERVER_ENV: "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", "--port", str(port),
                                 "--fail-every", str(args.fail_every),
                                 "--max-concurrent-requests", str(args.max_concurrent_requests),
                                 "--api-servers", str(args.api_servers),
                                 *(a for o in args.overrides for a in ("--set", o))],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
    try:
        return asyncio.run(drive(args, specs, counts, port, proc, log_path))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def drive(args: argparse.Namespace, specs: list[Spec], counts: dict[str, int], port: int,
                proc: subprocess.Popen, log_path: str) -> int:
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            print(f"the server exited with code {proc.returncode} before it was healthy; see {log_path}")
            return 1
        try:
            if (await get(port, "/health", 2)).status == 200:
                break
        except (OSError, Closed, asyncio.TimeoutError):
            pass
        if time.monotonic() > deadline:
            print(f"the server did not become healthy in 300 s; see {log_path}")
            return 1
        await asyncio.sleep(0.2)
    rss_idle = rss_kib(proc.pid)
    split = args.api_servers > 0
    freeze_pid = proc.pid
    if split:
        found = re.search(r"engine core pid (\d+)", Path(log_path).read_text(errors="replace"))
        if found is None:
            print(f"no engine core pid in the server log {log_path}")
            return 1
        freeze_pid = int(found.group(1))
    print(f"server pid {proc.pid} healthy ({len(tree(proc.pid))} processes), RSS {rss_idle / 1024:.1f} MiB"
          + (f"; engine core pid {freeze_pid}" if split else ""), flush=True)

    def schedule(tally: Tally, total: int) -> Awaitable[FaultReport]:
        return fault_schedule(port, freeze_pid, split, tally, total, args)

    tally, rss, seconds, report = await soak(port, proc.pid, specs, args.clients, args.seed, args.timeout,
                                             schedule if args.faults else None)
    metrics = (await get(port, "/metrics")).body.decode()
    fours99 = server_status(metrics, 499)
    timeouts = int(metric(metrics, "wde_request_timeouts_total"))
    batches = int(metric(metrics, "wde_batch_size_count"))
    inputs = int(metric(metrics, "wde_batch_size_sum"))
    aborted = int(metric(metrics, "wde_aborted_inputs"))
    fivexx = server_5xx(metrics)
    restarts = int(metric(metrics, "wde_engine_restarts"))

    drain_n = args.drain or args.clients
    drained, drain_problems, exit_s = await drain_wave(port, proc, drain_n, args.seed, args.timeout)
    code = proc.returncode

    log_text = Path(log_path).read_text(errors="replace")
    faults = log_text.count(FAULT_LINE)
    lone = len(LONE_FAILURE.findall(log_text))

    good = [x for v in tally.latencies.values() for x in v]
    windows = [(f.start, f.resumed) for f in report.freezes]
    in_freeze = [(end - start) for start, end in tally.spans if any(start < b and end > a for a, b in windows)]
    outside = [(end - start) for start, end in tally.spans if not any(start < b and end > a for a, b in windows)]
    rss_start, rss_mid, rss_end = rss.get("5%", rss_idle), rss.get("50%", rss_idle), rss.get("100%", rss_idle)
    growth = (rss_end - rss_mid) / rss_mid
    lost = len(tally.lost) + len(drain_problems)
    failures = []
    if tally.lost:
        failures.append(f"{len(tally.lost)} requests lost")
    if tally.wrong:
        failures.append(f"{len(tally.wrong)} good requests answered 200 with a wrong answer")
    if fivexx:
        failures.append(f"the server counted {fivexx} 5xx answers")
    if restarts:
        failures.append(f"the engine loop restarted {restarts} times")
    judge_rss = args.requests >= RSS_JUDGED_FROM
    if judge_rss and growth > args.max_rss_growth:
        failures.append(f"RSS grew {growth:.1%} from 50% to the end (limit {args.max_rss_growth:.0%}): it does not"
                        " level off")
    if drain_problems:
        failures.append(f"{len(drain_problems)} in-flight requests not answered 200 at SIGTERM")
    if code != 0:
        failures.append(f"the server exited with code {code} after SIGTERM (expected 0)")
    if fours99 < tally.hung_up:
        failures.append(f"the server counted {fours99} 499s for {tally.hung_up} clients that hung up mid-body")
    for f in report.freezes:
        if f.unhealthy_after is None:
            failures.append("/health stayed 200 during an engine freeze")
        if f.healthy_after is None:
            failures.append("/health was not 200 within 30 s of the end of an engine freeze")
    if report.slowloris is not None and (report.slowloris[3] or report.slowloris[1] != report.slowloris[0]):
        failures.append(f"slowloris: {report.slowloris[3]} of {report.slowloris[0]} connections still open"
                        f" {HEADER_TIMEOUT_S + SLOW_MARGIN_S:g} s after the header timeout began,"
                        f" {report.slowloris[1]} answered 408")
    expected_faults = batches // args.fail_every if args.fail_every else 0

    print()
    print("| | |")
    print("|---|---|")
    print(f"| requests | {args.requests:,} from {args.clients} clients in {seconds:.1f} s"
          f" ({args.requests / seconds:.1f} req/s) |")
    print(f"| completed (200, right shape) | {tally.completed:,} of {counts['good']:,} good |")
    print(f"| rejected as designed | {tally.rejected:,} of {counts['hostile'] + counts['slow']:,} hostile or slow |")
    print(f"| abandoned (client hung up) | {tally.abandoned:,} of {counts['abandon']:,} after the body,"
          f" {tally.hung_up:,} of {counts['hangup']:,} mid-body; server counted {fours99:,} 499s and aborted"
          f" {aborted:,} inputs |")
    print(f"| **lost** (no answer, connection error, 5xx, undesigned status) | **{lost}** |")
    print(f"| wrong answers (200, wrong rows or width) | {len(tally.wrong)} |")
    print(f"| latency of good requests | p50 {pct(good, 50):.0f} ms, p99 {pct(good, 99):.0f} ms |")
    if windows:
        print(f"| ... in flight during an engine freeze ({len(in_freeze):,}) | p50 {pct(in_freeze, 50):.0f} ms,"
              f" p99 {pct(in_freeze, 99):.0f} ms |")
        print(f"| ... all the others ({len(outside):,}) | p50 {pct(outside, 50):.0f} ms,"
              f" p99 {pct(outside, 99):.0f} ms |")
    for f in report.freezes:
        print(f"| engine {'core SIGSTOPped' if split else 'step hung'} for {f.resumed - f.start:.1f} s | /health 503"
              f" after {f.unhealthy_after if f.unhealthy_after is None else round(f.unhealthy_after, 1)} s,"
              f" 200 again {f.healthy_after if f.healthy_after is None else round(f.healthy_after, 1)} s after |")
    if report.slowloris is not None:
        n, answered, took, still = report.slowloris
        print(f"| slowloris wave | {n} connections: {answered} answered 408, all closed after {took:.1f} s"
              f" ({still} still open) |")
    for name, took in sorted(tally.slow.items()):
        print(f"| {name} | {len(took)} answered 408 and closed after {min(took):.1f}-{max(took):.1f} s |")
    print(f"| server RSS after 5% / 50% / end | {rss_start / 1024:.1f} / {rss_mid / 1024:.1f} /"
          f" {rss_end / 1024:.1f} MiB ({growth:+.1%} from 50% to end"
          + ("" if judge_rss else f"; not judged under {RSS_JUDGED_FROM:,} requests") + ") |")
    print(f"| batches / inputs run | {batches:,} / {inputs:,} (mean batch {inputs / max(batches, 1):.1f}) |")
    print(f"| injected faults (retried in halves) | {faults} logged (~{expected_faults} expected);"
          f" {lone} requests failed alone |")
    print(f"| 5xx counted by the server / engine loop restarts / request timeouts | {fivexx} / {restarts} /"
          f" {timeouts} |")
    print(f"| SIGTERM | exit code {code} after {exit_s:.1f} s, {drained} of {drain_n} in-flight requests drained |")
    print()
    print("latency by route (good requests):")
    for route, lat in sorted(tally.latencies.items()):
        print(f"  {route:<15} {len(lat):>6}  p50 {pct(lat, 50):7.0f} ms  p99 {pct(lat, 99):7.0f} ms")
    print("hostile requests rejected as designed:")
    for name, (n, status) in sorted(tally.hostile.items()):
        print(f"  {name:<28} {status}  x{n}")
    print("server RSS: " + "  ".join(f"{k} {v / 1024:.0f}" for k, v in rss.items()) + " MiB")
    if split:
        names = {proc.pid: "launcher", freeze_pid: "engine core"}
        for mark, sizes in report.rss_by_process.items():
            print(f"  RSS by process at {mark}: " + ", ".join(
                f"{names.get(p, 'API server' if kib > 100 * 1024 else 'helper')} {kib / 1024:.0f}"
                for p, kib in sizes.items()) + " MiB")
    if code == 0:
        print(f"exit code 0 after SIGTERM, {drained} in-flight requests drained")
    for line in tally.lost[:20] + drain_problems[:20]:
        print("LOST " + line)
    for line in tally.wrong[:10]:
        print("WRONG " + line)
    print(f"machine: {machine()}")
    if failures:
        print("FAILED: " + "; ".join(failures) + f" (server log: {log_path})")
        return 1
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
