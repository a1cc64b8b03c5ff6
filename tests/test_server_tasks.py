"""Server routes of non-embedding workflows: rerank/score (cross-encoder), classify/predict, bge-m3 pooling."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest

from tests.ranking import assert_ranked
from tests.test_server import serve, serve_split
from wde import Engine, PoolingParams

QUERY = "how many people live in berlin"
DOCS = ["Berlin has a population of 3.5 million.", "The cat sat on the mat.", "Paris is in France.",
        "Around 3.7 million people live in Berlin."]


@pytest.fixture(scope="module")
def cross_encoder_path(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real MiniLM encoder under a random one-logit head (see ../shared/recipes/cross_encoder.py)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("minilm-crossenc")
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(minilm_path, num_labels=1).save_pretrained(out)
    AutoTokenizer.from_pretrained(minilm_path).save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=("one process", "api-servers=2"))
def reranker(request: pytest.FixtureRequest, cross_encoder_path: Path) -> Iterator[tuple[str, Engine]]:
    """Served in one process, and split (API servers tokenize the pairs, token type ids included)."""
    with Engine.from_workflow("cross_encoder", cross_encoder_path) as offline:
        if request.param == "api-servers=2":
            with serve_split(cross_encoder_path, 2, "--workflow", "cross_encoder", "--served-model-name", "ce",
                             "--max-client-batch-size", "16") as (url, _):
                yield url, offline
            return
        with Engine.from_workflow("cross_encoder", cross_encoder_path) as served, \
                serve(served, served_model_name="ce", max_client_batch_size=16) as (url, _):
            yield url, offline


def test_rerank_cohere_shape_equals_offline(reranker: tuple[str, Engine]) -> None:
    url, offline = reranker
    expected = offline.rerank(QUERY, DOCS)
    body = httpx.post(f"{url}/v1/rerank", json={"query": QUERY, "documents": DOCS, "model": "ce"}).json()
    assert_ranked([(r["index"], r["relevance_score"]) for r in body["results"]], dict(expected))
    assert all(r["document"] == {"text": DOCS[r["index"]]} for r in body["results"])
    assert body["usage"]["total_tokens"] > 0
    top = httpx.post(f"{url}/rerank", json={"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2,
                                            "return_documents": False}).json()
    assert_ranked([(r["index"], r["relevance_score"]) for r in top["results"]], dict(expected), top_n=2)
    assert "document" not in top["results"][0]


def test_rerank_tei_shape_equals_offline(reranker: tuple[str, Engine]) -> None:
    url, offline = reranker
    expected = offline.rerank(QUERY, DOCS)
    ranks = httpx.post(f"{url}/rerank", json={"query": QUERY, "texts": DOCS, "return_text": True}).json()
    assert_ranked([(r["index"], r["score"]) for r in ranks], dict(expected))
    assert all(r["text"] == DOCS[r["index"]] for r in ranks)
    raw = httpx.post(f"{url}/rerank", json={"query": QUERY, "texts": DOCS, "raw_scores": True}).json()
    logits = offline.score([(QUERY, d) for d in DOCS], activation=False)
    assert {r["index"]: r["score"] for r in raw} == pytest.approx(dict(enumerate(logits.tolist())), abs=1e-5)
    assert "text" not in raw[0]


def test_score_pairs_and_one_to_many(reranker: tuple[str, Engine]) -> None:
    url, offline = reranker
    one_to_many = httpx.post(f"{url}/score", json={"text_1": QUERY, "text_2": DOCS}).json()
    expected = offline.score([(QUERY, d) for d in DOCS])
    assert [d["score"] for d in one_to_many["data"]] == pytest.approx(expected.tolist(), abs=1e-5)
    pairs = httpx.post(f"{url}/score", json={"text_1": DOCS[:2], "text_2": DOCS[2:]}).json()
    assert [d["score"] for d in pairs["data"]] == pytest.approx(
        offline.score(list(zip(DOCS[:2], DOCS[2:]))).tolist(), abs=1e-5)
    bad = httpx.post(f"{url}/score", json={"text_1": DOCS[:2], "text_2": DOCS[:3]})
    assert bad.status_code == 422 and "text_1 has 2 texts and text_2 has 3" in bad.json()["error"]["message"]


def test_reranker_errors_and_info(reranker: tuple[str, Engine]) -> None:
    url, offline = reranker
    assert httpx.post(f"{url}/v1/embeddings", json={"input": "x"}).status_code == 424
    too_many = httpx.post(f"{url}/rerank", json={"query": QUERY, "texts": ["d"] * 17})
    assert too_many.status_code == 422 and "batch size 17 > maximum allowed batch size 16" in too_many.json()["error"]
    empty = httpx.post(f"{url}/rerank", json={"query": QUERY, "documents": []})
    assert empty.status_code == 400 and empty.json()["error"]["code"] == "empty"
    blank_query = httpx.post(f"{url}/rerank", json={"query": " ", "texts": ["d"]})
    assert blank_query.status_code == 400 and blank_query.json()["error_type"] == "Empty"
    typed = httpx.post(f"{url}/rerank", json={"query": QUERY, "texts": "not a list"})
    assert typed.status_code == 422 and "texts" in typed.json()["error"]
    info = httpx.get(f"{url}/info").json()
    assert list(info["model_type"]) == ["reranker"]
    predicted = httpx.post(f"{url}/predict", json={"inputs": [QUERY, DOCS[0]]}).json()
    assert predicted[0]["score"] == pytest.approx(float(offline.score([(QUERY, DOCS[0])])[0]), abs=1e-5)


@pytest.fixture(scope="module")
def classifier(tiny_bert: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine]]:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("tiny-cls3")
    torch.manual_seed(0)
    labels = {0: "neg", 1: "neu", 2: "pos"}
    AutoModelForSequenceClassification.from_pretrained(
        tiny_bert, num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()}).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_bert).save_pretrained(out)
    with Engine.from_workflow("sequence_classification", out) as served, \
            Engine.from_workflow("sequence_classification", out) as offline, serve(served) as (url, _):
        yield url, offline


def test_classify_and_predict_equal_offline(classifier: tuple[str, Engine]) -> None:
    url, offline = classifier
    texts = ["the water is hot", "paris and berlin"]
    body = httpx.post(f"{url}/classify", json={"input": texts}).json()
    for item, expected in zip(body["data"], offline.classify(texts)):
        probs = dict(zip(["neg", "neu", "pos"], item["probs"]))
        assert probs == pytest.approx(dict(expected), abs=1e-5)
        assert item["label"] == max(probs, key=probs.__getitem__) and item["num_classes"] == 3  # its own best
        assert_ranked([(item["label"], probs[item["label"]])], dict(expected), top_n=1)
    batch = httpx.post(f"{url}/predict", json={"inputs": [[t] for t in texts]}).json()
    assert len(batch) == len(texts)
    for row, expected in zip(batch, offline.classify(texts)):
        assert_ranked([(p["label"], p["score"]) for p in row], dict(expected))
    raw = httpx.post(f"{url}/predict", json={"inputs": texts[0], "raw_scores": True}).json()
    assert sorted(p["score"] for p in raw) == pytest.approx(
        sorted(s for _, s in offline.classify(texts[0], activation=False)[0]), abs=1e-5)
    info = httpx.get(f"{url}/info").json()
    assert info["model_type"] == {"classifier": {"id2label": {"0": "neg", "1": "neu", "2": "pos"},
                                                 "label2id": {"neg": 0, "neu": 1, "pos": 2}}}
    assert httpx.post(f"{url}/rerank", json={"query": "q", "texts": ["a"]}).status_code == 424


@pytest.fixture(scope="module")
def bge_m3(tiny_xlmr: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine]]:
    """A tiny XLM-R with random sparse and ColBERT heads saved the way bge-m3 ships them."""
    import shutil

    import torch

    out = tmp_path_factory.mktemp("tiny-m3") / "m3"
    shutil.copytree(tiny_xlmr, out)
    torch.manual_seed(0)
    torch.save(torch.nn.Linear(64, 1).state_dict(), out / "sparse_linear.pt")
    torch.save(torch.nn.Linear(64, 64).state_dict(), out / "colbert_linear.pt")
    with Engine.from_workflow("bge_m3", out) as served, Engine.from_workflow("bge_m3", out) as offline, \
            serve(served) as (url, _):
        yield url, offline


def test_bge_m3_pooling_and_embed_sparse(bge_m3: tuple[str, Engine]) -> None:
    url, offline = bge_m3
    texts = ["the water is hot", "berlin paris"]
    expected = offline.encode(texts, PoolingParams(outputs=("dense", "sparse", "colbert")))
    body = httpx.post(f"{url}/pooling", json={"input": texts}).json()
    for item, out in zip(body["data"], expected):
        assert set(item) == {"object", "index", "data", "sparse", "colbert"}  # vLLM's `data`: the embedding
        assert np.abs(np.array(item["data"]) - out.outputs["dense"]).max() <= 1e-5
        assert np.abs(np.array(item["colbert"]) - out.outputs["colbert"]).max() <= 1e-5
        assert {int(k): v for k, v in item["sparse"].items()} == pytest.approx(out.outputs["sparse"], abs=1e-5)
    only = httpx.post(f"{url}/pooling", json={"input": texts[0], "outputs": ["sparse"]}).json()["data"][0]
    assert set(only) == {"object", "index", "data", "sparse"}
    colbert = httpx.post(f"{url}/pooling", json={"input": texts, "task": "token_embed", "outputs": []}).json()
    for item, out in zip(colbert["data"], expected):  # vLLM's token_embed: one vector per token, bge-m3's ColBERT
        assert set(item) == {"object", "index", "data"}
        assert np.abs(np.array(item["data"]) - out.outputs["colbert"]).max() <= 1e-5
    sparse = httpx.post(f"{url}/embed_sparse", json={"inputs": texts}).json()
    for row, out in zip(sparse, expected):
        assert {v["index"]: v["value"] for v in row} == pytest.approx(out.outputs["sparse"], abs=1e-5)
        assert [v["index"] for v in row] == sorted(v["index"] for v in row)
    wrong = httpx.post(f"{url}/pooling", json={"input": "x", "outputs": ["logits"]})
    assert wrong.status_code == 422 and "['logits']" in wrong.json()["error"]["message"]
