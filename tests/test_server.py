"""`wde serve` over real HTTP: a uvicorn server on a free loopback port, driven with httpx and the openai client."""

from __future__ import annotations

import asyncio
import base64
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import httpx
import numpy as np
import pytest
import uvicorn

from wde import Engine
from wde.server import ServerConfig, create_app

MODEL = "minilm"
TEXTS = ["A man is eating food.", "The new movie is awesome", "Berlin has 3.5 million people.", "hello"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(engine: Engine, **config: object) -> Iterator[tuple[str, object]]:
    """Run the app in a uvicorn thread; yields (base url, app) and shuts the server down after."""
    port = free_port()
    app = create_app(engine, ServerConfig(port=port, **config))  # type: ignore[arg-type]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(30)


REPO = Path(__file__).resolve().parents[1]


@contextmanager
def serve_split(model: Path, api_servers: int, *args: str, log: Path | None = None,
                stop: bool = True) -> Iterator[tuple[str, subprocess.Popen]]:
    """`wde serve --api-servers N` (engine core + N API-server processes) as a subprocess, with the fault
    components of tests/faults.py registered; yields (base url, process) and stops it with SIGTERM after."""
    port = free_port()
    log_file = open(log, "wb") if log is not None else tempfile.TemporaryFile()  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "serve_with_faults.py"), "serve", "--model", str(model),
         "--port", str(port), "--api-servers", str(api_servers), *args],
        stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, lambda: proc.poll() is None, timeout=300)  # 3 processes load torch on a busy machine
        except AssertionError:
            log_file.seek(0)
            raise AssertionError(f"the split server did not start:\n{log_file.read().decode()[-3000:]}") from None
        yield url, proc
    finally:
        stop_server(proc, terminate=stop)
        log_file.close()


def stop_server(proc: subprocess.Popen, terminate: bool = True) -> None:
    """Stop a `wde serve` subprocess as a supervisor would: SIGTERM (unless `terminate` is false: the test
    already made it stop), 60 s to finish, then SIGKILL."""
    if proc.poll() is None and terminate:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_healthy(url: str, alive: Callable[[], bool], timeout: float = 120) -> None:
    """Poll `url`/health until it answers 200; fail if `alive()` turns false or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert alive() and time.monotonic() < deadline, f"the server at {url} did not become healthy"
        time.sleep(0.05)


def metric(base: str, name: str, **labels: str) -> float:
    """The server's /metrics samples of `name` whose labels include `labels`, summed (0 when absent): engine
    series carry a `model` label, summed over the served models unless `model=` is given."""
    text = httpx.get(f"{base}/metrics").text
    total = 0.0
    for found in re.finditer(rf"^{re.escape(name)}(?:{{(.*)}})? (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', found.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(found.group(2))
    return total


SPLIT = ("api-servers=1", "api-servers=2")
"""The suite runs against one process and against the engine core split from 1 and 2 API-server processes."""


@pytest.fixture(scope="module", params=("one process", *SPLIT))
def server(request: pytest.FixtureRequest, minilm_path: Path) -> Iterator[tuple[str, object]]:
    """(url, app); app is None for a split server (its engine lives in another process)."""
    if request.param in SPLIT:
        with serve_split(minilm_path, int(request.param[-1]), "--served-model-name", MODEL,
                         "--max-client-batch-size", "64") as (url, _):
            yield url, None
        return
    with Engine.from_workflow("bert", minilm_path) as engine, \
            serve(engine, served_model_name=MODEL, max_client_batch_size=64) as running:
        yield running


def in_process(server: tuple[str, object]) -> object:
    """The app of an in-process server; a split server skips (tests/test_split_server.py covers it there)."""
    if server[1] is None:
        pytest.skip("reaches into the in-process engine; tests/test_split_server.py tests this across processes")
    return server[1]


@pytest.fixture(scope="module")
def url(server: tuple[str, object]) -> str:
    return server[0]


def test_embeddings_equal_offline_engine(url: str, minilm_engine: Engine) -> None:
    r = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS, "model": MODEL})
    assert r.status_code == 200, r.text
    body = r.json()
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    assert np.abs(got - minilm_engine.embed(TEXTS)).max() <= 1e-5
    ids = [o.num_prompt_tokens for o in minilm_engine.encode(TEXTS)]
    assert body["usage"] == {"prompt_tokens": sum(ids), "total_tokens": sum(ids)}
    assert body["model"] == MODEL and body["object"] == "list"


def test_token_id_inputs_equal_text_inputs(url: str, minilm_engine: Engine) -> None:
    ids = [o.prompt_token_ids for o in minilm_engine.encode(TEXTS[:2])]
    expected = minilm_engine.embed(TEXTS[:2])
    one = httpx.post(f"{url}/v1/embeddings", json={"input": ids[0]}).json()
    many = httpx.post(f"{url}/v1/embeddings", json={"input": ids}).json()
    assert np.abs(np.array(one["data"][0]["embedding"]) - expected[0]).max() <= 1e-5
    assert np.abs(np.array([d["embedding"] for d in many["data"]]) - expected).max() <= 1e-5


def test_openai_client_base64_and_dimensions(url: str, minilm_engine: Engine) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    full = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 by default
    got = np.array([d.embedding for d in full.data], dtype=np.float32)
    assert np.abs(got - minilm_engine.embed(TEXTS)).max() <= 1e-5
    short = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=64, encoding_format="float")
    truncated = minilm_engine.embed(TEXTS[0], normalize=False)[:64]
    vec = np.array(short.data[0].embedding)
    assert vec.shape == (64,) and abs(np.linalg.norm(vec) - 1) < 1e-5
    assert np.abs(vec - truncated / np.linalg.norm(truncated)).max() <= 1e-5
    raw = httpx.post(f"{url}/v1/embeddings", json={"input": "hi", "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.abs(decoded - minilm_engine.embed("hi")).max() <= 1e-5


def test_tei_embed_and_timing_headers(url: str, minilm_engine: Engine) -> None:
    r = httpx.post(f"{url}/embed", json={"inputs": TEXTS})
    assert r.status_code == 200
    assert np.abs(np.array(r.json()) - minilm_engine.embed(TEXTS)).max() <= 1e-5
    for header in ("x-compute-time", "x-queue-time", "x-inference-time", "x-tokenization-time"):
        assert int(r.headers[header]) >= 0
    single = httpx.post(f"{url}/embed", json={"inputs": TEXTS[0], "normalize": False}).json()
    assert np.abs(np.array(single[0]) - minilm_engine.embed(TEXTS[0], normalize=False)).max() <= 1e-5
    assert abs(np.linalg.norm(single[0]) - 1) > 1e-3


def test_pooling_and_score_on_an_embedder(url: str, minilm_engine: Engine) -> None:
    r = httpx.post(f"{url}/pooling", json={"input": TEXTS[:2]}).json()
    assert np.abs(np.array([d["data"] for d in r["data"]]) - minilm_engine.embed(TEXTS[:2])).max() <= 1e-5
    s = httpx.post(f"{url}/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:3]}).json()
    e = minilm_engine.embed(TEXTS[:3])
    assert [d["score"] for d in s["data"]] == pytest.approx([float(e[0] @ e[1]), float(e[0] @ e[2])], abs=1e-5)


def test_info_models_health_tokenize(url: str, minilm_engine: Engine) -> None:
    info = httpx.get(f"{url}/info").json()
    assert info["max_client_batch_size"] == 64 and info["max_input_length"] == minilm_engine.max_length
    assert info["model_type"] == {"embedding": {"pooling": "mean"}} and info["served_model_name"] == MODEL
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == MODEL
    tokens = httpx.post(f"{url}/tokenize", json={"inputs": "Hello world"}).json()[0]
    assert [t["id"] for t in tokens] == minilm_engine.encode(["Hello world"])[0].prompt_token_ids
    assert tokens[1] == {"id": tokens[1]["id"], "text": "Hello", "special": False, "start": 0, "stop": 5}
    assert tokens[0]["special"] and tokens[0]["start"] is None


@pytest.mark.parametrize("path,body,status,style,needle", [
    ("/v1/embeddings", {"input": ""}, 400, "openai", "empty"),
    ("/v1/embeddings", {"input": []}, 400, "openai", "empty"),
    ("/embed", {"inputs": ["ok", "  "]}, 400, "tei", "inputs[1] is empty"),
    ("/v1/embeddings", {"input": ["x"] * 65}, 422, "openai", "batch size 65 > maximum allowed batch size 64"),
    ("/embed", {"inputs": ["x"] * 65}, 422, "tei", "batch size 65 > maximum allowed batch size 64"),
    ("/v1/embeddings", {"input": "word " * 300}, 422, "openai", "more than the limit of 256"),
    ("/embed", {"inputs": "word " * 300}, 422, "tei", "more than the limit of 256"),
    ("/v1/embeddings", {"input": 5}, 422, "openai", "input:"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, 422, "openai", "encoding_format"),
    ("/embed", {"inputs": "x", "truncation_direction": "up"}, 422, "tei", "truncation_direction"),
    ("/v1/embeddings", {"input": "x", "dimensions": 1000}, 422, "openai", "dimensions=1000"),
    ("/embed", {"inputs": ["x", "y"], "dimensions": 385}, 422, "tei", "embedding size 384"),
    ("/v1/embeddings", {"input": ["x", "y"], "prompt_name": "nope"}, 422, "openai", "'nope' is not defined"),
    ("/v1/embeddings", {"input": "x", "model": "gpt-4"}, 404, "openai", "'gpt-4' is not served"),
    ("/rerank", {"query": "q", "texts": []}, 400, "tei", "texts is empty"),
    ("/rerank", {"query": "q", "documents": ["a"], "raw_scores": True, "model": "x"}, 404, "openai", "not served"),
    ("/classify", {"input": "a"}, 424, "openai", "classifier"),
    ("/predict", {"inputs": "a"}, 424, "tei", "produces ['dense']"),
    ("/embed_sparse", {"inputs": "a"}, 424, "tei", "sparse"),
    ("/v1/embeddings", [1, 2], 422, "openai", "JSON object"),
])
def test_errors_have_status_shape_and_message(url: str, path: str, body: object, status: int, style: str,
                                              needle: str) -> None:
    r = httpx.post(f"{url}{path}", json=body)
    assert r.status_code == status, r.text
    err = r.json()
    if style == "tei":
        assert set(err) == {"error", "error_type"} and needle in err["error"]
    else:
        assert set(err["error"]) == {"message", "type", "param", "code"} and needle in err["error"]["message"]
        for option in ("dimensions", "prompt_name"):  # an option's error names the option, not the input
            if option in body:
                assert err["error"]["param"] == option and err["error"]["message"].startswith(option)


def test_truncate_accepts_long_inputs(url: str, minilm_engine: Engine) -> None:
    long = "word " * 300
    r = httpx.post(f"{url}/embed", json={"inputs": long, "truncate": True})
    assert r.status_code == 200
    assert np.abs(np.array(r.json()[0]) - minilm_engine.embed(long, truncate=True)).max() <= 1e-5


def test_invalid_json_is_400(url: str) -> None:
    r = httpx.post(f"{url}/embed", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error_type"] == "Validation"


async def _burst(url: str, clients: int, texts: list[str]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=clients)) as client:
        return await asyncio.gather(*(client.post(f"{url}/v1/embeddings", json={"input": t}) for t in texts))


def test_concurrent_requests_are_batched(url: str, minilm_engine: Engine) -> None:
    texts = [f"sentence number {i} about {TEXTS[i % 4]}" for i in range(96)]
    before_sum, before_count = metric(url, "wde_batch_size_sum"), metric(url, "wde_batch_size_count")
    responses = asyncio.run(_burst(url, 32, texts))
    assert all(r.status_code == 200 for r in responses)
    got = np.array([r.json()["data"][0]["embedding"] for r in responses])
    assert np.abs(got - minilm_engine.embed(texts)).max() <= 1e-5
    inputs = metric(url, "wde_batch_size_sum") - before_sum
    batches = metric(url, "wde_batch_size_count") - before_count
    assert inputs == len(texts) and inputs / batches > 1
    assert metric(url, "wde_requests_total", route="/v1/embeddings", status="200") >= len(texts)


def test_overload_is_429(server: tuple[str, object]) -> None:
    url, app = server[0], in_process(server)
    engine = app.state.service.engine  # type: ignore[attr-defined]
    engine.max_concurrent_requests = 1
    try:
        responses = asyncio.run(_burst(url, 16, TEXTS * 4))
    finally:
        engine.max_concurrent_requests = 512
    codes = [r.status_code for r in responses]
    assert 200 in codes and 429 in codes
    rejected = next(r for r in responses if r.status_code == 429).json()["error"]
    assert rejected["code"] == "overloaded" and "the limit is 1" in rejected["message"]


def test_disconnect_aborts_without_hurting_others(server: tuple[str, object], minilm_engine: Engine) -> None:
    url, app = server[0], in_process(server)
    engine = app.state.service.engine.engine  # type: ignore[attr-defined]
    build = engine.input_builder.build
    release = threading.Event()

    def held(batch):  # noqa: ANN001, ANN202 - keeps the engine busy until the second client has given up
        release.wait(30)
        return build(batch)

    async def scenario() -> tuple[httpx.Response, bool]:
        async with httpx.AsyncClient(timeout=60) as client:
            first = asyncio.ensure_future(client.post(f"{url}/embed", json={"inputs": TEXTS}))
            await asyncio.sleep(0.2)
            try:
                await client.post(f"{url}/embed", json={"inputs": ["gone"] * 3}, timeout=0.3)
                gave_up = False
            except httpx.TimeoutException:
                gave_up = True
            await asyncio.sleep(0.2)
            release.set()
            return await first, gave_up

    aborted_before, inputs_before = metric(url, "wde_aborted_inputs"), metric(url, "wde_inputs_total")
    engine.input_builder.build = held
    try:
        first, gave_up = asyncio.run(scenario())
    finally:
        release.set()
        del engine.input_builder.build
    assert gave_up and first.status_code == 200
    assert np.abs(np.array(first.json()) - minilm_engine.embed(TEXTS)).max() <= 1e-5
    assert metric(url, "wde_aborted_inputs") == aborted_before + 3
    assert httpx.post(f"{url}/embed", json={"inputs": "still serving"}).status_code == 200
    assert metric(url, "wde_inputs_total") - inputs_before == len(TEXTS) + 1  # the aborted ones never ran
    assert metric(url, "wde_pending_inputs") == 0 and metric(url, "wde_queue_depth") == 0


def test_failed_batch_fails_only_its_requests(server: tuple[str, object]) -> None:
    url, app = server[0], in_process(server)
    engine = app.state.service.engine.engine  # type: ignore[attr-defined]
    build = engine.input_builder.build

    def exploding(batch):  # noqa: ANN001, ANN202
        if any(getattr(s.request.prompt, "text", "") == "explode" for s in batch.scheduled):
            raise RuntimeError("boom")
        return build(batch)

    engine.input_builder.build = exploding
    try:
        r = httpx.post(f"{url}/v1/embeddings", json={"input": "explode"}, headers={"x-request-id": "trace-42"})
        message = r.json()["error"]["message"]
        assert r.status_code == 500 and r.headers["x-request-id"] == "trace-42"
        assert "request id trace-42" in message and "boom" not in message and "RuntimeError" not in message
        assert httpx.post(f"{url}/v1/embeddings", json={"input": "fine"}).status_code == 200
    finally:
        del engine.input_builder.build
    assert httpx.get(f"{url}/health").status_code == 200


@pytest.fixture(scope="module")
def tiny_engine(tiny_bert: Path) -> Iterator[Engine]:
    with Engine.from_workflow("bert", tiny_bert, overrides=["pooler.params.pooling=mean"]) as engine:
        yield engine


def test_api_key_and_unhealthy(tiny_engine: Engine) -> None:
    with serve(tiny_engine, api_key="secret") as (url, app):
        assert httpx.get(f"{url}/health").status_code == 200
        denied = httpx.post(f"{url}/v1/embeddings", json={"input": "hi"})
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
        wrong = httpx.post(f"{url}/embed", json={"inputs": "hi"}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "error_type" in wrong.json()
        assert httpx.get(f"{url}/metrics").status_code == 401
        ok = httpx.post(f"{url}/embed", json={"inputs": "hi"}, headers={"Authorization": "Bearer secret"})
        assert ok.status_code == 200
        app.state.service.engine.stop()  # type: ignore[attr-defined]
        assert httpx.get(f"{url}/health").status_code == 503
        down = httpx.post(f"{url}/embed", json={"inputs": "hi"}, headers={"Authorization": "Bearer secret"})
        assert down.status_code == 503 and down.json()["error_type"] == "Unhealthy"
