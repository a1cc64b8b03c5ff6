"""A late-interaction model's token matrices over HTTP in every encoding: vLLM's /pooling `task: "token_embed"` with
`encoding_format: "base64"` in float32, float16 and bfloat16 (`embed_dtype`), either byte order (`endianness`), with
each matrix's `shape` beside its bytes; Cohere v2 /v2/embed (`input_type` search_query / search_document as the
model's query / document side, `embedding_types` float and base64, `shapes`, the quantized types and the input types
without a side refused by name) and Cohere v1 /v1/embed; Cohere's /v1/rerank and /v2/rerank scoring with MaxSim. Each
decoded matrix is compared with the float answer and with `Engine.encode`."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from tests.test_multi_vector import DOCUMENT, QUERY, classic_colbert, st_model
from tests.test_server import serve
from wde import Engine

TEXTS = ["what is the capital of france?", "Paris is the capital of France. It has many museums!", "hi"]
DTYPES = {"float32": ("f4", 4), "float16": ("f2", 2), "bfloat16": ("u2", 2)}


@pytest.fixture(scope="module")
def folder(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return classic_colbert(minilm_path, tmp_path_factory.mktemp("encodings") / "st")


@pytest.fixture(scope="module")
def colbert(folder: Path):
    with Engine.from_workflow(None, folder) as engine:
        yield engine


@pytest.fixture(scope="module")
def url(colbert: Engine):
    with serve(colbert, served_model_name="m") as (base, _):
        yield base


@pytest.fixture(scope="module")
def want(colbert: Engine) -> dict[str, list[np.ndarray]]:
    return {side: [o.outputs["colbert"] for o in colbert.encode(TEXTS, params)]
            for side, params in (("query", QUERY), ("document", DOCUMENT))}


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def decode(text: str, shape: list[int], dtype: str, endianness: str) -> np.ndarray:
    """The documented layout read back: row-major elements of `dtype` in `endianness`, reshaped to `shape`."""
    code, size = DTYPES[dtype]
    raw = base64.b64decode(text, validate=True)
    assert len(raw) == size * int(np.prod(shape))
    order = ">" if endianness == "big" else "<"
    values = np.frombuffer(raw, dtype=order + code)
    if dtype == "bfloat16":  # the high half of a float32
        values = (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32).reshape(shape)


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """`x` rounded to `dtype` (nearest even) and back to float32: what a base64 answer in `dtype` must hold."""
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    return x


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("endianness", ["native", "little", "big"])
def test_pooling_token_matrices_in_base64(url: str, want: dict, dtype: str, endianness: str) -> None:
    body = {"model": "m", "input": TEXTS, "task": "token_embed", "input_type": "query", "truncate": True}
    floats = post(url, "/pooling", body).json()["data"]
    r = post(url, "/pooling", {**body, "encoding_format": "base64", "embed_dtype": dtype, "endianness": endianness})
    assert r.status_code == 200, r.text
    for item, plain, w in zip(r.json()["data"], floats, want["query"]):
        assert item["shape"] == list(w.shape) and w.ndim == 2 and w.shape[0] > 1
        got = decode(item["data"], item["shape"], dtype, endianness)
        assert np.array_equal(got, rounded(np.array(plain["data"], dtype=np.float32), dtype))
        assert np.abs(got - w).max() <= {"float32": 1e-6, "float16": 1e-3, "bfloat16": 1e-2}[dtype]
    if dtype != "float32":  # the rounding is really there
        assert not np.array_equal(decode(r.json()["data"][0]["data"], list(want["query"][0].shape), dtype,
                                         endianness), want["query"][0])


def test_pooling_documents_have_their_own_rows(url: str, want: dict) -> None:
    r = post(url, "/pooling", {"model": "m", "input": TEXTS, "task": "token_embed", "truncate": True,
                               "encoding_format": "base64", "embed_dtype": "float16"})
    shapes = [item["shape"] for item in r.json()["data"]]
    assert shapes == [list(w.shape) for w in want["document"]] and len({s[0] for s in shapes}) == len(TEXTS)
    for item, w in zip(r.json()["data"], want["document"]):
        assert np.array_equal(decode(item["data"], item["shape"], "float16", "native"), rounded(w, "float16"))


@pytest.mark.parametrize(("body", "field"), [
    ({"embed_dtype": "float16"}, "embed_dtype"),  # JSON numbers: the element type would be silently dropped
    ({"encoding_format": "base64", "embed_dtype": "fp8_e4m3"}, "embed_dtype"),
    ({"encoding_format": "bytes"}, "encoding_format"),
])
def test_pooling_refuses_encodings_it_does_not_serve(url: str, body: dict, field: str) -> None:
    r = post(url, "/pooling", {"model": "m", "input": TEXTS, "task": "token_embed", **body})
    assert r.status_code == 422 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize(("input_type", "side"), [("search_query", "query"), ("search_document", "document"),
                                                  (None, "document")])
def test_cohere_v2_embed_gives_token_matrices(url: str, want: dict, input_type: str | None, side: str) -> None:
    body = {"model": "m", "texts": TEXTS, "embedding_types": ["float", "base64"],
            **({"input_type": input_type} if input_type else {})}
    r = post(url, "/v2/embed", body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["response_type"] == "embeddings_by_type" and answer["texts"] == TEXTS
    assert answer["shapes"] == [list(w.shape) for w in want[side]]
    for plain, encoded, shape, w in zip(answer["embeddings"]["float"], answer["embeddings"]["base64"],
                                        answer["shapes"], want[side]):
        assert np.abs(np.array(plain) - w).max() <= 1e-6
        assert np.array_equal(decode(encoded, shape, "float32", "little"), np.array(plain, dtype=np.float32))
    assert answer["meta"]["billed_units"]["input_tokens"] > 0


def test_cohere_v2_sides_match_sentence_transformers(url: str, folder: Path) -> None:
    st = st_model(folder)
    for input_type, reference in (("search_query", st.encode_query), ("search_document", st.encode_document)):
        got = post(url, "/v2/embed", {"texts": TEXTS, "input_type": input_type}).json()["embeddings"]["float"]
        for g, w in zip(got, reference(TEXTS)):
            w = np.asarray(w)
            assert np.array(g).shape == w.shape and np.abs(np.array(g) - w).max() <= 1e-4


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"input_type": "classification"}, "input_type", "search_query"),
    ({"input_type": "clustering"}, "input_type", "search_document"),
    ({"input_type": "query"}, "input_type", "no other kind"),
    ({"embedding_types": ["float", "int8"]}, "embedding_types", "'int8'"),
    ({"embedding_types": ["ubinary"]}, "embedding_types", "'ubinary'"),
    ({"output_dimension": 64}, "output_dimension", "cannot be shortened"),
])
def test_cohere_v2_refuses_by_name(url: str, body: dict, field: str, words: str) -> None:
    r = post(url, "/v2/embed", {"texts": TEXTS, **body})
    assert r.status_code == 422 and r.json()["error"]["param"] == field and words in r.text, r.text


def test_cohere_v1_embed_gives_token_matrices(url: str, want: dict) -> None:
    r = post(url, "/v1/embed", {"texts": TEXTS, "input_type": "search_query"})
    assert r.status_code == 200, r.text
    assert r.json()["response_type"] == "embeddings_floats"
    for got, w in zip(r.json()["embeddings"], want["query"]):
        assert np.abs(np.array(got) - w).max() <= 1e-6
    typed = post(url, "/v1/embed", {"texts": TEXTS, "embedding_types": ["base64"]}).json()
    assert typed["response_type"] == "embeddings_by_type"
    for encoded, shape, w in zip(typed["embeddings"]["base64"], typed["shapes"], want["document"]):
        assert np.abs(decode(encoded, shape, "float32", "little") - w).max() <= 1e-6


def test_cohere_rerank_scores_with_maxsim(url: str, folder: Path) -> None:
    st = st_model(folder)
    query, docs = TEXTS[0], TEXTS[1:] + ["Bananas are yellow."]
    want = st.similarity(st.encode_query([query]), st.encode_document(docs)).numpy()[0]
    for path in ("/v1/rerank", "/v2/rerank"):
        results = post(url, path, {"model": "m", "query": query, "documents": docs}).json()["results"]
        got = [r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])]
        np.testing.assert_allclose(got, want, rtol=1e-4, err_msg=path)
        assert [r["index"] for r in results] == list(np.argsort(-want, kind="stable"))
