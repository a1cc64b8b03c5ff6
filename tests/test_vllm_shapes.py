"""vLLM's /pooling, /score and `truncate_prompt_tokens`, with the HTTP bodies vLLM's clients and docs send.

References are computed without WDE: sentence-transformers (SentenceTransformer, CrossEncoder) and transformers
on token ids truncated by hand with the model's tokenizer, as vLLM truncates (`truncation=True, max_length=N`).
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest

from tests import tiny_heads
from tests.test_server import serve, serve_split
from wde import Engine

TOL = 1e-4
TEXTS = ["vLLM is great!", "The capital of France is Paris.", "A man is eating food."]
QUERY = "What is the capital of France?"
DOCS = ["The capital of Brazil is Brasilia.", "The capital of France is Paris.", "Cats sleep a lot."]
LONG = " ".join(f"w{i} alpha beta{i % 7}" for i in range(200))
"""About 1,000 MiniLM tokens: four times its limit of 256."""


@pytest.fixture(scope="module")
def embedder(minilm_path: Path) -> Iterator[str]:
    with Engine.from_workflow("bert", minilm_path) as engine, serve(engine) as (url, _):
        yield url


@pytest.fixture(scope="module")
def st_model(minilm_path: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path), device="cpu")


def _mean_pooled(minilm_path: Path, ids: list[int]) -> np.ndarray:
    """all-MiniLM-L6-v2 by hand (mean of the token states, normalized) on exactly these token ids."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(minilm_path).eval()
    with torch.inference_mode():
        states = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    v = states.mean(0).numpy()
    return v / np.linalg.norm(v)


def test_pooling_in_vllms_shape(embedder: str, st_model) -> None:
    """vLLM's examples/pooling client body: `data[i].data` is the embedding, the envelope vLLM's."""
    r = httpx.post(f"{embedder}/pooling", json={"model": "all-MiniLM-L6-v2", "input": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("pool-") and isinstance(body["created"], int)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    expected = st_model.encode(TEXTS)
    for i, item in enumerate(body["data"]):
        assert item.keys() == {"index", "object", "data"} and item["object"] == "pooling" and item["index"] == i
        assert np.abs(np.array(item["data"]) - expected[i]).max() <= TOL
    task = httpx.post(f"{embedder}/pooling", json={"input": TEXTS[0], "task": "embed", "encoding_format": "base64"})
    vector = np.frombuffer(base64.b64decode(task.json()["data"][0]["data"]), dtype="<f4")
    assert np.abs(vector - expected[0]).max() <= TOL
    raw = httpx.post(f"{embedder}/pooling", json={"input": TEXTS[0], "use_activation": False}).json()["data"][0]["data"]
    assert abs(np.linalg.norm(raw) - 1) > 1e-3  # unnormalized, the same direction
    assert np.abs(np.array(raw) / np.linalg.norm(raw) - expected[0]).max() <= TOL
    tokens = httpx.post(f"{embedder}/pooling", json={"input": TEXTS[0], "task": "token_embed"}).json()["data"][0]
    states = st_model.encode(TEXTS[0], output_value="token_embeddings").numpy()
    assert np.array(tokens["data"]).shape == states.shape and np.abs(np.array(tokens["data"]) - states).max() <= TOL


@pytest.mark.parametrize(("body", "status", "field"), [
    ({"input": "x", "task": "classify"}, 424, "task"),
    ({"input": "x", "task": "plugin"}, 424, "task"),
    ({"input": "x", "task": "token_classify"}, 424, "task"),
    ({"input": "x", "task": "generate"}, 422, "task"),
    ({"input": "x", "encoding_format": "bytes"}, 422, "encoding_format"),
    ({"input": "x", "encoding_format": "base64", "embed_dtype": "fp8_e4m3"}, 422, "embed_dtype"),
    ({"input": "x", "embed_dtype": "float16"}, 422, "embed_dtype"),  # JSON numbers have no element type
    ({"input": "x", "encoding_format": "base64", "endianness": "middle"}, 422, "endianness"),
    ({"input": "x", "normalize": True, "use_activation": False}, 422, "use_activation"),
    ({"input": "x", "truncation_side": "left", "truncation_direction": "right"}, 422, "truncation_side"),
])
def test_pooling_refuses_what_it_does_not_serve(embedder: str, body: dict, status: int, field: str) -> None:
    """Named, never dropped: an fp8 answer read as another type would be silently wrong."""
    r = httpx.post(f"{embedder}/pooling", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == field


@pytest.mark.parametrize("route", ["/v1/embeddings", "/pooling"])
def test_truncate_prompt_tokens(embedder: str, minilm_path: Path, route: str) -> None:
    """-1 truncates to the model's limit, N to N tokens (special tokens kept, the first ones unless
    `truncation_side: left`), N above the limit is a 4xx naming the field and the limit."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path)
    key = "embedding" if route == "/v1/embeddings" else "data"

    def post(**extra) -> httpx.Response:
        return httpx.post(f"{embedder}{route}", json={"model": "all-MiniLM-L6-v2", "input": [LONG], **extra})

    assert post().status_code == 422  # over-long, as before
    for n, side in ((-1, None), (256, None), (16, None), (16, "left")):
        extra = {"truncate_prompt_tokens": n} | ({"truncation_side": side} if side else {})
        r = post(**extra)
        assert r.status_code == 200, (extra, r.text)
        tok.truncation_side = side or "right"
        ids = tok(LONG, truncation=True, max_length=256 if n == -1 else n)["input_ids"]
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        assert np.abs(np.array(r.json()["data"][0][key]) - _mean_pooled(minilm_path, ids)).max() <= TOL, extra
    for n, needle in ((257, "limit of 256"), (0, "no token"), (-2, "")):
        r = post(truncate_prompt_tokens=n)
        assert r.status_code == 422 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
        assert needle in r.json()["error"]["message"]


def test_truncate_prompt_tokens_on_token_ids(embedder: str, minilm_path: Path) -> None:
    """Token ids are cut as they are, the first N (vLLM slices a token prompt the same way)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(minilm_path)(TEXTS[1])["input_ids"]
    r = httpx.post(f"{embedder}/v1/embeddings", json={"input": [ids], "truncate_prompt_tokens": 5})
    assert r.status_code == 200, r.text
    assert np.abs(np.array(r.json()["data"][0]["embedding"]) - _mean_pooled(minilm_path, ids[:5])).max() <= TOL


def test_truncate_prompt_tokens_on_a_split_server(minilm_path: Path) -> None:
    """With API-server processes the frontend tokenizes, and truncates the same way."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(minilm_path)(LONG, truncation=True, max_length=16)["input_ids"]
    with serve_split(minilm_path, 2) as (url, _):
        r = httpx.post(f"{url}/v1/embeddings", json={"input": LONG, "truncate_prompt_tokens": 16})
        score = httpx.post(f"{url}/score", json={"queries": "a", "items": [LONG], "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and score.status_code == 200, (r.text, score.text)
    assert np.abs(np.array(r.json()["data"][0]["embedding"]) - _mean_pooled(minilm_path, ids)).max() <= TOL


def test_score_on_an_embedder_is_cosine(embedder: str, st_model) -> None:
    r = httpx.post(f"{embedder}/v1/score", json={"model": "all-MiniLM-L6-v2", "queries": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    q, *d = st_model.encode([QUERY, *DOCS])
    assert [x["score"] for x in r.json()["data"]] == pytest.approx([float(q @ v) for v in d], abs=TOL)


@pytest.fixture(scope="module")
def cross_encoder(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_heads.build_minilm_classifier(minilm_path, tmp_path_factory.mktemp("vllm-ce"), num_labels=1)


@pytest.fixture(scope="module")
def reranker(cross_encoder: Path) -> Iterator[str]:
    with Engine.from_workflow("cross_encoder", cross_encoder) as engine, \
            serve(engine, served_model_name="BAAI/bge-reranker-v2-m3") as (url, _):
        yield url


@pytest.fixture(scope="module")
def ce(cross_encoder: Path):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(cross_encoder), device="cpu")


@pytest.mark.parametrize("sides", [("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
                                   ("text_1", "text_2")])
@pytest.mark.parametrize("route", ["/score", "/v1/score"])
def test_score_every_field_pair(reranker: str, ce, sides: tuple[str, str], route: str) -> None:
    """vLLM's score bodies (1:N, N:N, 1:1) equal CrossEncoder.predict on the same pairs."""
    first, second = sides
    model = "BAAI/bge-reranker-v2-m3"
    for left, right in ((QUERY, DOCS), (DOCS[:2], [QUERY, QUERY]), (QUERY, DOCS[1]), ([QUERY], DOCS)):
        r = httpx.post(f"{reranker}{route}", json={"model": model, first: left, second: right})
        assert r.status_code == 200, r.text
        body = r.json()
        rights = [right] if isinstance(right, str) else right
        lefts = [left] * len(rights) if isinstance(left, str) or len(left) == 1 else left
        pairs = [(a if isinstance(a, str) else a[0], b) for a, b in zip(lefts, rights)]
        expected = ce.predict(pairs)
        assert body["object"] == "list" and body["model"] == model and body["usage"]["total_tokens"] > 0
        assert [(x["index"], x["object"]) for x in body["data"]] == [(i, "score") for i in range(len(pairs))]
        assert np.abs(np.array([x["score"] for x in body["data"]]) - expected).max() <= TOL


def test_score_logits_and_truncation(reranker: str, ce, cross_encoder: Path) -> None:
    from sentence_transformers import CrossEncoder

    raw = httpx.post(f"{reranker}/score", json={"queries": QUERY, "documents": DOCS, "use_activation": False})
    import torch

    logits = ce.predict([(QUERY, d) for d in DOCS], activation_fn=torch.nn.Identity())
    assert np.abs(np.array([x["score"] for x in raw.json()["data"]]) - logits).max() <= TOL
    long = {"queries": QUERY, "documents": [LONG, DOCS[0]]}
    assert httpx.post(f"{reranker}/score", json=long).status_code == 422
    r = httpx.post(f"{reranker}/score", json=long | {"truncate_prompt_tokens": -1})
    assert r.status_code == 200, r.text
    limit = httpx.get(f"{reranker}/v1/models").json()["data"][0]["max_model_len"]
    capped = CrossEncoder(str(cross_encoder), device="cpu", max_length=limit)
    expected = capped.predict([(QUERY, LONG), (QUERY, DOCS[0])])
    assert np.abs(np.array([x["score"] for x in r.json()["data"]]) - expected).max() <= TOL
    over = httpx.post(f"{reranker}/score", json=long | {"truncate_prompt_tokens": limit + 1})
    assert over.status_code == 422 and over.json()["error"]["param"] == "truncate_prompt_tokens"
    assert f"limit of {limit} tokens" in over.json()["error"]["message"]


@pytest.mark.parametrize(("body", "field", "needle"), [
    ({"queries": QUERY, "text_2": DOCS}, "text_2", "queries, text_2 given"),
    ({"queries": QUERY, "documents": DOCS, "items": DOCS}, "items", "exactly one field pair"),
    ({"data_1": QUERY, "documents": DOCS}, "data_1", "documents, data_1 given"),
    ({"queries": QUERY}, "queries", "queries given"),
    ({"truncate": False}, "text_1", "missing"),
    ({"queries": [], "documents": DOCS}, "queries", "empty"),
    ({"queries": DOCS[:2], "documents": DOCS}, "queries", "as many as documents"),
    ({"queries": QUERY, "documents": DOCS, "raw_scores": True, "use_activation": True}, "use_activation", "contradict"),
])
def test_score_refuses_mixed_or_incomplete_pairs(reranker: str, body: dict, field: str, needle: str) -> None:
    r = httpx.post(f"{reranker}/v1/score", json=body)
    assert r.status_code in (400, 422), r.text
    assert r.json()["error"]["param"] == field and needle in r.json()["error"]["message"], r.json()
