"""Rerank answers in each client's own shape where the request alone is ambiguous (issue 34, items 4 and 5).

litellm's `infinity/` provider validates each `document` as Infinity's plain string; Elasticsearch's `hugging_face`
rerank service parses only TEI's top-level array, whichever body its version sends (`texts` + `return_text`, or
`documents`). The bodies and headers below are what those clients send (litellm's are its own; Elastic's are
byte for byte what its request entity writes, with Apache HttpAsyncClient's default User-Agent). Scores are
compared with sentence-transformers' CrossEncoder on the same tiny cross-encoder.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Iterator

import httpx
import numpy as np
import pytest

from tests import tiny_heads
from tests.ranking import assert_ranked
from tests.test_server import serve
from wde import Engine

QUERY = "how many people live in berlin"
DOCS = ["Berlin has a population of 3.5 million.", "The cat sat on the mat.", "Paris is in France.",
        "Around 3.7 million people live in Berlin."]
TOL = 1e-4
ELASTIC_HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer hf_test",
                   "User-Agent": "Apache-HttpAsyncClient/4.1.5 (Java/21.0.2)"}
"""Elastic's request: its entity's JSON, `Content-Type` without parameters, the endpoint's API key as a bearer token,
and the HTTP client's default User-Agent (the inference plugin sets none)."""
TEI_KEYS = {"index", "score", "text"}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_heads.build_xlmr_classifier(tmp_path_factory.mktemp("shapes") / "reranker", num_labels=1)


@pytest.fixture(scope="module")
def expected(model_path: Path) -> dict[int, float]:
    """sentence-transformers' CrossEncoder scores (sigmoid of the one logit) per document index."""
    from sentence_transformers import CrossEncoder

    scores = CrossEncoder(str(model_path), device="cpu").predict([(QUERY, d) for d in DOCS])
    return dict(enumerate(np.asarray(scores, dtype=np.float64).tolist()))


@pytest.fixture(scope="module")
def base(model_path: Path) -> Iterator[str]:
    with Engine.from_workflow("bge_reranker_v2_m3", model_path) as served, \
            serve(served, served_model_name="rr") as (url, _):
        yield url


@pytest.fixture(scope="module")
def litellm() -> Iterator[ModuleType]:
    """litellm with its bundled cost map (no fetch at import) and no telemetry or feedback banners."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        mp.setenv("LITELLM_TELEMETRY", "False")
        mp.delenv("LITELLM_USER_AGENT", raising=False)
        import litellm

        mp.setattr(litellm, "telemetry", False, raising=False)
        mp.setattr(litellm, "suppress_debug_info", True, raising=False)
        yield litellm


# --- litellm ---------------------------------------------------------------------------------------------------

def test_litellm_infinity_rerank(base: str, expected: dict[int, float], litellm: ModuleType) -> None:
    top = litellm.rerank(model="infinity/rr", api_base=base, query=QUERY, documents=DOCS, top_n=2)
    assert_ranked([(r["index"], r["relevance_score"]) for r in top.results], expected, tol=TOL, top_n=2)
    assert [r["document"]["text"] for r in top.results] == [DOCS[r["index"]] for r in top.results]
    bare = litellm.rerank(model="infinity/rr", api_base=base, query=QUERY, documents=DOCS, return_documents=False)
    assert_ranked([(r["index"], r["relevance_score"]) for r in bare.results], expected, tol=TOL)
    assert all("document" not in r for r in bare.results)
    assert top.meta["tokens"]["input_tokens"] > 0


def test_litellm_infinity_gets_infinity_strings_on_the_wire(base: str) -> None:
    """What litellm's infinity/ provider validates: `document` a string (its body and headers, sent by hand)."""
    headers = {"User-Agent": "litellm/1.110.2", "Authorization": "Bearer None", "accept": "application/json"}
    body = {"model": "rr", "query": QUERY, "top_n": 2, "documents": DOCS, "return_documents": True}
    results = httpx.post(f"{base}/rerank", json=body, headers=headers).json()["results"]
    assert [r["document"] for r in results] == [DOCS[r["index"]] for r in results]


def test_litellm_vllm_and_cohere_keep_text_objects(base: str, expected: dict[int, float], litellm: ModuleType) -> None:
    """The same body from litellm's hosted_vllm/ (api_base URL/v1, so /v1/rerank) and cohere/ (/v1/rerank) keeps
    `{"text": ...}`, which both read."""
    for model, api_base in (("hosted_vllm/rr", f"{base}/v1"), ("cohere/rr", base)):
        got = litellm.rerank(model=model, api_base=api_base, query=QUERY, documents=DOCS, top_n=3, api_key="k")
        assert_ranked([(r["index"], r["relevance_score"]) for r in got.results], expected, tol=TOL, top_n=3)
        assert [r["document"]["text"] for r in got.results] == [DOCS[r["index"]] for r in got.results], model


# --- Elasticsearch's hugging_face rerank service ---------------------------------------------------------------

def _elastic(base: str, path: str, body: dict, headers: dict[str, str] = ELASTIC_HEADERS) -> httpx.Response:
    """Post the body as Elastic's XContent writes it: compact JSON, fields in its order."""
    return httpx.post(base + path, content=json.dumps(body, separators=(",", ":")).encode(), headers=headers)


def _tei_array(response: httpx.Response) -> list[dict]:
    """What Elastic's HuggingFaceRerankResponseEntity accepts: a top-level array of objects whose keys are all
    among index, score and text (any other key fails its parse)."""
    assert response.status_code == 200, response.text
    ranks = response.json()
    assert isinstance(ranks, list) and ranks, ranks
    assert all(isinstance(r, dict) and {"index", "score"} <= r.keys() <= TEI_KEYS for r in ranks), ranks
    return ranks


@pytest.mark.parametrize("path", ["/rerank", "/"])
def test_elastic_texts_body(base: str, expected: dict[int, float], path: str) -> None:
    """Elastic's current entity: `texts`, `query`, `return_text` and `top_n` (TEI ignores top_n; Elastic cuts)."""
    ranks = _tei_array(_elastic(base, path, {"texts": DOCS, "query": QUERY, "return_text": True, "top_n": 2}))
    assert_ranked([(r["index"], r["score"]) for r in ranks], expected, tol=TOL)
    assert all(r["text"] == DOCS[r["index"]] for r in ranks)
    plain = _tei_array(_elastic(base, path, {"texts": DOCS, "query": QUERY, "return_text": False}))
    assert all("text" not in r for r in plain)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank"])
def test_elastic_documents_body(base: str, expected: dict[int, float], path: str) -> None:
    """Elastic versions that send `{documents, query, top_n}` (the issue's body) get TEI's array on every rerank
    path, told from Jina/Cohere/vLLM bodies by Elastic's User-Agent."""
    ranks = _tei_array(_elastic(base, path, {"documents": DOCS, "query": QUERY, "top_n": 2}))
    assert_ranked([(r["index"], r["score"]) for r in ranks], expected, tol=TOL, top_n=2)
    assert all(r["text"] == DOCS[r["index"]] for r in ranks)
    bare = _tei_array(_elastic(base, path, {"documents": DOCS, "query": QUERY, "return_documents": False,
                                            "top_n": 3, "max_chunks_per_doc": 1}))
    assert_ranked([(r["index"], r["score"]) for r in bare], expected, tol=TOL, top_n=3)
    assert all("text" not in r for r in bare)


def test_elastic_documents_body_at_an_endpoint_root(base: str, expected: dict[int, float]) -> None:
    """Pointed at the root URL (a Hugging Face endpoint's URL is its root), a `documents` body gets TEI's array
    from TEI's root routes whatever the User-Agent: no documents-shaped client posts there."""
    for path in ("/", "/invocations"):
        ranks = _tei_array(httpx.post(base + path, json={"documents": DOCS, "query": QUERY}))
        assert_ranked([(r["index"], r["score"]) for r in ranks], expected, tol=TOL)


def test_elastic_errors_are_tei_shaped(base: str) -> None:
    """Elastic reads a failed call's `error` string (TEI's error shape), not OpenAI's `error` object."""
    empty = _elastic(base, "/rerank", {"documents": [], "query": QUERY})
    assert empty.status_code == 400 and isinstance(empty.json()["error"], str) and empty.json()["error_type"]


def test_documents_bodies_from_other_clients_keep_the_object(base: str, expected: dict[int, float]) -> None:
    """The same `{query, documents, top_n}` from anything else (Jina, Cohere v1, vLLM, curl) keeps the object."""
    for path in ("/rerank", "/v1/rerank"):
        body = httpx.post(base + path, json={"query": QUERY, "documents": DOCS, "top_n": 2}).json()
        assert isinstance(body, dict) and body["object"] == "rerank"
        assert_ranked([(r["index"], r["relevance_score"]) for r in body["results"]], expected, tol=TOL, top_n=2)
        assert all(r["document"] == {"text": DOCS[r["index"]]} for r in body["results"])
