"""Late interaction over HTTP: a request's query/document side reaches a multi-vector model from the routes that
return token vectors (vLLM's /pooling `task: "token_embed"` with `input_type`, TEI's /embed_all), and the WDE
extension `options` (the workflow's per-request options) travels on every embedding route and is refused by name
where the workflow does not take it."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.test_multi_vector import DOCUMENT, QUERY, classic_colbert
from tests.test_server import serve
from wde import Engine

TEXTS = ["what is the capital of france?", "Paris is the capital of France. It has many museums!"]


@pytest.fixture(scope="module")
def colbert(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory):
    with Engine.from_workflow(None, classic_colbert(minilm_path, tmp_path_factory.mktemp("colbert") / "st")) as e:
        yield e


@pytest.fixture(scope="module")
def url(colbert: Engine):
    with serve(colbert, served_model_name="m") as (base, _):
        yield base


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def test_pooling_token_embed_with_input_type(url: str, colbert: Engine) -> None:
    want = {side: colbert.encode(TEXTS, params) for side, params in (("query", QUERY), ("document", DOCUMENT))}
    for side in ("query", "document"):
        r = post(url, "/pooling", {"model": "m", "input": TEXTS, "task": "token_embed", "input_type": side,
                                   "truncate": True})
        assert r.status_code == 200, r.text
        for item, w in zip(r.json()["data"], want[side]):
            assert np.abs(np.array(item["data"]) - w.outputs["colbert"]).max() <= 1e-5
    # options.task is the same switch; a document is the default
    r = post(url, "/pooling", {"model": "m", "input": TEXTS, "task": "token_embed", "options": {"task": "query"},
                               "truncate": True, "encoding_format": "base64"})
    first = np.frombuffer(base64.b64decode(r.json()["data"][0]["data"]), dtype=np.float32)
    assert np.abs(first - want["query"][0].outputs["colbert"].reshape(-1)).max() <= 1e-5
    r = post(url, "/pooling", {"model": "m", "input": TEXTS, "task": "token_embed", "truncate": True})
    assert np.abs(np.array(r.json()["data"][1]["data"]) - want["document"][1].outputs["colbert"]).max() <= 1e-5


def test_embed_all_gives_the_token_vectors_of_either_side(url: str, colbert: Engine) -> None:
    for options, params in (({"task": "query"}, QUERY), (None, DOCUMENT)):
        body = {"inputs": TEXTS, "truncate": True, **({"options": options} if options else {})}
        r = post(url, "/embed_all", body)
        assert r.status_code == 200, r.text
        for got, w in zip(r.json(), colbert.encode(TEXTS, params)):
            assert np.abs(np.array(got) - w.outputs["colbert"]).max() <= 1e-5


def test_options_are_refused_by_name(url: str, minilm_engine: Engine) -> None:
    r = post(url, "/pooling", {"model": "m", "input": TEXTS, "task": "token_embed", "options": {"task": "passage"}})
    assert r.status_code == 422 and "options.task" in r.text and "document, query" in r.text
    r = post(url, "/pooling", {"model": "m", "input": TEXTS, "task": "token_embed", "input_type": "query",
                               "options": {"task": "document"}})
    assert r.status_code == 422 and "contradict" in r.text
    r = post(url, "/embed_all", {"inputs": TEXTS, "options": {"mode": "query"}})
    assert r.status_code == 422 and "option 'mode' is not an option" in r.text  # TEI's shape: no field
    info = httpx.get(url + "/info").json()
    assert info["options"] == {"task": ["document", "query"]}
    with serve(minilm_engine, served_model_name="m") as (plain, _):
        for path, body in (("/v1/embeddings", {"model": "m", "input": TEXTS, "options": {"task": "query"}}),
                           ("/embed", {"inputs": TEXTS, "options": {"task": "query"}}),
                           ("/pooling", {"model": "m", "input": TEXTS, "input_type": "query"})):
            r = post(plain, path, body)
            assert r.status_code == 422, (path, r.text)
            assert "option 'task' is not an option of workflow 'bert'; it takes none" in r.text \
                or "input_type 'query': workflow 'bert' embeds queries and documents alike" in r.text, r.text
        assert httpx.get(plain + "/info").json()["options"] == {}
