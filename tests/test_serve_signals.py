"""`wde serve` as users run it, in its own process: SIGTERM finishes the requests in flight, then exits 0."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import httpx

from tests.test_server import free_port, wait_healthy


def test_sigterm_drains_in_flight_requests_and_exits_0() -> None:
    port = free_port()
    env = {**os.environ, "WDE_DEVICE": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "wde.cli", "serve", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, lambda: proc.poll() is None)

        async def wave() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                sent = [asyncio.ensure_future(client.post(f"{url}/v1/embeddings", json={"input": [f"text {i}"] * 32}))
                        for i in range(16)]
                await asyncio.sleep(0.3)  # the requests are in the server, most still queued
                proc.send_signal(signal.SIGTERM)
                return await asyncio.gather(*sent)

        responses = asyncio.run(wave())
        assert [r.status_code for r in responses] == [200] * 16
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
