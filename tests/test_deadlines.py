"""Deadlines, liveness, slow and abandoned clients, in one process and with the engine core in its own process.

- `--request-timeout`, `--stall-timeout`: a frozen engine times its requests out with 503 + Retry-After in each
  route's error shape and aborts them in the engine, /health turns 503 and /metrics shows it; once the engine
  steps again, /health is 200 and requests are served.
- `--header-timeout`, `--body-timeout`: slowloris connections and slow bodies get 408 and are closed.
- Clients that hang up, mid-body or while their request waits in the engine, free their slots at once (no 429 for
  others), their work never runs, and each is a 499 and one log line (no 500, no traceback).

A frozen engine is a hung step in one process (`fault_bert` blocks on the word "hang" until `UNHANG` is set,
tests/faults.py) and a SIGSTOPped core process in a split server. The servers run with small timeouts; every
wait has a hang guard far above the normal time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager, Iterator

import httpx
import numpy as np
import pytest

from tests import faults
from tests.test_server import free_port, metric, serve_split, wait_healthy
from tests.test_split_server import _core_pid
from wde import Engine
from wde.server import ServerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from soak import trickle  # noqa: E402 - benchmarks/ is not a package; its slow-client helper

REQUEST_TIMEOUT_S = 8.0
"""Long enough for a burst of requests to be admitted (and hung up) on a busy 2-core machine before it passes."""
STALL_TIMEOUT_S = 2.0
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
LIMIT = 40
"""--max-concurrent-requests (per API server)."""
GUARD_S = 60.0
"""No wait in these tests takes more than a few seconds; past this, something hangs."""

OPTIONS = {"request_timeout": REQUEST_TIMEOUT_S, "stall_timeout": STALL_TIMEOUT_S, "header_timeout": HEADER_TIMEOUT_S,
           "body_timeout": BODY_TIMEOUT_S, "max_concurrent_requests": LIMIT}


@dataclass
class Frozen:
    slots: int
    """HTTP requests the freeze itself keeps in flight (the hung request in one process)."""
    inputs: int
    """Inputs the freeze runs once it ends."""


@dataclass
class TimeoutServer:
    url: str
    mode: str
    freeze: Callable[[], ContextManager[Frozen]]
    """Freezes the engine for the `with` block: a hung step (one process) or SIGSTOP of the core (split)."""
    log: Callable[[], str]
    """What the server logged so far."""


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def poll(what: Callable[[], bool], guard: float = GUARD_S, every: float = 0.05) -> None:
    deadline = time.monotonic() + guard
    while not what():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(every)


@contextmanager
def one_process(minilm_path: Path) -> Iterator[TimeoutServer]:
    """`run_server` (what `wde serve --api-servers 0` runs) on a thread, with `fault_bert`."""
    import uvicorn

    from wde.server.app import run_server

    faults.register()
    port = free_port()
    config = ServerConfig(model=str(minilm_path), port=port, overrides=["model.name=fault_bert"], **OPTIONS)
    started: list[uvicorn.Server] = []

    class Recorded(uvicorn.Server):
        def __init__(self, config: uvicorn.Config) -> None:
            super().__init__(config)
            started.append(self)

    thread = threading.Thread(target=run_server, args=(config,), daemon=True)
    url = f"http://127.0.0.1:{port}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(uvicorn, "Server", Recorded)
        thread.start()
        wait_healthy(url, thread.is_alive, timeout=300)
    lines = _Lines()
    loggers = [logging.getLogger(name) for name in ("wde", "uvicorn.error")]
    level = loggers[0].level
    loggers[0].setLevel(logging.INFO)
    for logger in loggers:
        logger.addHandler(lines)

    @contextmanager
    def freeze() -> Iterator[Frozen]:
        faults.UNHANG.clear()
        hung: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: hung.append(
            httpx.post(f"{url}/v1/embeddings", json={"input": "hang here"}, timeout=GUARD_S)), daemon=True)
        sender.start()
        try:
            poll(lambda: metric(url, "wde_pending_inputs") == 1 and metric(url, "wde_queue_depth") == 0)
            yield Frozen(slots=1, inputs=1)
        finally:
            faults.UNHANG.set()
            sender.join(GUARD_S)

    try:
        yield TimeoutServer(url, "one process", freeze, lambda: "\n".join(lines.lines))
    finally:
        faults.UNHANG.set()
        for logger in loggers:
            logger.removeHandler(lines)
        loggers[0].setLevel(level)
        started[0].should_exit = True
        thread.join(60)


@contextmanager
def split(minilm_path: Path, log: Path) -> Iterator[TimeoutServer]:
    """`wde serve --api-servers 1` in a subprocess: the engine core in its own process."""
    args = [f"--{k.replace('_', '-')}={v}" for k, v in OPTIONS.items()]
    with serve_split(minilm_path, 1, *args, log=log) as (url, _):
        core = _core_pid(log)

        @contextmanager
        def freeze() -> Iterator[Frozen]:
            os.kill(core, signal.SIGSTOP)
            try:
                yield Frozen(slots=0, inputs=0)
            finally:
                os.kill(core, signal.SIGCONT)

        try:
            yield TimeoutServer(url, "api-servers=1", freeze, lambda: log.read_text(errors="replace"))
        finally:
            os.kill(core, signal.SIGCONT)


@pytest.fixture(scope="module", params=("one process", "api-servers=1"))
def server(request: pytest.FixtureRequest, minilm_path: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[TimeoutServer]:
    if request.param == "one process":
        with one_process(minilm_path) as s:
            yield s
    else:
        with split(minilm_path, tmp_path_factory.mktemp("split") / "serve.log") as s:
            yield s


def test_a_frozen_engine_times_requests_out_fails_health_and_recovers(server: TimeoutServer,
                                                                      minilm_engine: Engine) -> None:
    url = server.url
    assert httpx.get(f"{url}/health").status_code == 200
    assert metric(url, "wde_engine_seconds_since_step") < STALL_TIMEOUT_S
    before = {name: metric(url, name) for name in ("wde_inputs_total", "wde_request_timeouts_total")}

    async def two_requests() -> list[tuple[httpx.Response, float]]:
        async with httpx.AsyncClient(timeout=GUARD_S) as client:
            async def timed(path: str, body: dict) -> tuple[httpx.Response, float]:
                start = time.monotonic()
                response = await client.post(f"{url}{path}", json=body)
                return response, time.monotonic() - start

            return await asyncio.gather(timed("/v1/embeddings", {"input": ["waits", "for a frozen engine"]}),
                                        timed("/embed", {"inputs": "waits too"}))

    with server.freeze() as frozen:
        (openai, t1), (tei, t2) = asyncio.run(two_requests())
        for response, took in ((openai, t1), (tei, t2)):
            assert response.status_code == 503, response.text
            assert response.headers["retry-after"] == "5"
            assert REQUEST_TIMEOUT_S * 0.9 <= took < REQUEST_TIMEOUT_S + GUARD_S
        error = openai.json()["error"]
        assert error["code"] == "timeout" and error["type"] == "service_unavailable"
        assert "request timeout of 8 s" in error["message"] and "retrying it later is safe" in error["message"]
        assert tei.json()["error_type"] == "Overloaded" and "request timeout" in tei.json()["error"]

        health = httpx.get(f"{url}/health")  # the engine has not stepped for > 8 s: far past --stall-timeout
        assert health.status_code == 503 and health.json()["error_type"] == "Unhealthy"
        assert "has not finished a step" in health.json()["error"]
        assert metric(url, "wde_engine_seconds_since_step") > STALL_TIMEOUT_S
        assert metric(url, "wde_request_timeouts_total") - before["wde_request_timeouts_total"] == 2 + frozen.slots
        assert metric(url, "wde_requests_total", route="/embed", status="503") >= 1

    poll(lambda: httpx.get(f"{url}/health").status_code == 200)
    assert metric(url, "wde_engine_seconds_since_step") < STALL_TIMEOUT_S
    good = httpx.post(f"{url}/v1/embeddings", json={"input": "after the freeze"}, timeout=GUARD_S)
    assert good.status_code == 200
    got = np.array(good.json()["data"][0]["embedding"])
    assert np.abs(got - minilm_engine.embed("after the freeze")).max() <= 1e-5
    # the timed-out requests were aborted in the engine: they never ran
    poll(lambda: metric(url, "wde_inputs_total") - before["wde_inputs_total"] == frozen.inputs + 1)
    assert metric(url, "wde_pending_inputs") == 0 and metric(url, "wde_queue_depth") == 0
    assert "no answer within the request timeout" in server.log()


def test_timeouts_are_validated() -> None:
    for name in ("request_timeout", "stall_timeout", "header_timeout", "body_timeout"):
        with pytest.raises(ValueError, match=name):
            ServerConfig(**{name: -1.0})
        with pytest.raises(ValueError, match=name):
            ServerConfig(**{name: float("nan")})
        assert getattr(ServerConfig(**{name: 0.0}), name) == 0.0  # 0: no limit


# ------------------------------------------------------------------------------------------ slow and abandoned clients


def host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one raw HTTP/1.1 answer."""
    top, _, body = raw.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    if headers.get("transfer-encoding") == "chunked":
        chunks = []
        while True:
            size, _, body = body.partition(b"\r\n")
            if int(size, 16) == 0:
                break
            chunks.append(body[:int(size, 16)])
            body = body[int(size, 16) + 2:]
        body = b"".join(chunks)
    return int(lines[0].split()[1]), headers, body


def statuses(url: str, status: int) -> float:
    """wde_requests_total{status=...} summed over routes."""
    text = httpx.get(f"{url}/metrics").text
    return sum(float(v) for v in re.findall(rf'^wde_requests_total{{[^}}]*status="{status}"[^}}]*}} (\S+)$', text,
                                            re.M))


def test_slowloris_connections_get_408_and_are_closed(server: TimeoutServer) -> None:
    """150 connections sending a header line every 0.25 s and never finishing, 50 sending nothing: all closed
    after --header-timeout (the first ones with a 408 in their route's shape), while a good request is served."""
    url = server.url
    before = metric(url, "wde_requests_total", route="other", status="408")

    async def scenario() -> tuple[list[bytes], list[bytes], httpx.Response]:
        host, port = host_port(url)
        slow = [await asyncio.open_connection(host, port) for _ in range(150)]
        silent = [await asyncio.open_connection(host, port) for _ in range(50)]
        for i, (_, writer) in enumerate(slow):
            writer.write(f"POST {'/embed' if i % 2 else '/v1/embeddings'} HTTP/1.1\r\nHost: test\r\n".encode())
        tricklers = [asyncio.ensure_future(trickle(writer, b"X-Slow: 1\r\n")) for _, writer in slow]
        async with httpx.AsyncClient(timeout=GUARD_S) as client:
            good = await client.post(f"{url}/embed", json={"inputs": "served meanwhile"})
        try:
            slow_answers = await asyncio.wait_for(asyncio.gather(*(r.read() for r, _ in slow)), GUARD_S)
            silent_answers = await asyncio.wait_for(asyncio.gather(*(r.read() for r, _ in silent)), GUARD_S)
        finally:
            for task in tricklers:
                task.cancel()
            for _, writer in slow + silent:
                writer.close()
        return slow_answers, silent_answers, good

    slow, silent, good = asyncio.run(scenario())
    assert good.status_code == 200
    assert silent == [b""] * 50  # sent nothing: closed without an answer
    for i, raw in enumerate(slow):
        status, headers, body = parse(raw)
        assert status == 408 and headers["connection"] == "close", raw
        if i % 2:  # /embed: TEI's shape
            assert json.loads(body) == {"error": "the request headers did not arrive within 1 s (wde serve"
                                                 " --header-timeout)", "error_type": "Validation"}
        else:
            assert json.loads(body)["error"]["code"] == "client_timeout"
    assert metric(url, "wde_requests_total", route="other", status="408") - before == 200
    assert httpx.get(f"{url}/health").status_code == 200


def test_a_slow_body_gets_408_in_its_routes_shape_and_the_connection_closes(server: TimeoutServer) -> None:
    url = server.url
    before = {path: metric(url, "wde_requests_total", route=path, status="408")
              for path in ("/v1/embeddings", "/embed")}

    async def slow_body(path: str) -> tuple[bytes, float]:
        body = json.dumps({"input" if path.startswith("/v1") else "inputs": "a body sent a byte at a time"}).encode()
        reader, writer = await asyncio.open_connection(*host_port(url))
        start = time.monotonic()
        writer.write(head(path, len(body)) + body[:5])
        sending = asyncio.ensure_future(trickle(writer, b" ", every=0.2))  # still sending, never finishing
        try:
            return await asyncio.wait_for(reader.read(), GUARD_S), time.monotonic() - start
        finally:
            sending.cancel()
            writer.close()

    async def both() -> list[tuple[bytes, float]]:
        return await asyncio.gather(slow_body("/v1/embeddings"), slow_body("/embed"))

    (openai, t1), (tei, t2) = asyncio.run(both())
    for raw, took in ((openai, t1), (tei, t2)):
        status, headers, _ = parse(raw)
        assert status == 408 and headers["connection"] == "close" and "x-request-id" in headers, raw
        assert took >= 0.9
    error = json.loads(parse(openai)[2])["error"]
    assert error["code"] == "client_timeout" and "--body-timeout" in error["message"]
    assert json.loads(parse(tei)[2])["error_type"] == "Validation"
    for path, count in before.items():
        assert metric(url, "wde_requests_total", route=path, status="408") - count == 1
    assert server.log().count("did not arrive within 1 s of its headers") >= 2


def test_clients_hanging_up_free_their_slots_at_once_and_are_499s_in_one_line(server: TimeoutServer) -> None:
    """Every slot (--max-concurrent-requests) taken by requests waiting in a frozen engine, and 30 more clients
    sending half a body: all hang up. Their slots are free at once (a good request is admitted while the engine is
    still frozen), their inputs never run, and each is a 499 and one log line: no 500, no traceback."""
    url = server.url
    before = {"499": statuses(url, 499), "500": statuses(url, 500), "inputs": metric(url, "wde_inputs_total")}
    logged = len(server.log())
    host, port = host_port(url)

    async def scenario() -> tuple[httpx.Response, httpx.Response, int, int]:
        async with httpx.AsyncClient(timeout=GUARD_S) as client:
            async def active() -> float:
                text = (await client.get(f"{url}/metrics")).text
                found = re.search(r"^wde_active_requests(?:{[^}]*})? (\S+)$", text, re.M)
                return float(found.group(1)) if found else 0.0

            async def until(what: Callable[[float], bool]) -> None:
                deadline = time.monotonic() + GUARD_S
                while not what(await active()):
                    assert time.monotonic() < deadline, "timed out waiting"
                    await asyncio.sleep(0.05)

            with server.freeze() as frozen:
                waiting = []
                for i in range(LIMIT - frozen.slots):  # every slot taken
                    body = json.dumps({"input": [f"abandoned request {i}", "it never runs"]}).encode()
                    reader, writer = await asyncio.open_connection(host, port)
                    writer.write(head("/v1/embeddings", len(body)) + body)
                    waiting.append(writer)
                await until(lambda n: n >= LIMIT)
                refused = await client.post(f"{url}/v1/embeddings", json={"input": "one too many"})
                half = []
                for i in range(30):
                    body = json.dumps({"input": [f"half a body {i}"] * 20}).encode()
                    reader, writer = await asyncio.open_connection(host, port)
                    writer.write(head("/v1/embeddings", len(body)) + body[: len(body) // 2])
                    await writer.drain()
                    half.append(writer)
                for writer in waiting + half:
                    writer.close()
                await until(lambda n: n <= frozen.slots)  # the slots are free while the engine is still frozen
                good = asyncio.ensure_future(client.post(f"{url}/v1/embeddings", json={"input": "a good request"}))
                await asyncio.sleep(0.3)
            return refused, await good, len(waiting), frozen.inputs

    refused, good, waited, freeze_inputs = asyncio.run(scenario())
    assert refused.status_code == 429  # the slots really were all taken
    assert good.status_code == 200
    poll(lambda: statuses(url, 499) - before["499"] == waited + 30)
    assert statuses(url, 500) == before["500"]
    # the abandoned inputs never ran: only the freeze's own and the good request's
    poll(lambda: metric(url, "wde_inputs_total") - before["inputs"] >= freeze_inputs + 1)
    assert metric(url, "wde_inputs_total") - before["inputs"] == freeze_inputs + 1
    log = server.log()[logged:]
    assert "Traceback" not in log and "Exception in ASGI application" not in log
    assert log.count("the client closed the connection before its answer was ready (499)") == waited
    assert log.count("the client closed the connection while sending its body (499)") == 30
