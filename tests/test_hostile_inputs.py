"""Hostile input against every route that takes text: each answer is a JSON error naming the field, and the
server answers a good request on the same route right after. Also: strict bodies, size and nesting limits,
internal errors without internals, fault injection and the supervised loop behind real HTTP."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from click.testing import CliRunner

from tests import faults, tiny_heads
from tests.test_server import free_port, metric, serve, wait_healthy
from tests.test_server_tasks import cross_encoder_path  # noqa: F401 - a fixture
from wde import Engine
from wde.server import ServerConfig

LONG = "word " * 600  # over every served model's limit (MiniLM 256, the cross-encoder 512 tokens)


@pytest.fixture(autouse=True)
def quiet_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL + 1)  # injected faults log tracebacks on purpose


@pytest.fixture(scope="module")
def servers(minilm_path: Path, cross_encoder_path: Path,  # noqa: F811
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """One server per kind of model, so every text route is served by a workflow that accepts it."""
    classifier = tiny_heads.build_minilm_classifier(minilm_path, tmp_path_factory.mktemp("clf"), num_labels=3)
    bge_m3 = tiny_heads.build_bge_m3(tmp_path_factory.mktemp("bge-m3"))
    specs = {"embedder": ("bert", minilm_path), "reranker": ("cross_encoder", cross_encoder_path),
             "classifier": ("sequence_classification", classifier), "bge_m3": ("bge_m3", bge_m3)}
    overrides = {"embedder": ["pooler.name=sentence_tokens"]}  # /embed_all too
    engines = {k: Engine.from_workflow(w, m, overrides=overrides.get(k)) for k, (w, m) in specs.items()}
    contexts = {k: serve(e, payload_limit=200_000) for k, e in engines.items()}
    try:
        yield {k: ctx.__enter__()[0] for k, ctx in contexts.items()}
    finally:
        for ctx in contexts.values():
            ctx.__exit__(None, None, None)
        for e in engines.values():
            e.close()


H = "<hostile>"
# (server, route, body with H where the hostile text goes, the field the error must name, a good body)
TEXT_FIELDS = [
    ("embedder", "/v1/embeddings", {"input": H}, "input", {"input": "fine"}),
    ("embedder", "/v1/embeddings", {"input": ["ok", H]}, "input[1]", {"input": ["a", "b"]}),
    ("embedder", "/embed", {"inputs": [H, "ok"]}, "inputs[0]", {"inputs": "fine"}),
    ("embedder", "/pooling", {"input": H}, "input", {"input": "fine"}),
    ("embedder", "/score", {"text_1": H, "text_2": ["a", "b"]}, "text_1", {"text_1": "a", "text_2": "b"}),
    ("embedder", "/score", {"text_1": "a", "text_2": ["b", H]}, "text_2[1]", {"text_1": "a", "text_2": "b"}),
    ("embedder", "/tokenize", {"inputs": ["ok", H]}, "inputs[1]", {"inputs": "fine"}),
    ("embedder", "/v2/embed", {"texts": ["ok", H], "truncate": "NONE"}, "texts[1]", {"texts": ["fine"]}),
    ("embedder", "/v2/embed", {"inputs": [{"content": [{"type": "text", "text": H}]}], "truncate": "NONE"},
     "inputs[0].content[0].text", {"texts": ["fine"]}),
    ("embedder", "/v1/score", {"text_1": "a", "text_2": [H]}, "text_2[0]", {"text_1": "a", "text_2": "b"}),
    ("embedder", "/embed_all", {"inputs": ["ok", H]}, "inputs[1]", {"inputs": "fine"}),
    ("embedder", "/similarity", {"inputs": {"source_sentence": H, "sentences": ["a"]}}, "inputs.source_sentence",
     {"inputs": {"source_sentence": "a", "sentences": ["b"]}}),
    ("embedder", "/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b", H]}}, "inputs.sentences[1]",
     {"inputs": {"source_sentence": "a", "sentences": ["b"]}}),
    ("reranker", "/rerank", {"query": H, "documents": ["a", "b"]}, "query", {"query": "q", "documents": ["a"]}),
    ("reranker", "/v1/rerank", {"query": "q", "documents": ["a", H]}, "documents[1]",
     {"query": "q", "documents": ["a"]}),
    ("reranker", "/rerank", {"query": "q", "texts": [H]}, "texts[0]", {"query": "q", "texts": ["a"]}),
    ("reranker", "/v2/rerank", {"query": "q", "documents": ["a", H]}, "documents[1]",
     {"query": "q", "documents": ["a"]}),
    ("reranker", "/score", {"text_1": ["a", H], "text_2": ["b", "c"]}, "text_1[1]", {"text_1": "a", "text_2": "b"}),
    ("reranker", "/predict", {"inputs": [["q", H]]}, "inputs[0][1]", {"inputs": ["q", "d"]}),
    ("classifier", "/classify", {"input": ["ok", H]}, "input[1]", {"input": "fine"}),
    ("classifier", "/predict", {"inputs": H}, "inputs", {"inputs": "fine"}),
    ("bge_m3", "/embed_sparse", {"inputs": [H]}, "inputs[0]", {"inputs": "fine"}),
]
TEI = {"/embed", "/embed_all", "/embed_sparse", "/tokenize", "/predict", "/similarity", "/decode"}


def fill(body: Any, value: Any) -> Any:
    if body == H:
        return value
    if isinstance(body, dict):
        return {k: fill(v, value) for k, v in body.items()}
    if isinstance(body, list):
        return [fill(v, value) for v in body]
    return body


def post(url: str, path: str, body: Any = None, raw: bytes | None = None,
         headers: dict[str, str] | None = None) -> httpx.Response:
    """POST `body` as JSON with \\u escapes (so a lone surrogate travels as the escape), or `raw` bytes."""
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=content, timeout=60,
                      headers={"content-type": "application/json", **(headers or {})})


def error_of(r: httpx.Response, path: str, body: Any) -> tuple[str, str | None]:
    """(message, field) from either error shape; the shape must be the one the route's clients expect."""
    assert r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()
    if path in TEI or (path == "/rerank" and "texts" in body):
        assert set(err) == {"error", "error_type"}, err
        return err["error"], None
    assert set(err["error"]) == {"message", "type", "param", "code"}, err
    return err["error"]["message"], err["error"]["param"]


# Each hostile text: the status it must get and words its message must contain.
HOSTILE = {
    "lone_surrogate": ("\ud800", 400, "not valid Unicode"),
    "raw_surrogate_bytes": (b"\xed\xa0\x80", 400, "not valid Unicode"),
    "surrogate_inside_text": ("caf\udcc3 au lait", 400, "lone surrogate"),
    "empty": ("", 400, "empty"),
    "whitespace": (" \n\t ", 400, "empty"),
    "too_long": (LONG, 422, "tokens"),
}


@pytest.mark.parametrize("hostile", list(HOSTILE))
@pytest.mark.parametrize(("server", "path", "template", "field", "good"), TEXT_FIELDS,
                         ids=[f"{s}{p}:{f}" for s, p, _, f, _ in TEXT_FIELDS])
def test_hostile_text_is_refused_by_name_and_the_next_request_succeeds(
        servers: dict[str, str], server: str, path: str, template: dict, field: str, good: dict, hostile: str) -> None:
    url = servers[server]
    value, status, needle = HOSTILE[hostile]
    if path == "/tokenize" and hostile == "too_long":
        pytest.skip("/tokenize has no token limit")
    if isinstance(value, bytes):
        marker = "@@HOSTILE@@"
        raw = json.dumps(fill(template, marker)).encode().replace(marker.encode(), value)
        r = post(url, path, raw=raw)
    else:
        r = post(url, path, fill(template, value))
    assert r.status_code == status, r.text
    message, param = error_of(r, path, template)
    assert needle in message
    if hostile != "too_long":  # a too-long pair is named by its second text, the one truncation would cut
        assert message.startswith(field) and (param is None or param == field), (message, param)
    after = post(url, path, good)
    assert after.status_code == 200, after.text
    assert httpx.get(f"{url}/health").status_code == 200


WEIRD_BUT_VALID = ["a\x00b", "\u200b\u200bzero width", "emoji 🤖🎉", "RTL \u202e txet", "e\u0301\u0301\u0301",
                   "\x7f\x1b[31mansi", "💩" * 200, "\ufeffbom"]


@pytest.mark.parametrize("text", WEIRD_BUT_VALID)
def test_odd_but_valid_text_is_served(servers: dict[str, str], text: str) -> None:
    r = post(servers["embedder"], "/v1/embeddings", {"input": text, "truncate": True})
    assert r.status_code == 200, r.text
    assert post(servers["embedder"], "/tokenize", {"inputs": text}).status_code == 200


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/embeddings", {"input": [True, False]}, "input"),
    ("/v1/embeddings", {"input": "x", "truncate": "yes"}, "truncate"),
    ("/v1/embeddings", {"input": "x", "dimensions": True}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "dimensions": 64.0}, "dimensions"),
    ("/embed", {"inputs": "x", "normalize": 1}, "normalize"),
    ("/embed", {"inputs": [1.5, 2]}, "inputs"),
    ("/pooling", {"input": "x", "outputs": "dense"}, "outputs"),
    ("/tokenize", {"inputs": "x", "add_special_tokens": "false"}, "add_special_tokens"),
    ("/score", {"text_1": 1, "text_2": "b"}, "text_1"),
    ("/v2/embed", {"texts": "one text"}, "texts"),
    ("/v2/embed", {"texts": ["x"], "output_dimension": 64.0}, "output_dimension"),
    ("/v1/embeddings", {"input": "x", "embed_dtype": 8}, "embed_dtype"),
    ("/decode", {"ids": [1.0, 2]}, "ids"),
    ("/decode", {"ids": [1], "skip_special_tokens": 0}, "skip_special_tokens"),
])
def test_no_lenient_coercion(servers: dict[str, str], path: str, body: dict, field: str) -> None:
    r = post(servers["embedder"], path, body)
    assert r.status_code == 422, r.text
    message, param = error_of(r, path, body)
    assert field in message and (param is None or param.startswith(field))


@pytest.mark.parametrize("path", ["/v1/embeddings", "/embed", "/tokenize", "/score", "/rerank", "/pooling"])
def test_deeply_nested_json_is_a_json_400(servers: dict[str, str], path: str) -> None:
    for raw in (b"[" * 100_000, b'{"input": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"):
        r = post(servers["embedder"], path, raw=raw)
        assert r.status_code in (400, 422) and r.headers["content-type"].startswith("application/json"), r.text
    assert post(servers["embedder"], "/embed", {"inputs": "still fine"}).status_code == 200


def test_payload_limit_is_413_before_the_body_is_read(servers: dict[str, str]) -> None:
    url = servers["embedder"]
    big = {"input": "x", "padding": "y" * 300_000}  # an unknown field: ignored, but it still counts
    r = post(url, "/v1/embeddings", big)
    assert r.status_code == 413 and "limit of 200000 bytes" in r.json()["error"]["message"]
    tei = post(url, "/embed", {"inputs": "z" * 300_000})
    assert tei.status_code == 413 and tei.json()["error_type"] == "Validation"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while the body streams in
        yield b'{"input": "'
        for _ in range(40):
            yield b"a" * 10_000
        yield b'"}'

    streamed = httpx.post(f"{url}/v1/embeddings", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413
    assert post(url, "/v1/embeddings", {"input": "small"}).status_code == 200


EVIL = "https://evil.example"
# What a web page can make a browser send, and bodies in a type or encoding the server does not take: (headers,
# status, words the message must contain). A "simple" cross-origin request (text/plain, form data) needs no CORS
# preflight, so without these checks any page the user visits could use a key-less server on localhost.
NOT_JSON = [
    ({"content-type": "text/plain"}, 415, "is not JSON"),
    ({"content-type": "application/x-www-form-urlencoded"}, 415, "is not JSON"),
    ({"content-type": "multipart/form-data; boundary=x"}, 415, "is not JSON"),
    ({}, 415, "no Content-Type"),
    ({"content-type": "application/json; charset=iso-8859-1"}, 415, "UTF-8"),
    ({"content-type": "application/json", "content-encoding": "br"}, 415, "Content-Encoding 'br'"),
    ({"content-type": "application/json", "origin": EVIL}, 403, "origin 'https://evil.example' is not allowed"),
    ({"content-type": "text/plain", "origin": EVIL}, 403, "--allowed-origins"),
    ({"content-type": "application/json", "origin": "null"}, 403, "origin 'null'"),
    ({"content-type": "application/json; charset=utf-8"}, 200, None),
    ({"content-type": "Application/JSON; Charset=\"UTF-8\""}, 200, None),
    ({"content-type": "application/vnd.api+json"}, 200, None),
    ({"content-type": "application/json", "content-encoding": "identity"}, 200, None),
]
JSON_ROUTES = [("/v1/embeddings", {"input": "fine"}), ("/embed", {"inputs": "fine"}), ("/v2/embed", {"texts": ["x"]}),
               ("/tokenize", {"inputs": "fine"}), ("/score", {"text_1": "a", "text_2": "b"})]


@pytest.mark.parametrize(("headers", "status", "needle"), NOT_JSON, ids=[
    "+".join(f"{k}={v}" for k, v in h.items()) or "no-content-type" for h, _, _ in NOT_JSON])
@pytest.mark.parametrize(("path", "body"), JSON_ROUTES, ids=[p for p, _ in JSON_ROUTES])
def test_only_json_bodies_and_no_browser_origins_by_default(servers: dict[str, str], path: str, body: dict,
                                                            headers: dict[str, str], status: int,
                                                            needle: str | None) -> None:
    url = servers["reranker" if path == "/score" else "embedder"]
    r = httpx.post(f"{url}{path}", content=json.dumps(body).encode(), headers=headers, timeout=60)
    assert r.status_code == status, r.text
    if needle is not None:
        message, _ = error_of(r, path, body)
        assert needle in message, message
        assert "access-control-allow-origin" not in r.headers
    if status == 415:
        assert r.headers.get("accept-encoding" if "content-encoding" in headers else "accept-post") in (
            "gzip", "application/json")


def test_a_cors_preflight_is_refused_without_allowed_origins(servers: dict[str, str]) -> None:
    r = httpx.options(f"{servers['embedder']}/v1/embeddings",
                      headers={"origin": "http://localhost:3000", "access-control-request-method": "POST"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    assert "--allowed-origins" in r.json()["error"]["message"]


def test_unknown_routes_and_methods_answer_json(servers: dict[str, str]) -> None:
    url = servers["embedder"]
    missing = httpx.post(f"{url}/v2/nothing", json={})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = httpx.get(f"{url}/v1/embeddings")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "not_allowed"
    assert "allow" in wrong.headers


def test_no_local_paths_in_any_response(servers: dict[str, str], minilm_path: Path) -> None:
    url = servers["embedder"]
    for r in (httpx.get(f"{url}/v1/models"), httpx.get(f"{url}/info"), post(url, "/v1/embeddings", {"input": "x"}),
              post(url, "/v1/embeddings", {"input": ""})):
        assert str(minilm_path) not in r.text and "site-packages" not in r.text and "/tmp" not in r.text
    card = httpx.get(f"{url}/v1/models").json()["data"][0]
    assert card["root"] == card["id"]


def test_a_model_folder_is_served_under_its_name(tiny_bert: Path) -> None:
    from wde.server.model_config import public_name

    assert public_name(str(tiny_bert)) == tiny_bert.name
    assert public_name("BAAI/bge-m3") == "BAAI/bge-m3"


def test_empty_api_key_is_refused_at_startup() -> None:
    with pytest.raises(ValueError, match="api_key is empty"):
        ServerConfig(api_key="")
    from wde.cli import main

    result = CliRunner().invoke(main, ["serve", "--api-key", "  "])
    assert result.exit_code == 2 and "--api-key" in result.output and "empty" in result.output


def test_an_unforeseen_exception_is_a_json_500_with_a_request_id(servers: dict[str, str]) -> None:
    url = servers["classifier"]
    # The route asks the service for the label names after the batch ran; make that blow up once.
    from wde.server.service import Service

    original = Service.labels
    Service.labels = lambda self: 1 / 0  # type: ignore[method-assign, assignment]
    try:
        r = post(url, "/classify", {"input": "hello"}, headers={"x-request-id": "abc-123"})
    finally:
        Service.labels = original  # type: ignore[method-assign]
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json")
    assert "request id abc-123" in r.text and "ZeroDivision" not in r.text and "Traceback" not in r.text
    assert r.headers["x-request-id"] == "abc-123"
    assert post(url, "/classify", {"input": "hello"}).status_code == 200


def test_every_response_carries_a_request_id(servers: dict[str, str]) -> None:
    url = servers["embedder"]
    ids = {post(url, "/embed", {"inputs": "x"}).headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3
    for unfit in ("bad id", "x" * 65, "semi;colon"):  # not echoed back: a fresh id is made instead
        echoed = post(url, "/embed", {"inputs": "x"}, headers={"x-request-id": unfit}).headers["x-request-id"]
        assert echoed != unfit and len(echoed) == 32


@pytest.fixture(scope="module")
def faulty_server(minilm_path: Path) -> Iterator[str]:
    faults.register()
    with Engine.from_workflow("bert", minilm_path, overrides=["model.name=fault_bert"]) as engine, \
            serve(engine) as (url, _):
        yield url


def test_a_poisoned_request_fails_alone_in_a_burst(faulty_server: str) -> None:
    texts = [f"innocent sentence {i}" for i in range(23)] + ["a poison pill"]

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(f"{faulty_server}/v1/embeddings", json={"input": t})
                                          for t in texts))

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 23 + [500]
    message = responses[-1].json()["error"]["message"]
    assert responses[-1].headers["x-request-id"] in message and "injected" not in message
    assert httpx.get(f"{faulty_server}/health").status_code == 200


def test_a_crashing_loop_restarts_and_run_server_exits_after_repeated_crashes(minilm_path: Path) -> None:
    """The scheduler raises out of `schedule()` for every request saying "crash": each such request gets 503,
    the loop restarts and serves the next good request; after the restart budget `run_server` shuts down and
    raises `EngineFailed` (so `wde serve` exits 3 for a supervisor to restart)."""
    from wde.server.app import EngineFailed, run_server

    faults.register()
    port = free_port()
    config = ServerConfig(model=str(minilm_path), port=port, overrides=["scheduler.name=fault_fcfs"])
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            run_server(config)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - inspected below
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, thread.is_alive)
    crashed = post(url, "/v1/embeddings", {"input": "crash please"})
    assert crashed.status_code == 503 and "retrying it is safe" in crashed.json()["error"]["message"]
    assert post(url, "/v1/embeddings", {"input": "good"}).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200
    assert metric(url, "wde_engine_restarts") == 1 and metric(url, "wde_engine_healthy") == 1
    for _ in range(5):  # the budget: 5 restarts in 60 s; the sixth crash is fatal
        assert post(url, "/v1/embeddings", {"input": "crash again"}).status_code == 503
    thread.join(30)
    assert not thread.is_alive() and len(outcome) == 1 and isinstance(outcome[0], EngineFailed)


def test_clients_reusing_one_request_id_all_get_their_answers(servers: dict[str, str]) -> None:
    url = servers["embedder"]
    texts = [f"same id, text {i}" for i in range(24)]

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(f"{url}/embed", json={"inputs": t},
                                                      headers={"x-request-id": "dup"}) for t in texts))

    responses = asyncio.run(asyncio.wait_for(burst(), 600))
    assert [r.status_code for r in responses] == [200] * len(texts)
    assert all(r.headers["x-request-id"] == "dup" for r in responses)
    one = post(url, "/embed", {"inputs": texts[5]}).json()[0]
    assert responses[5].json()[0] == pytest.approx(one, abs=1e-6)  # each caller got its own text's vector
