"""A PyLate-layout ColBERT folder (built as tests/test_multi_vector_pylate.py builds one: "[Q] " / "[D] " added to
the tokenizer, flat expansion settings, a punctuation skiplist) served over HTTP, in one process and split
(`--api-servers 2`: the API servers tokenize, with the prefixes registered, and score MaxSim; the core embeds):
vLLM's /pooling `task: "token_embed"` with `input_type` query and document gives `encode_query` /
`encode_document`'s token rows (<= 1e-4), also in base64; /rerank (and Cohere's /v2/rerank) scores
`MultiVectorEncoder.similarity` (<= 1e-4 relative); Cohere /v2/embed gives the same matrices."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest

from tests.test_multi_vector import st_model, tiny_backbone
from tests.test_multi_vector_pylate import pylate
from tests.test_server import serve, serve_split
from wde import Engine

TOL = 1e-4
QUERY = "what is the capital of france?"
DOCS = ["Paris is the capital of France. It has, many museums!", "Bananas are yellow.", "berlin; bonn? hamburg...",
        "[Q] not a prefix here"]


@pytest.fixture(scope="module")
def folder(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pylate-http")
    return pylate(tiny_backbone(minilm_path, root / "backbone"), root / "pylate", skiplist=[",", "?", "."])


@pytest.fixture(scope="module")
def st(folder: Path):  # noqa: ANN201 - a sentence_transformers.MultiVectorEncoder
    return st_model(folder)


@pytest.fixture(scope="module", params=["one process", "2 API servers"])
def url(request: pytest.FixtureRequest, folder: Path) -> Iterator[str]:
    if request.param == "one process":
        with Engine.from_workflow(None, folder) as engine, serve(engine, served_model_name="m") as (base, _):
            assert engine.workflow.name == "multi_vector"
            yield base
    else:
        with serve_split(folder, 2, "--served-model-name", "m") as (base, _):
            yield base


def post(url: str, path: str, body: dict) -> dict | list:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, (path, r.text)
    return r.json()


def test_pooling_token_embed_matches_sentence_transformers(url: str, st) -> None:  # noqa: ANN001
    texts = [QUERY, *DOCS]
    for side, encode in (("query", st.encode_query), ("document", st.encode_document)):
        want = [np.asarray(w) for w in encode(texts)]
        body = {"model": "m", "input": texts, "task": "token_embed", "input_type": side, "truncate": True}
        for _ in range(2):  # twice: on a split server, likely once through each API server
            got = post(url, "/pooling", body)["data"]
            for item, w in zip(got, want):
                assert np.array(item["data"]).shape == w.shape, side
                assert np.abs(np.array(item["data"]) - w).max() <= TOL, side
        encoded = post(url, "/pooling", {**body, "encoding_format": "base64"})["data"]
        for item, w in zip(encoded, want):
            got = np.frombuffer(base64.b64decode(item["data"]), dtype="<f4").reshape(item["shape"])
            assert np.abs(got - w).max() <= TOL, side
    # the sides differ: a query is expanded to query_length, a document's skiplist tokens are dropped
    assert len(st.encode_query([QUERY])[0]) != len(st.encode_document([QUERY])[0])


def test_rerank_scores_maxsim_as_sentence_transformers(url: str, st) -> None:  # noqa: ANN001
    want = st.similarity(st.encode_query([QUERY]), st.encode_document(DOCS)).numpy()[0]
    assert len({round(float(x), 3) for x in want}) == len(DOCS)
    for path in ("/rerank", "/v2/rerank"):
        results = post(url, path, {"model": "m", "query": QUERY, "documents": DOCS})["results"]
        got = [r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])]
        np.testing.assert_allclose(got, want, rtol=TOL, atol=0, err_msg=path)
        assert [r["index"] for r in results] == list(np.argsort(-want, kind="stable")), path
    tei = post(url, "/rerank", {"query": QUERY, "texts": DOCS})
    np.testing.assert_allclose([r["score"] for r in sorted(tei, key=lambda r: r["index"])], want, rtol=TOL, atol=0)


def test_cohere_embed_gives_the_same_matrices(url: str, st) -> None:  # noqa: ANN001
    for input_type, encode in (("search_query", st.encode_query), ("search_document", st.encode_document)):
        got = post(url, "/v2/embed", {"model": "m", "texts": DOCS, "input_type": input_type})["embeddings"]["float"]
        for g, w in zip(got, encode(DOCS)):
            assert np.abs(np.array(g) - np.asarray(w)).max() <= TOL, input_type
