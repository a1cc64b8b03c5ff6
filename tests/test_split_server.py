"""`wde serve --api-servers N`: the engine core in its own process behind N API-server processes.

The whole HTTP suite (tests/test_server.py) also runs against 1 and 2 API servers; here is what only a split
server has: the wire format, a core that dies or restarts, and the in-process tests that reach into the engine,
redone across processes with the fault components of tests/faults.py (`fault_bert` fails on "poison" and takes
`SLOW_S` seconds on "slow"; `fault_fcfs` crashes the step loop while "crash" waits).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from tests.faults import HANG_GUARD_S, LOAD_GATE, SLOW_S
from tests.test_server import REPO, free_port, metric, serve_split, stop_server, wait_healthy
from wde import Engine
from wde.core import wire
from wde.errors import RequestError
from wde.request import PoolingParams, RequestOutput

FAULTS = ("--set", "model.name=fault_bert", "--set", "scheduler.name=fault_fcfs")


def test_wire_round_trip_keeps_arrays_exact_and_sends_no_float_lists() -> None:
    dense = np.random.default_rng(0).standard_normal(384).astype(np.float32)
    colbert = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]  # not contiguous
    out = RequestOutput("r.a0.1-0", {"dense": dense, "colbert": colbert, "score": np.float32(0.25),
                                     "sparse": {101: 0.5}}, 7, queue_time=0.1, inference_time=0.2)
    payload = wire.encoder.encode(wire.Results([wire.pack_output(out)]))
    assert len(payload) < dense.nbytes + colbert.nbytes + 200  # raw bytes: ~4 bytes a float, not ~12 of text
    back = wire.unpack_output(wire.from_core.decode(payload).outputs[0], [1, 2, 3])
    assert back.outputs["dense"].dtype == np.float32 and np.array_equal(back.outputs["dense"], dense)
    assert np.array_equal(back.outputs["colbert"], colbert) and back.outputs["score"] == 0.25
    assert back.outputs["sparse"] == {101: 0.5} and back.prompt_token_ids == [1, 2, 3]
    assert (back.num_prompt_tokens, back.queue_time, back.inference_time) == (7, 0.1, 0.2)
    failed = RequestOutput("x", error=RequestError("input has 9 tokens, more than 8", "input", "too_long"))
    err = wire.unpack_output(wire.from_core.decode(wire.encoder.encode(wire.Results([wire.pack_output(failed)])))
                             .outputs[0], None).error
    assert (str(err), err.field, err.kind) == ("input has 9 tokens, more than 8", "input", "too_long")
    submit = wire.Submit([wire.Admitted("a", [101, 7, 102], [0, 0, 1], PoolingParams(dimensions=8, outputs=("dense",)))])
    assert wire.to_core.decode(wire.encoder.encode(submit)) == submit


def _core_pid(log: Path) -> int:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        found = re.search(r"engine core pid (\d+)", log.read_text(errors="replace"))
        if found:
            return int(found.group(1))
        time.sleep(0.1)
    raise AssertionError(f"no core pid in the log:\n{log.read_text()[-2000:]}")


async def _post_all(url: str, bodies: list[dict], timeout: float = 60) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=timeout) as client:
        return await asyncio.gather(*(client.post(f"{url}/v1/embeddings", json=b) for b in bodies))


def test_faults_cost_only_their_request_across_processes(minilm_path: Path, minilm_engine: Engine) -> None:
    """Then SIGTERM with a request in flight: it is answered, and the server exits 0."""
    with serve_split(minilm_path, 2, *FAULTS, "--max-concurrent-requests", "2", stop=False) as (url, proc):
        texts = ["poison pill", "a fine sentence", "another fine one", "and one more"]
        responses = asyncio.run(_post_all(url, [{"input": t} for t in texts[:2]]))
        poisoned, fine = responses
        assert poisoned.status_code == 500 and "request id" in poisoned.json()["error"]["message"]
        assert "InjectedFault" not in poisoned.text
        assert fine.status_code == 200
        got = np.array(fine.json()["data"][0]["embedding"])
        assert np.abs(got - minilm_engine.embed(texts[1])).max() <= 1e-5

        # the step loop itself crashes while "crash" waits: waiting callers get 503, the core restarts, serves on
        crashed = httpx.post(f"{url}/v1/embeddings", json={"input": "crash now"}, timeout=60)
        assert crashed.status_code == 503 and "retrying it is safe" in crashed.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/embeddings", json={"input": texts[2]}).status_code == 200
        assert metric(url, "wde_engine_restarts") == 1 and metric(url, "wde_engine_healthy") == 1

        # overload: 2 requests in flight per API server at most (the slow one holds the device)
        slow = {"input": ["slow"] * 2}
        codes = {r.status_code for r in asyncio.run(_post_all(url, [slow] * 8))}
        assert codes == {200, 429}

        # a client that gives up aborts its requests; the others are answered
        async def scenario() -> tuple[httpx.Response, bool]:
            async with httpx.AsyncClient(timeout=60) as client:
                first = asyncio.ensure_future(client.post(f"{url}/embed", json={"inputs": "slow"}))
                await asyncio.sleep(SLOW_S / 3)  # the slow batch runs: "gone" waits in the core's queue
                try:
                    await client.post(f"{url}/embed", json={"inputs": ["gone"] * 3}, timeout=SLOW_S / 6)
                    return await first, False
                except httpx.TimeoutException:
                    return await first, True

        inputs_before, aborted_before = metric(url, "wde_inputs_total"), metric(url, "wde_aborted_inputs")
        first, gave_up = asyncio.run(scenario())
        assert gave_up and first.status_code == 200
        time.sleep(0.5)
        assert metric(url, "wde_aborted_inputs") - aborted_before == 3
        assert metric(url, "wde_inputs_total") - inputs_before == 1  # the aborted ones never ran
        assert metric(url, "wde_pending_inputs") == 0 and metric(url, "wde_queue_depth") == 0
        assert proc.poll() is None

        async def stop_while_busy() -> httpx.Response:
            async with httpx.AsyncClient(timeout=300) as client:
                busy = asyncio.ensure_future(client.post(f"{url}/v1/embeddings", json={"input": "slow"}))
                await asyncio.sleep(SLOW_S / 3)
                proc.send_signal(signal.SIGTERM)
                return await busy

        assert asyncio.run(stop_while_busy()).status_code == 200
        assert proc.wait(60) == 0


def test_a_dead_core_is_seen_at_once_and_the_server_exits_3(minilm_path: Path, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with serve_split(minilm_path, 2, *FAULTS, log=log, stop=False) as (url, proc):
        core = _core_pid(log)

        async def kill_while_waiting() -> list[httpx.Response | BaseException]:
            async with httpx.AsyncClient(timeout=300) as client:
                waiting = [asyncio.ensure_future(client.post(f"{url}/v1/embeddings", json={"input": ["slow", t]}))
                           for t in ("a", "b", "c", "d")]
                await asyncio.sleep(SLOW_S / 3)
                os.kill(core, signal.SIGKILL)
                return await asyncio.gather(*waiting, return_exceptions=True)

        start = time.monotonic()
        answers = asyncio.run(kill_while_waiting())
        assert time.monotonic() - start < 10  # nobody waits for a dead core
        for a in answers:  # 503 from an API server, or the connection closed as the server shut down
            assert isinstance(a, httpx.TransportError) or a.status_code == 503, a
        assert any(isinstance(a, httpx.Response) and "core process exited" in a.text for a in answers)
        assert proc.wait(60) == 3
    assert "engine-core" in log.read_text() and "exited with code" in log.read_text()


def test_api_servers_get_ready_while_the_model_loads(minilm_path: Path, minilm_engine: Engine,
                                                     tmp_path: Path) -> None:
    """The API servers start with the core, not after it: while the model's load is held (`LOAD_GATE`), both
    already run and have torch loaded; once it finishes they serve the model's vectors."""
    gate, log = tmp_path / "gate", tmp_path / "serve.log"
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "serve_with_faults.py"), "serve", "--model", str(minilm_path),
             "--port", str(port), "--api-servers", "2", *FAULTS], stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO), LOAD_GATE: str(gate)})
    try:
        deadline = time.monotonic() + HANG_GUARD_S - 10  # the gate holds the load this long at most
        while True:
            children = _spawned_children(proc.pid)
            if len(children) == 3 and all(_maps(pid, "libtorch_cpu") for pid in children):
                break  # the core and both API servers, libraries imported, while the model cannot finish loading
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        assert "serving model" not in log.read_text()
        gate.touch()
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, lambda: proc.poll() is None, timeout=300)
        got = httpx.post(f"{url}/v1/embeddings", json={"input": "a fine sentence"}, timeout=60)
        assert got.status_code == 200, got.text
        got = np.array(got.json()["data"][0]["embedding"])
        assert np.abs(got - minilm_engine.embed("a fine sentence")).max() <= 1e-5
    finally:
        stop_server(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]


def _spawned_children(pid: int) -> list[int]:
    """The processes `multiprocessing` spawned for `pid` (not its resource tracker), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])  # after the command's name
            if parent == pid and b"spawn_main" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):  # the process ended meanwhile
            continue
    return found


def _maps(pid: int, library: str) -> bool:
    """Whether process `pid` has `library` mapped (it imported it)."""
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def test_bad_api_servers_value_is_refused(minilm_path: Path) -> None:
    from click.testing import CliRunner

    from wde.cli import main

    result = CliRunner().invoke(main, ["serve", "--model", str(minilm_path), "--api-servers", "many"])
    assert result.exit_code == 2 and "--api-servers" in result.output and "0 to 64" in result.output
