"""What the HTTP layer costs per request, without sockets or a load generator: WDE's ASGI app driven in-process.

`create_app` on a model whose forward costs next to nothing (`host_path.py`'s one-layer width-32 BERT, built once), its
engine thread started as `wde serve` starts it, and `--concurrency` requests at a time (single-text POSTs to
`--path`, a fresh ASGI scope each, the body delivered at once, the client never hanging up) sent straight into the app
on one event loop until `--requests` are answered; best of `--repeats`. Prints microseconds of wall time and of the
process's CPU time per request: the middleware, the handler, the serving front end, the engine's host path and the
JSON response, everything but uvicorn and the socket. Less noisy than `serve_load.py` on a small machine (no load
generator sharing the cores, no kernel TCP), so it resolves changes of a few per cent to the request path.

    python benchmarks/asgi_path.py
    python benchmarks/asgi_path.py --path /embed --requests 20000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one tokenizer thread, before the tokenizers library starts its pool
sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_path import null_model  # noqa: E402
from workload import sentences  # noqa: E402


async def call(app: Any, path: str, body: bytes) -> int:
    """One POST through the ASGI app; the response's status (its body must arrive)."""
    sent = False
    gone = asyncio.Event()
    status = 0
    chunks: list[bytes] = []

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()  # the client stays until the answer is in
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"host", b"bench"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000), "state": {}}
    try:
        await app(scope, receive, send)
    finally:
        gone.set()
    if not b"".join(chunks):
        raise RuntimeError(f"{path}: an empty response (status {status})")
    return status


async def drive(app: Any, path: str, bodies: list[bytes], concurrency: int) -> tuple[float, float]:
    """Send every body with `concurrency` in flight; (wall seconds, CPU seconds)."""
    queue = iter(bodies)

    async def worker() -> None:
        for body in queue:
            status = await call(app, path, body)
            if status != 200:
                raise RuntimeError(f"{path} answered {status}")

    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (the best is reported)")
    parser.add_argument("--path", default="/v1/embeddings", help="/v1/embeddings, /embeddings or /embed")
    parser.add_argument("--model", default=None, help="model folder (default: the one-layer width-32 BERT, built once)")
    parser.add_argument("--tokenizer", default=None, type=Path,
                        help="folder whose tokenizer the built model takes (default: the bundled MiniLM's)")
    args = parser.parse_args()

    import torch

    from wde import Engine
    from wde.server import ServerConfig, create_app
    from wde.server.heap import frozen_heap

    torch.set_num_threads(1)
    model = args.model or str(null_model(Path(tempfile.gettempdir()) / "wde-host-path-bert", args.tokenizer))
    key = "inputs" if args.path == "/embed" else "input"
    bodies = [json.dumps({key: text}).encode() for text in sentences(args.requests)]
    with Engine.from_workflow(None, model) as engine:
        app = create_app(engine, ServerConfig())

        async def run() -> list[tuple[float, float]]:
            async with app.router.lifespan_context(app):  # starts and stops the engine thread, as uvicorn does
                await drive(app, args.path, bodies[:args.concurrency * 4], args.concurrency)  # warm-up
                return [await drive(app, args.path, bodies, args.concurrency) for _ in range(args.repeats)]

        with frozen_heap():  # as `wde serve` runs
            runs = asyncio.run(run())
    wall, cpu = min(runs)
    n = len(bodies)
    print(f"asgi path: {n} requests to {args.path}, {args.concurrency} at a time, torch {torch.__version__}")
    print(f"per request: {wall / n * 1e6:7.1f} us wall, {cpu / n * 1e6:7.1f} us CPU -> {n / wall:,.0f} requests/s"
          f"  (runs: {', '.join(f'{n / w:,.0f}' for w, _ in runs)} requests/s)")


if __name__ == "__main__":
    main()
