"""Request shapes of issue 34 on TEI's paths, with the exact HTTP bodies their clients send: TEI's /vertex (Vertex
AI custom containers), TEI's error shape (`error_type` spelled as TEI's serde writes it), and vLLM's /tokenize and
/detokenize bodies on the paths TEI's /tokenize shares with them.

Vectors are checked against sentence-transformers (<= 1e-4), tokens against the model's own tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest

from tests import tiny_heads
from tests.test_server import serve
from wde import Engine

MODEL = "minilm"
TEXTS = ["A man is eating food.", "Berlin has 3.5 million people."]
LONG = "word " * 400
"""Over MiniLM's 256 tokens."""


@pytest.fixture(scope="module")
def url(minilm_path: Path) -> Iterator[str]:
    with Engine.from_workflow("bert", minilm_path) as engine, serve(engine, served_model_name=MODEL) as (base, _):
        yield base


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tiny_heads.build_xlmr_classifier(tmp_path_factory.mktemp("rr") / "reranker", num_labels=1)
    with Engine.from_workflow("bge_reranker_v2_m3", path) as engine, serve(engine) as (base, _):
        yield base


@pytest.fixture(scope="module")
def tokenizer(minilm_path: Path):  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(minilm_path))


def _post(url: str, path: str, body: object) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


# --- /vertex --------------------------------------------------------------------------------------------------

def test_vertex_embed_instances_answer_as_embed(url: str, minilm_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    body = {"instances": [{"inputs": TEXTS[0]}, {"inputs": TEXTS, "normalize": False}]}
    r = _post(url, "/vertex", body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert list(got) == ["predictions"] and len(got["predictions"]) == 2
    assert got["predictions"][0] == _post(url, "/embed", body["instances"][0]).json()
    assert got["predictions"][1] == _post(url, "/embed", body["instances"][1]).json()
    expected = SentenceTransformer(str(minilm_path), device="cpu").encode(TEXTS)
    assert np.abs(np.asarray(got["predictions"][0][0]) - expected[0]).max() <= 1e-4
    unnormalized = np.asarray(got["predictions"][1])
    assert unnormalized.shape == (2, 384) and np.linalg.norm(unnormalized[1]) > 1.5
    cosine = unnormalized / np.linalg.norm(unnormalized, axis=1, keepdims=True)
    assert np.abs(cosine - expected).max() <= 1e-4


def test_vertex_rerank_and_predict_instances(reranker: str) -> None:
    rerank = {"query": "how many people live in berlin", "texts": ["berlin has many people", "the cat sat"]}
    predict = {"inputs": [["how many people live in berlin", "berlin has many people"]]}
    r = _post(reranker, "/vertex", {"instances": [rerank, predict]})
    assert r.status_code == 200, r.text
    ranked, predicted = r.json()["predictions"]
    assert ranked == _post(reranker, "/rerank", rerank).json()
    assert predicted == _post(reranker, "/predict", predict).json()
    assert sorted(x["index"] for x in ranked) == [0, 1] and len(predicted) == 1 and "score" in predicted[0][0]


def test_vertex_errors_name_the_instance(url: str) -> None:
    empty = _post(url, "/vertex", {"instances": []})
    assert empty.status_code == 400 and empty.json()["error_type"] == "Empty" and "instances" in empty.json()["error"]
    long = _post(url, "/vertex", {"instances": [{"inputs": "fine"}, {"inputs": LONG}]})
    assert long.status_code == 422 and set(long.json()) == {"error", "error_type"}
    assert long.json()["error_type"] == "Validation" and long.json()["error"].startswith("instances[1]")
    assert "256" in long.json()["error"]
    not_objects = _post(url, "/vertex", {"instances": ["a text"]})
    assert not_objects.status_code == 422 and "instances" in not_objects.json()["error"]
    missing = _post(url, "/vertex", {"inputs": "a"})
    assert missing.status_code == 422 and "instances" in missing.json()["error"]
    rerank_on_embedder = _post(url, "/vertex", {"instances": [{"query": "q", "texts": ["t"]}]})  # its scorer: cosine
    assert rerank_on_embedder.status_code == 200 and rerank_on_embedder.json()["predictions"][0][0]["index"] == 0


def test_vertex_runs_many_instances_in_order(url: str) -> None:
    """Instances run concurrently; a failed request (its siblings cancelled) leaves the next one whole."""
    texts = [f"sentence number {i} about {w}" for i, w in enumerate(["cats", "dogs", "rain", "trains"] * 4)]
    failed = _post(url, "/vertex", {"instances": [{"inputs": t} for t in texts] + [{"inputs": LONG}]})
    assert failed.status_code == 422 and failed.json()["error"].startswith("instances[16]")
    r = _post(url, "/vertex", {"instances": [{"inputs": t} for t in texts]})
    assert r.status_code == 200
    assert [p[0] for p in r.json()["predictions"]] == _post(url, "/embed", {"inputs": texts}).json()


# --- TEI's error shape ----------------------------------------------------------------------------------------

def test_tei_routes_answer_errors_in_tei_shape(url: str) -> None:
    """TEI's router writes `error_type` as the Rust variant's name (serde's default): `"Validation"`."""
    long = _post(url, "/embed", {"inputs": LONG, "truncate": False})
    assert long.status_code == 422 and set(long.json()) == {"error", "error_type"}, long.text
    assert long.json()["error_type"] == "Validation" and "256" in long.json()["error"]
    assert _post(url, "/embed", {"inputs": LONG, "truncate": True}).status_code == 200
    empty = _post(url, "/embed", {"inputs": []})
    assert empty.status_code == 400 and empty.json()["error_type"] == "Empty"
    wrong_route = _post(url, "/predict", {"inputs": "a"})
    assert wrong_route.status_code == 424 and wrong_route.json()["error_type"] == "Backend"
    # the OpenAI family keeps OpenAI's shape
    openai = _post(url, "/v1/embeddings", {"input": LONG, "model": MODEL})
    assert openai.status_code == 422 and set(openai.json()) == {"error", "message"}
    assert openai.json()["error"]["code"] == "too_long" and openai.json()["error"]["param"] == "input"


# --- vLLM's /tokenize and /detokenize ---------------------------------------------------------------------------

def test_vllm_tokenize_body(url: str, tokenizer) -> None:  # noqa: ANN001
    text = "Hello world, tokenized by vLLM's body."
    ids = tokenizer(text)["input_ids"]
    r = _post(url, "/tokenize", {"prompt": text, "add_special_tokens": True, "model": MODEL})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    bare = _post(url, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert bare["tokens"] == plain and bare["count"] == len(plain) == len(ids) - 2
    assert bare["token_strs"] == tokenizer.convert_ids_to_tokens(plain)
    tei = _post(url, "/tokenize", {"inputs": text})  # TEI's body keeps TEI's answer on the same path
    assert tei.status_code == 200 and [t["id"] for t in tei.json()[0]] == ids


def test_vllm_tokenize_refusals(url: str) -> None:
    both = _post(url, "/tokenize", {"inputs": "a", "prompt": "a"})
    assert both.status_code == 422 and "`inputs`" in both.json()["error"] and "`prompt`" in both.json()["error"]
    chat = _post(url, "/tokenize", {"messages": [{"role": "user", "content": "hi"}], "model": MODEL})
    assert chat.status_code == 422 and chat.json()["error"]["param"] == "messages", chat.text
    other = _post(url, "/tokenize", {"prompt": "a", "model": "gpt-4"})
    assert other.status_code == 404 and other.json()["error"]["param"] == "model"
    typed = _post(url, "/tokenize", {"prompt": 3})
    assert typed.status_code == 422 and typed.json()["error"]["param"] == "prompt"
    huge = _post(url, "/tokenize", {"prompt": "word " * 70_000})
    assert huge.status_code == 422 and huge.json()["error"]["param"] == "prompt"
    assert "65,536" in huge.json()["error"]["message"] and "70,002" in huge.json()["error"]["message"]


def test_vllm_detokenize(url: str, tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer("Detokenize me, please.")["input_ids"]
    r = _post(url, "/detokenize", {"tokens": ids, "model": MODEL})
    assert r.status_code == 200 and r.json() == {"prompt": tokenizer.decode(ids)}, r.text
    assert r.json()["prompt"].startswith("[CLS]")  # vLLM keeps special tokens
    bad = _post(url, "/detokenize", {"tokens": [101, 7592, tokenizer.vocab_size, 102]})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "tokens[2]"
    assert str(tokenizer.vocab_size) in bad.json()["error"]["message"]
    negative = _post(url, "/detokenize", {"tokens": [-1]})
    assert negative.status_code == 422 and negative.json()["error"]["param"] == "tokens[0]"
    empty = _post(url, "/detokenize", {"tokens": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "tokens"


def test_openai_style_errors_carry_a_flat_message_for_clients_written_against_tei(url: str) -> None:
    """pymilvus' TEIEmbeddingFunction posts `{"input": texts}` to /v1/embeddings and reads `message` at the top of
    an error body (TEI's OpenAI-compatible shape); OpenAI's clients read the nested `error`. Both are answered."""
    response = _post(url, "/v1/embeddings", {"input": ["word " * 2000]})
    body = response.json()
    assert response.status_code == 422 and body["message"] == body["error"]["message"] and "tokens" in body["message"]
