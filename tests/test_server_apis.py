"""The APIs users ask for, driven by their real clients where one exists: Cohere v2 (/v2/embed, /v2/rerank, with
the `cohere` client), vLLM /v1/score, quantized embeddings on /v1/embeddings (`openai` client) and TEI /embed,
and TEI's /embed_all, /similarity and /decode. Quantization is checked against sentence-transformers."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest
from sentence_transformers.util.quantization import quantize_embeddings

from tests.ranking import assert_ranked
from tests.test_server import serve
from tests.test_server_tasks import cross_encoder_path  # noqa: F401 - a fixture
from wde import Engine
from wde.server import ServerConfig
from wde.server.quantize import PRECISIONS, calibration_ranges, load_ranges, quantize

MODEL = "minilm"
TEXTS = ["A man is eating food.", "The new movie is awesome", "Berlin has 3.5 million people.", "hello"]
QUERY = "how many people live in berlin"
DOCS = ["Berlin has a population of 3.5 million.", "The cat sat on the mat.", "Paris is in France."]
PROMPTS = "input_processor.params.prompts={query: 'q: ', document: 'd: '}"
TYPES = ["float", "int8", "uint8", "binary", "ubinary", "base64"]


@pytest.fixture(scope="module")
def embedder(minilm_path: Path) -> Iterator[tuple[str, object]]:
    """MiniLM with per-token states on request and two prompts, as `wde serve --set ...` would serve it."""
    with Engine.from_workflow("bert", minilm_path, overrides=["pooler.name=sentence_tokens", PROMPTS]) as engine, \
            serve(engine, served_model_name=MODEL, max_client_batch_size=16) as running:
        yield running


@pytest.fixture(scope="module")
def url(embedder: tuple[str, object]) -> str:
    return embedder[0]


@pytest.fixture(scope="module")
def reranker(cross_encoder_path: Path) -> Iterator[tuple[str, Engine]]:  # noqa: F811
    with Engine.from_workflow("cross_encoder", cross_encoder_path) as served, \
            Engine.from_workflow("cross_encoder", cross_encoder_path) as offline, \
            serve(served, served_model_name="ce") as (url, _):
        yield url, offline


# --- quantization: sentence-transformers' semantics ------------------------------------------------------------

@pytest.mark.parametrize("width", [384, 12])
def test_quantize_equals_sentence_transformers(width: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(9, width)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    calibration = rng.normal(scale=0.05, size=(200, width)).astype(np.float32)
    for precision in PRECISIONS:
        ours = quantize(x, precision, calibration_ranges(calibration))  # type: ignore[arg-type]
        theirs = quantize_embeddings(x, precision, calibration_embeddings=calibration)
        assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs), precision
    for precision in ("float32", "binary", "ubinary"):  # no ranges involved
        assert np.array_equal(quantize(x, precision), quantize_embeddings(x, precision))  # type: ignore[arg-type]
    assert quantize(x, "ubinary").shape == (9, (width + 7) // 8)
    # Without calibration each vector is quantized over its own symmetric range, independent of the batch.
    for precision in ("int8", "uint8"):
        ours = quantize(x, precision)  # type: ignore[arg-type]
        for i, row in enumerate(x):
            bound = np.abs(row).max()
            ranges = np.vstack((np.full(width, -bound), np.full(width, bound)))
            assert np.array_equal(ours[i], quantize_embeddings(row[None], precision, ranges=ranges)[0])
            assert np.array_equal(ours[i], quantize(row[None], precision)[0])  # alone or in a batch: the same
        low, high = (-128, 127) if precision == "int8" else (0, 255)
        assert ours.min() == low and ours.max() == high  # a vector's largest |value| lands on an end
    codes = quantize(x, "int8").astype(np.float32) + 0.5  # ~ a scaled copy of the vector: cosine survives
    cos = (codes / np.linalg.norm(codes, axis=1, keepdims=True) * x).sum(axis=1)
    assert cos.min() > 0.999


def test_calibration_ranges_file_is_checked(tmp_path: Path) -> None:
    good = tmp_path / "ranges.npy"
    np.save(good, calibration_ranges(np.random.default_rng(0).normal(size=(50, 8))))
    assert load_ranges(str(good)).shape == (2, 8)
    assert ServerConfig(quantization_ranges=str(good)).quantization_ranges == str(good)
    for name, value, needle in [("shape.npy", np.zeros((3, 8)), r"shape \(2, dim\)"),
                                ("order.npy", np.array([[1.0, 0.0], [0.0, 1.0]]), "minima"),
                                ("nan.npy", np.array([[np.nan], [1.0]]), "finite")]:
        np.save(tmp_path / name, value)
        with pytest.raises(ValueError, match=needle):
            ServerConfig(quantization_ranges=str(tmp_path / name))
    (tmp_path / "text.npy").write_text("not an array")
    with pytest.raises(ValueError, match="cannot read a .npy array"):
        load_ranges(str(tmp_path / "text.npy"))


# --- Cohere v2 with the real client ----------------------------------------------------------------------------

def _cohere(url: str):  # noqa: ANN202
    import cohere

    return cohere.ClientV2(api_key="unused", base_url=url, timeout=60)


def test_cohere_client_embed_every_type(url: str, minilm_engine: Engine) -> None:
    response = _cohere(url).embed(model=MODEL, input_type="classification", texts=TEXTS, embedding_types=TYPES)
    expected = minilm_engine.embed(TEXTS)
    e = response.embeddings
    floats = np.array(e.float_, dtype=np.float32)
    assert np.abs(floats - expected).max() <= 1e-5
    for name in ("int8", "uint8", "binary", "ubinary"):
        assert np.array_equal(np.array(getattr(e, name)), quantize(floats, name)), name  # type: ignore[arg-type]
    assert np.array(e.int8).min() >= -128 and np.array(e.uint8).max() <= 255 and len(e.binary[0]) == 384 // 8
    decoded = np.array([np.frombuffer(base64.b64decode(s), dtype="<f4") for s in e.base64])
    assert np.array_equal(decoded, floats)
    assert response.texts == TEXTS and response.response_type == "embeddings_by_type"
    tokens = sum(o.num_prompt_tokens for o in minilm_engine.encode(TEXTS))
    assert response.meta.api_version.version == "2" and response.meta.tokens.input_tokens == tokens


def test_cohere_input_type_selects_the_workflow_prompt(url: str, minilm_engine: Engine) -> None:
    co = _cohere(url)
    query = co.embed(model=MODEL, input_type="search_query", texts=TEXTS[:2], embedding_types=["float"])
    doc = co.embed(model=MODEL, input_type="search_document", texts=TEXTS[:2])  # float is the default type
    plain = co.embed(model=MODEL, input_type="clustering", texts=TEXTS[:2])  # no such prompt: the text as is
    assert np.abs(np.array(query.embeddings.float_) - minilm_engine.embed(["q: " + t for t in TEXTS[:2]])).max() <= 1e-5
    assert np.abs(np.array(doc.embeddings.float_) - minilm_engine.embed(["d: " + t for t in TEXTS[:2]])).max() <= 1e-5
    assert np.abs(np.array(plain.embeddings.float_) - minilm_engine.embed(TEXTS[:2])).max() <= 1e-5
    by_name = httpx.post(f"{url}/v2/embed", json={"texts": ["x"], "input_type": "document"}).json()
    assert np.abs(np.array(by_name["embeddings"]["float"][0]) - minilm_engine.embed("d: x")).max() <= 1e-5
    inputs = httpx.post(f"{url}/v2/embed", json={"inputs": [{"content": [{"type": "text", "text": TEXTS[0]}]}],
                                                 "output_dimension": 64}).json()
    short = minilm_engine.embed(TEXTS[0], dimensions=64)
    assert np.abs(np.array(inputs["embeddings"]["float"][0]) - short).max() <= 1e-5


@pytest.mark.parametrize("body,status,param,needle", [
    ({"texts": ["x"], "input_type": "nonsense"}, 422, "input_type", "defined prompts: ['document', 'query']"),
    ({"texts": ["x"], "input_type": "image"}, 424, "input_type", "text only"),
    ({"images": ["data:image/png;base64,AAAA"]}, 424, "images", "text only"),
    ({"inputs": [{"content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 424, "inputs[0].content",
     "image_url"),
    ({"texts": ["x"], "inputs": [{"content": [{"type": "text", "text": "y"}]}]}, 422, "inputs", "one of them"),
    ({"texts": []}, 400, "texts", "empty"),
    ({"texts": ["x"], "embedding_types": ["int4"]}, 422, "embedding_types.0", "embedding_types"),
    ({"texts": ["x"], "max_tokens": 10}, 422, "max_tokens", "below the model's limit of 256"),
    ({"texts": ["word " * 300], "truncate": "NONE"}, 422, "texts[0]", "more than the limit of 256"),
    ({"texts": ["x"], "model": "embed-v4.0"}, 404, "model", "not served here"),
])
def test_cohere_embed_errors(url: str, body: dict, status: int, param: str, needle: str) -> None:
    r = httpx.post(f"{url}/v2/embed", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_cohere_embed_truncation_modes(url: str, minilm_engine: Engine) -> None:
    long = "word " * 300
    end = httpx.post(f"{url}/v2/embed", json={"texts": [long]}).json()  # Cohere's default: END
    start = httpx.post(f"{url}/v2/embed", json={"texts": [long + "finally"], "truncate": "START"}).json()
    assert np.abs(np.array(end["embeddings"]["float"][0]) - minilm_engine.embed(long, truncate=True)).max() <= 1e-5
    left = minilm_engine.embed(long + "finally", truncate=True, truncation_direction="left")
    assert np.abs(np.array(start["embeddings"]["float"][0]) - left).max() <= 1e-5


def test_cohere_client_rerank_v2(reranker: tuple[str, Engine]) -> None:
    url, offline = reranker
    expected = offline.rerank(QUERY, DOCS)
    response = _cohere(url).rerank(model="ce", query=QUERY, documents=DOCS, top_n=2)
    assert_ranked([(r.index, r.relevance_score) for r in response.results], dict(expected), top_n=2)
    assert response.meta.api_version.version == "2" and response.meta.tokens.input_tokens > 0
    vllm = httpx.post(f"{url}/v2/rerank", json={"query": QUERY, "documents": DOCS}).json()  # vLLM's shape too
    assert_ranked([(r["index"], r["relevance_score"]) for r in vllm["results"]], dict(expected))
    assert all(r["document"] == {"text": DOCS[r["index"]]} for r in vllm["results"])
    assert vllm["usage"]["total_tokens"] > 0
    long_doc = DOCS[0] + " and more" * 400
    capped = httpx.post(f"{url}/v2/rerank", json={"query": QUERY, "documents": [long_doc], "max_tokens_per_doc": 4096})
    assert capped.status_code == 200, capped.text  # Cohere truncates to the cap: here the model's 512 tokens
    assert capped.json()["results"][0]["relevance_score"] == pytest.approx(
        float(offline.score([(QUERY, long_doc)], truncate=True)[0]), abs=1e-5)
    uncapped = httpx.post(f"{url}/v2/rerank", json={"query": QUERY, "documents": [long_doc]})
    assert uncapped.status_code == 422 and uncapped.json()["error"]["param"] == "documents[0]"
    low = httpx.post(f"{url}/v2/rerank", json={"query": QUERY, "documents": DOCS, "max_tokens_per_doc": 100})
    assert low.status_code == 422 and low.json()["error"]["param"] == "max_tokens_per_doc"


def test_v2_routes_on_the_wrong_model_are_424(url: str, reranker: tuple[str, Engine]) -> None:
    # an embedder reranks with its scorer (cosine): tests/test_scorer.py
    wrong = httpx.post(f"{reranker[0]}/v2/embed", json={"texts": ["a"]})
    assert wrong.status_code == 424 and "embedding model" in wrong.json()["error"]["message"]


# --- vLLM /v1/score ----------------------------------------------------------------------------------------------

def test_vllm_v1_score(reranker: tuple[str, Engine], url: str, minilm_engine: Engine) -> None:
    ce_url, offline = reranker
    body = httpx.post(f"{ce_url}/v1/score", json={"model": "ce", "text_1": QUERY, "text_2": DOCS}).json()
    assert set(body) == {"id", "object", "created", "model", "data", "usage"} and body["object"] == "list"
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["object"] for d in body["data"]} == {"score"}
    assert [d["score"] for d in body["data"]] == pytest.approx(offline.score([(QUERY, d) for d in DOCS]).tolist(),
                                                               abs=1e-5)
    pairs = httpx.post(f"{url}/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[2:]}).json()
    e = minilm_engine.embed(TEXTS)
    assert [d["score"] for d in pairs["data"]] == pytest.approx([float(e[0] @ e[2]), float(e[1] @ e[3])], abs=1e-5)


# --- quantized outputs on /v1/embeddings (openai client) and TEI /embed ---------------------------------------

def test_openai_client_embed_dtype(url: str, minilm_engine: Engine) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    floats = minilm_engine.embed(TEXTS)
    for dtype in ("int8", "uint8", "binary", "ubinary"):
        # encoding_format="float" is needed: given no format, the client asks for base64 and reads float32 bytes.
        got = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float",
                                       extra_body={"embed_dtype": dtype})
        assert np.array_equal(np.array([d.embedding for d in got.data]), quantize(floats, dtype)), dtype
    raw = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS, "embed_dtype": "ubinary",
                                                   "encoding_format": "base64"}).json()
    packed = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype=np.uint8) for d in raw["data"]])
    assert np.array_equal(packed, quantize_embeddings(floats, "ubinary"))
    plain = client.embeddings.create(model=MODEL, input=TEXTS)  # float32 base64 stays what the client decodes
    assert np.abs(np.array([d.embedding for d in plain.data]) - floats).max() <= 1e-5
    bad = httpx.post(f"{url}/v1/embeddings", json={"input": "x", "embed_dtype": "fp4"})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "embed_dtype"


def test_tei_embed_quantized_and_base64(url: str, minilm_engine: Engine) -> None:
    floats = minilm_engine.embed(TEXTS)
    binary = httpx.post(f"{url}/embed", json={"inputs": TEXTS, "embed_dtype": "binary"}).json()
    assert np.array_equal(np.array(binary), quantize_embeddings(floats, "binary"))
    b64 = httpx.post(f"{url}/embed", json={"inputs": TEXTS[0], "encoding_format": "base64"}).json()
    assert np.abs(np.frombuffer(base64.b64decode(b64[0]), dtype="<f4") - floats[0]).max() <= 1e-5
    int8 = httpx.post(f"{url}/embed", json={"inputs": TEXTS, "embed_dtype": "int8", "encoding_format": "base64"}).json()
    assert np.array_equal(np.array([np.frombuffer(base64.b64decode(s), dtype=np.int8) for s in int8]),
                          quantize(floats, "int8"))


def test_int8_with_the_servers_calibration_ranges(embedder: tuple[str, object], minilm_engine: Engine,
                                                  tmp_path: Path) -> None:
    url, app = embedder
    calibration = minilm_engine.embed([f"calibration sentence {i} about {t}" for i, t in enumerate(TEXTS * 10)])
    path = tmp_path / "ranges.npy"
    np.save(path, calibration_ranges(calibration))
    config = app.state.service.config  # type: ignore[attr-defined]
    config.quantization_ranges = str(path)  # what `wde serve --quantization-ranges` sets
    try:
        floats = minilm_engine.embed(TEXTS)
        for dtype in ("int8", "uint8"):
            got = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS, "embed_dtype": dtype}).json()
            expected = quantize_embeddings(floats, dtype, calibration_embeddings=calibration)
            assert np.array_equal(np.array([d["embedding"] for d in got["data"]]), expected)
        typed = _cohere(url).embed(model=MODEL, input_type="clustering", texts=TEXTS, embedding_types=["uint8"])
        assert np.array_equal(np.array(typed.embeddings.uint8),
                              quantize_embeddings(floats, "uint8", calibration_embeddings=calibration))
        narrow = httpx.post(f"{url}/v1/embeddings", json={"input": "x", "embed_dtype": "int8", "dimensions": 64})
        assert narrow.status_code == 424 and "cover 384 dimensions but these embeddings have 64" in narrow.text
        binary = httpx.post(f"{url}/v1/embeddings", json={"input": "x", "embed_dtype": "binary", "dimensions": 64})
        assert binary.status_code == 200 and len(binary.json()["data"][0]["embedding"]) == 8
    finally:
        config.quantization_ranges = None


# --- TEI /embed_all, /similarity, /decode -------------------------------------------------------------------------

def test_tei_embed_all_equals_transformers_hidden_states(url: str, minilm_path: Path) -> None:
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path)
    model = AutoModel.from_pretrained(minilm_path).eval()
    got = httpx.post(f"{url}/embed_all", json={"inputs": TEXTS}).json()
    single = httpx.post(f"{url}/embed_all", json={"inputs": TEXTS[1]}).json()
    assert len(got) == len(TEXTS) and len(single) == 1
    for text, states in zip(TEXTS, got):
        with torch.no_grad():
            ref = model(**tok(text, return_tensors="pt")).last_hidden_state[0].numpy()
        assert np.array(states).shape == ref.shape  # every token, [CLS] and [SEP] included
        assert np.abs(np.array(states) - ref).max() <= 1e-4
    assert np.abs(np.array(single[0]) - np.array(got[1])).max() <= 1e-5  # alone or batched
    dense = httpx.post(f"{url}/embed", json={"inputs": TEXTS}).json()  # the same server still pools as before
    mean = np.array(got[0]).mean(axis=0)
    assert np.abs(np.array(dense[0]) - mean / np.linalg.norm(mean)).max() <= 1e-4


def test_embed_all_needs_token_states(reranker: tuple[str, Engine]) -> None:
    r = httpx.post(f"{reranker[0]}/embed_all", json={"inputs": "x"})
    assert r.status_code == 424 and r.json()["error_type"] == "Backend"
    assert "'token_embeddings'" in r.json()["error"] and "produces ['score']" in r.json()["error"]


def test_tei_similarity(url: str, minilm_engine: Engine) -> None:
    r = httpx.post(f"{url}/similarity", json={"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]}})
    assert r.status_code == 200, r.text
    e = minilm_engine.embed(TEXTS)
    assert r.json() == pytest.approx([float(e[0] @ v) for v in e[1:]], abs=1e-5)
    empty = httpx.post(f"{url}/similarity", json={"inputs": {"source_sentence": "a", "sentences": []}})
    assert empty.status_code == 400 and empty.json() == {"error": empty.json()["error"], "error_type": "Empty"}
    assert "inputs.sentences is empty" in empty.json()["error"]


def test_tei_decode(url: str, minilm_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path)
    ids = [tok(t)["input_ids"] for t in TEXTS[:2]]
    one = httpx.post(f"{url}/decode", json={"ids": ids[0]}).json()
    assert one == [tok.decode(ids[0], skip_special_tokens=True)] and one[0] == "a man is eating food."
    both = httpx.post(f"{url}/decode", json={"ids": ids, "skip_special_tokens": False}).json()
    assert both == [tok.decode(x) for x in ids] and both[0].startswith("[CLS]")
    for body, status, needle in [({"ids": [[5, 6, 7], [1, 2, 10**6]]}, 422, "ids[1][2] is 1000000"),
                                 ({"ids": [-1]}, 422, "ids[0] is -1"),
                                 ({"ids": []}, 400, "ids is empty"),
                                 ({"ids": [[1], []]}, 400, "ids[1] is empty"),
                                 ({"ids": [[1]] * 17}, 422, "batch size 17"),
                                 ({"ids": "hello"}, 422, "ids")]:
        r = httpx.post(f"{url}/decode", json=body)
        assert r.status_code == status and needle in r.json()["error"], r.text


# --- the docs list every route -----------------------------------------------------------------------------------

def test_http_api_doc_lists_every_route(url: str) -> None:
    doc = (Path(__file__).parents[1] / "docs" / "http_api.md").read_text(encoding="utf-8")
    paths = set(httpx.get(f"{url}/openapi.json").json()["paths"])
    assert {"/v2/embed", "/v2/rerank", "/v1/score", "/embed_all", "/similarity", "/decode"} <= paths
    missing = sorted(p for p in paths if f"`{p}`" not in doc)
    assert not missing, f"docs/http_api.md does not name {missing} (as `{missing[0]}`)"
