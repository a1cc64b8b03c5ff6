"""Weaviate's text2vec-transformers module against `wde serve`: the requests its Go client sends, byte for byte.

Weaviate's client (usecases/modulecomponents/clients/transformers) polls `GET /.well-known/ready` until a 2xx,
reads `GET /meta`, and POSTs each text to `/vectors` as its `vecRequest` struct marshals it (`dims`, `vector`,
`error` included) with Go's default headers and no Content-Type; newer clients may batch (`{"texts": ...}`, with a
Content-Type). It reads `vector` and `dims` back, and on an error the `error` string. The requests here are
written on a raw socket exactly as Go's net/http writes them, and the vectors must equal sentence-transformers'.
"""

from __future__ import annotations

import gzip
import http.client
import json
import socket
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from tests.test_server import serve
from wde import Engine

TEXTS = ["A man is eating food.", "The new movie is awesome"]
PROMPTS = "input_processor.params.prompts={query: 'q: ', passage: 'p: '}"


def go_request(base: str, method: str, path: str, body: bytes | None = None,
               content_type: str | None = None) -> tuple[int, dict[str, str], Any]:
    """Send a request as Go's http.Client does (headers and their order: Host, User-Agent, Content-Length, the
    request's own headers, Accept-Encoding: gzip); returns (status, headers, JSON body or None)."""
    host = base.removeprefix("http://")
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "User-Agent: Go-http-client/1.1"]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    if content_type is not None:
        lines.append(f"Content-Type: {content_type}")
    lines.append("Accept-Encoding: gzip")
    hostname, port = host.split(":")
    with socket.create_connection((hostname, int(port)), timeout=60) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b""))
        response = http.client.HTTPResponse(sock, method=method)
        response.begin()
        data = response.read()
    headers = {k.lower(): v for k, v in response.getheaders()}
    if headers.get("content-encoding") == "gzip":
        data = gzip.decompress(data)
    return response.status, headers, json.loads(data) if data else None


def go_vectorize(base: str, text: str, task: str = "passage", pooling: str | None = "masked_mean",
                 dimensions: int | None = None, path: str = "/vectors") -> tuple[int, Any]:
    """Weaviate's one-text request: `json.Marshal(vecRequest{...})`, fields in struct order, empty config fields
    omitted, sent without a Content-Type."""
    config: dict[str, Any] = {}
    if pooling:
        config["pooling_strategy"] = pooling
    config["task_type"] = task
    if dimensions is not None:
        config["dimensions"] = dimensions
    body = {"text": text, "dims": 0, "vector": None, "error": "", "config": config}
    status, _, answer = go_request(base, "POST", path, json.dumps(body, separators=(",", ":")).encode())
    return status, answer


def go_error(answer: Any) -> str:
    """What Weaviate shows of an error answer: its `error` field, decoded into a Go string (an object would fail
    to unmarshal, and the message would be lost)."""
    assert isinstance(answer, dict) and isinstance(answer.get("error"), str), answer
    return answer["error"]


@pytest.fixture(scope="module")
def server(minilm_path: Path) -> Iterator[tuple[str, Any]]:
    with Engine.from_workflow(None, minilm_path) as engine, serve(engine) as (base, app):
        yield base, app


@pytest.fixture(scope="module")
def base(server: tuple[str, Any]) -> str:
    return server[0]


@pytest.fixture(scope="module")
def st_model(minilm_path: Path):  # noqa: ANN201
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path), device="cpu")


def _close(got: Any, want: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert float(np.abs(got - want).max()) <= 1e-4


# --- start-up: ready, live, meta ---------------------------------------------------------------------------------

def test_ready_and_live_answer_204(base: str) -> None:
    for path in ("/.well-known/ready", "/.well-known/live"):
        status, _, answer = go_request(base, "GET", path)
        assert (status, answer) == (204, None), path


def test_ready_is_503_while_the_engine_does_not_serve(server: tuple[str, Any],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Weaviate keeps waiting (any status above 299) while /health would say the engine is down; live stays 204."""
    base, app = server
    monkeypatch.setattr(app.state.service, "liveness", lambda: "the engine is not running: test")
    status, _, answer = go_request(base, "GET", "/.well-known/ready")
    assert status == 503 and "the engine is not running" in go_error(answer)
    assert go_request(base, "GET", "/.well-known/live")[0] == 204


def test_meta_is_the_model_config(base: str, minilm_path: Path) -> None:
    status, _, answer = go_request(base, "GET", "/meta")
    assert status == 200
    assert answer == {"model": json.loads((minilm_path / "config.json").read_text(encoding="utf-8"))}
    assert answer["model"]["model_type"] == "bert"


# --- /vectors ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/vectors", "/vectors/"])
@pytest.mark.parametrize("task", ["passage", "query"])
def test_weaviates_request_equals_st(base: str, st_model, path: str, task: str) -> None:  # noqa: ANN001
    """No Content-Type, Weaviate's default pooling_strategy (masked_mean is MiniLM's mean pooling), both task
    types (MiniLM has no prompts: the text as is)."""
    status, answer = go_vectorize(base, TEXTS[0], task=task, path=path)
    assert status == 200, answer
    assert answer["text"] == TEXTS[0] and answer["dim"] == answer["dims"] == 384
    _close(answer["vector"], st_model.encode(TEXTS[0]))


def test_batch_shape(base: str, st_model) -> None:  # noqa: ANN001
    body = {"texts": TEXTS, "config": {"pooling_strategy": "masked_mean", "task_type": "passage"}}
    status, _, answer = go_request(base, "POST", "/vectors", json.dumps(body, separators=(",", ":")).encode(),
                                   content_type="application/json")
    assert status == 200, answer
    assert answer["dims"] == 384 and set(answer) == {"vectors", "dims"}
    _close(answer["vectors"], st_model.encode(TEXTS))


def test_long_text_is_truncated_as_sentence_transformers_does(base: str, st_model) -> None:  # noqa: ANN001
    text = " ".join(["Weaviate joins every property of an object into one text."] * 60)  # ~600 tokens > 256
    status, answer = go_vectorize(base, text)
    assert status == 200, answer
    _close(answer["vector"], st_model.encode(text))


def test_dimensions_keep_the_first_features_renormalized(base: str, st_model) -> None:  # noqa: ANN001
    """Weaviate's `dimensions` setting: sentence-transformers' truncate_dim, then normalization (the container
    encodes with normalize_embeddings=True)."""
    status, answer = go_vectorize(base, TEXTS[1], dimensions=128)
    assert status == 200, answer
    assert answer["dims"] == 128
    _close(answer["vector"], st_model.encode(TEXTS[1], truncate_dim=128, normalize_embeddings=True))


def test_options_the_model_does_not_have_are_refused_by_name(base: str) -> None:
    status, answer = go_vectorize(base, TEXTS[0], pooling="cls")
    message = go_error(answer)
    assert status == 422 and "'cls'" in message and "'mean'" in message and "'masked_mean'" in message, message
    status, answer = go_vectorize(base, TEXTS[0], task="classification")
    assert status == 422 and "'classification'" in go_error(answer)
    for pooling in (None, "mean"):  # none given (poolingStrategy set to ""), or WDE's own name of the mode
        assert go_vectorize(base, TEXTS[0], pooling=pooling)[0] == 200, pooling


def test_errors_are_strings_weaviate_reads(base: str) -> None:
    status, answer = go_vectorize(base, "")
    assert status == 400 and "empty" in go_error(answer)
    status, _, answer = go_request(base, "POST", "/vectors", b'{"config": {}}')
    assert status == 422 and "text" in go_error(answer)
    status, _, answer = go_request(base, "POST", "/vectors", b"{not json")
    assert status == 400 and go_error(answer)


# --- content types: only Weaviate's routes take a body without one -------------------------------------------------

def test_content_type_exemption_is_narrow(base: str) -> None:
    body = json.dumps({"text": TEXTS[0]}).encode()
    assert go_request(base, "POST", "/vectors", body)[0] == 200
    assert go_request(base, "POST", "/vectors", body, content_type="application/json")[0] == 200
    status, headers, answer = go_request(base, "POST", "/vectors", body, content_type="text/plain")
    assert status == 415 and headers.get("accept-post") == "application/json" and "text/plain" in go_error(answer)
    status, _, answer = go_request(base, "POST", "/vectors", body, content_type="")
    assert status == 415 and "no Content-Type" in go_error(answer)
    for path, other in [("/embed", {"inputs": TEXTS[0]}), ("/v1/embeddings", {"input": TEXTS[0]})]:
        status, _, answer = go_request(base, "POST", path, json.dumps(other).encode())
        assert status == 415, (path, answer)
        assert go_request(base, "POST", path, json.dumps(other).encode(), content_type="application/json")[0] == 200


def test_a_web_page_cannot_use_the_exemption(base: str) -> None:
    """A browser's fetch of a typeless Blob carries Origin: refused before the content-type check."""
    host = base.removeprefix("http://")
    hostname, port = host.split(":")
    body = json.dumps({"text": TEXTS[0]}).encode()
    with socket.create_connection((hostname, int(port)), timeout=60) as sock:
        sock.sendall(f"POST /vectors HTTP/1.1\r\nHost: {host}\r\nOrigin: https://evil.example\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        response = http.client.HTTPResponse(sock, method="POST")
        response.begin()
        assert response.status == 403, response.read()


# --- a model with prompts and CLS pooling ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cls_base(minilm_path: Path) -> Iterator[str]:
    with Engine.from_workflow(None, minilm_path, overrides=[PROMPTS, "pooler.params.pooling=cls"]) as engine, \
            serve(engine) as (url, _):
        yield url


def test_cls_model_with_prompts(cls_base: str, st_model) -> None:  # noqa: ANN001
    """`cls` is accepted and Weaviate's default `masked_mean` refused, naming the setting to change; task types pick
    the `query` / `passage` prompts, as sentence-transformers' encode_query / encode_document."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Normalize, Pooling

    reference = SentenceTransformer(modules=[st_model[0], Pooling(384, pooling_mode="cls"), Normalize()],
                                    device="cpu")
    status, answer = go_vectorize(cls_base, TEXTS[0])
    message = go_error(answer)
    assert status == 422 and "poolingStrategy to 'cls'" in message, message
    for task, prompt in (("query", "q: "), ("passage", "p: ")):
        status, answer = go_vectorize(cls_base, TEXTS[0], task=task, pooling="cls")
        assert status == 200, answer
        _close(answer["vector"], reference.encode(TEXTS[0], prompt=prompt))
