"""The clients users already have, unchanged, against `wde serve`: Hugging Face's `InferenceClient(base_url=URL)`
(TEI's root route, SageMaker's /invocations), TEI's /embed_all on any embedder and /embed_sparse, the `openai`
client's `models.retrieve` and its 2,048-input batches, Infinity's `infinity_client` (/embeddings, /models,
/rerank, /classify, /health at the root and under /v1), and `--no-token-id-inputs`.

Vectors are checked against sentence-transformers (<= 1e-4), scores against the offline engine, and each
route's JSON against the shape its anchor (TEI, OpenAI, Infinity) documents.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest

from tests import tiny_heads, tiny_models
from tests.ranking import assert_ranked
from tests.test_server import serve, serve_split
from wde import Engine, PoolingParams
from wde.server import ServerConfig
from wde.server.config import default_payload_limit

MODEL = "minilm"
TEXTS = ["A man is eating food.", "The new movie is awesome", "Berlin has 3.5 million people.", "hello"]
QUERY = "how many people live in berlin"
DOCS = ["the water is hot", "berlin has many people", "paris and berlin", "the cat sat"]
LABELS = {0: "neg", 1: "neu", 2: "pos"}
MEAN = "pooler.params.pooling=mean"
"""The tiny random BERT has no sentence-transformers Pooling config."""


# --- servers --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def embedder(minilm_path: Path) -> Iterator[tuple[str, object]]:
    """MiniLM as `wde serve` serves it by default: the plain `sentence` pooler, the default limits."""
    with Engine.from_workflow("bert", minilm_path) as engine, serve(engine, served_model_name=MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def url(embedder: tuple[str, object]) -> str:
    return embedder[0]


@pytest.fixture(scope="module")
def st_model(minilm_path: Path):  # noqa: ANN201
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path), device="cpu")


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine]]:
    path = tiny_heads.build_xlmr_classifier(tmp_path_factory.mktemp("cls") / "sentiment", num_labels=3,
                                            id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    with Engine.from_workflow(None, path) as served, Engine.from_workflow(None, path) as offline, \
            serve(served) as (base, _):
        yield base, offline


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine]]:
    path = tiny_heads.build_xlmr_classifier(tmp_path_factory.mktemp("rr") / "reranker", num_labels=1)
    with Engine.from_workflow("bge_reranker_v2_m3", path) as served, \
            Engine.from_workflow("bge_reranker_v2_m3", path) as offline, \
            serve(served, served_model_name="rr") as (base, _):
        yield base, offline


@pytest.fixture(scope="module")
def bge_m3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine]]:
    path = tiny_heads.build_bge_m3(tmp_path_factory.mktemp("m3") / "bge-m3")
    with Engine.from_workflow("bge_m3", path) as served, Engine.from_workflow("bge_m3", path) as offline, \
            serve(served) as (base, _):
        yield base, offline


def _close(a: object, b: object, tol: float = 1e-4) -> bool:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max()) <= tol


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


# --- Hugging Face InferenceClient(base_url=URL): TEI's root route -----------------------------------------------

@pytest.fixture
def hf_client(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """huggingface_hub's InferenceClient class; the tests run with HF_HUB_OFFLINE=1 (conftest), under which it
    refuses every request, even to a local server, so offline mode is lifted for these calls alone."""
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return InferenceClient

def test_hf_inference_client_feature_extraction_and_similarity(url: str, st_model, hf_client) -> None:  # noqa: ANN001
    client = hf_client(base_url=url)
    expected = st_model.encode(TEXTS)
    got = client.feature_extraction(TEXTS)  # POST / {"inputs": [...]}: the embedder's task, TEI's /embed
    assert got.shape == (4, 384) and _close(got, expected)
    one = client.feature_extraction(TEXTS[0], normalize=False, truncate=True)
    norm = float(np.linalg.norm(one[0]))  # TEI's normalize=false: the pooled vector before the Normalize module
    assert one.shape == (1, 384) and norm > 1.5 and _close(one[0] / norm, expected[0])
    sims = client.sentence_similarity(TEXTS[0], TEXTS[1:])  # POST / {"inputs": {"source_sentence", ...}}
    assert _close(sims, expected[1:] @ expected[0])
    # TEI's /similarity reads truncate / prompt_name from `parameters`
    long = "word " * 300
    r = httpx.post(f"{url}/similarity", json={"inputs": {"source_sentence": long, "sentences": ["word"]},
                                              "parameters": {"truncate": True}})
    assert r.status_code == 200, r.text
    bad = httpx.post(url, json={"inputs": []})  # the root route answers in TEI's error shape
    assert bad.status_code == 400 and set(bad.json()) == {"error", "error_type"} and bad.json()["error_type"] == "Empty"


def test_sagemaker_invocations_and_health(url: str, classifier: tuple[str, Engine],
                                          reranker: tuple[str, Engine], st_model) -> None:  # noqa: ANN001
    embedded = httpx.post(f"{url}/invocations", json={"inputs": TEXTS[:2]})
    assert embedded.status_code == 200 and _close(embedded.json(), st_model.encode(TEXTS[:2]))
    assert embedded.headers["x-compute-tokens"]  # TEI's timing headers, as /embed
    cls_url, cls_offline = classifier
    predicted = httpx.post(f"{cls_url}/invocations", json={"inputs": "the water is hot"}).json()
    assert_ranked([(p["label"], p["score"]) for p in predicted], dict(cls_offline.classify("the water is hot")[0]))
    assert set(predicted[0]) == {"score", "label"}
    rr_url, rr_offline = reranker
    ranked = httpx.post(f"{rr_url}/invocations", json={"query": QUERY, "texts": DOCS, "return_text": True}).json()
    scores = rr_offline.score([(QUERY, d) for d in DOCS])
    assert_ranked([(r["index"], r["score"]) for r in ranked], scores)
    assert set(ranked[0]) == {"index", "score", "text"} and all(r["text"] == DOCS[r["index"]] for r in ranked)
    root = httpx.post(rr_url, json={"query": QUERY, "texts": DOCS}).json()  # POST / too
    assert_ranked([(r["index"], r["score"]) for r in root], scores)
    assert set(root[0]) == {"index", "score"}
    missing = httpx.post(rr_url, json={"query": QUERY})  # TEI's shape, naming what is missing
    assert missing.status_code == 422 and "texts" in missing.json()["error"] and "error_type" in missing.json()
    pair = httpx.post(rr_url, json={"inputs": [QUERY, DOCS[1]]}).json()  # a /predict body is predicted
    assert pair[0]["score"] == pytest.approx(float(rr_offline.score([(QUERY, DOCS[1])])[0]), abs=1e-5)
    for path in ("/", "/ping", "/health"):
        health = httpx.get(url + path)
        assert health.status_code == 200 and isinstance(health.json()["unix"], float), path


def test_hf_inference_client_text_classification(classifier: tuple[str, Engine], hf_client) -> None:  # noqa: ANN001
    base, offline = classifier
    client = hf_client(base_url=base)
    text = "paris and berlin"
    logits = np.array([s for _, s in sorted(offline.classify(text, activation=False)[0],
                                            key=lambda x: [*LABELS.values()].index(x[0]))])

    def by_label(scores: np.ndarray) -> dict[str, float]:
        return {LABELS[i]: float(score) for i, score in enumerate(scores)}

    def pairs(out: list) -> list[tuple[str, float]]:  # noqa: ANN001
        return [(o.label, o.score) for o in out]

    default = client.text_classification(text)  # the workflow's activation: softmax
    assert_ranked(pairs(default), by_label(_softmax(logits)))
    for fn, scores in (("sigmoid", 1 / (1 + np.exp(-logits))), ("softmax", _softmax(logits)), ("none", logits)):
        for k in (None, 1, 2):
            assert_ranked(pairs(client.text_classification(text, function_to_apply=fn, top_k=k)), by_label(scores),
                          top_n=k)
    # TEI's own /predict shape stays: a single input answers a flat list; raw_scores gives logits
    raw = httpx.post(f"{base}/predict", json={"inputs": text, "raw_scores": True}).json()
    assert isinstance(raw[0], dict) and [p["score"] for p in raw] == pytest.approx(sorted(logits, reverse=True),
                                                                                abs=1e-5)
    batch = httpx.post(f"{base}/predict", json={"inputs": [[text], [DOCS[0]]], "parameters": {"top_k": 1}}).json()
    assert len(batch) == 2 and all(len(row) == 1 for row in batch)
    bad = httpx.post(f"{base}/predict", json={"inputs": text, "parameters": {"function_to_apply": "relu"}})
    assert bad.status_code == 422 and "function_to_apply" in bad.json()["error"]


# --- TEI /embed_all on the default pooler, /embed_sparse --------------------------------------------------------

def test_embed_all_on_the_default_sentence_pooler(url: str, minilm_path: Path, st_model) -> None:  # noqa: ANN001
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path)
    model = AutoModel.from_pretrained(minilm_path).eval()
    got = httpx.post(f"{url}/embed_all", json={"inputs": TEXTS[:3]})
    assert got.status_code == 200, got.text
    for text, states in zip(TEXTS, got.json()):
        with torch.no_grad():
            ref = model(**tok(text, return_tensors="pt")).last_hidden_state[0].numpy()
        assert np.array(states).shape == ref.shape and _close(states, ref)  # raw states, [CLS]/[SEP] included
    tokens = st_model.encode(TEXTS[1], output_value="token_embeddings")
    assert _close(got.json()[1], tokens)
    # the same server's other routes are unchanged: /pooling gives only the embedding (vLLM's `data`)
    pooled = httpx.post(f"{url}/pooling", json={"input": TEXTS[0]}).json()["data"][0]
    assert set(pooled) == {"object", "index", "data"}
    both = httpx.post(f"{url}/pooling", json={"input": TEXTS[0], "outputs": ["dense", "token_embeddings"]}).json()
    assert np.array(both["data"][0]["token_embeddings"]).shape == (len(tok(TEXTS[0])["input_ids"]), 384)


def test_embed_all_per_request_in_the_engine(minilm_engine: Engine) -> None:
    """Only requests that ask get token states; the others' dense vectors are the same batched with them."""
    asked = PoolingParams(outputs=("token_embeddings",))
    requests = [minilm_engine.make_request(t, p) for t, p in zip(TEXTS, [asked, None, asked, None])]
    done = minilm_engine.run(requests)  # one batch
    out = [done[r.request_id] for r in requests]
    assert "dense" in minilm_engine.supported_outputs and "token_embeddings" in minilm_engine.supported_outputs
    assert out[0].outputs["token_embeddings"].shape == (out[0].num_prompt_tokens, 384)
    assert out[1].outputs["token_embeddings"].shape[0] == 0
    assert _close(out[1].outputs["dense"], minilm_engine.embed(TEXTS[1]), 1e-5)
    alone = minilm_engine.encode([TEXTS[0]])[0]
    assert "token_embeddings" not in alone.outputs  # nobody asked: nothing extra computed


def test_embed_sparse_and_root_route_on_bge_m3(bge_m3: tuple[str, Engine], url: str) -> None:
    base, offline = bge_m3
    texts = ["the water is hot", "berlin paris"]
    expected = offline.encode(texts, PoolingParams(outputs=("dense", "sparse")))
    sparse = httpx.post(f"{base}/embed_sparse", json={"inputs": texts}).json()  # TEI: [[{index, value}]]
    for row, out in zip(sparse, expected):
        assert all(set(v) == {"index", "value"} and isinstance(v["index"], int) for v in row)
        assert [v["index"] for v in row] == sorted(v["index"] for v in row)
        assert {v["index"]: v["value"] for v in row} == pytest.approx(out.outputs["sparse"], abs=1e-5)
    root = httpx.post(base, json={"inputs": texts})  # an embedder with dense vectors: TEI's router embeds
    assert root.status_code == 200 and _close(root.json(), [o.outputs["dense"] for o in expected], 1e-5)
    no_states = httpx.post(f"{base}/embed_all", json={"inputs": "x"})
    assert no_states.status_code == 424 and no_states.json()["error_type"] == "Backend"
    assert "'bge_m3' produces ['dense', 'sparse', 'colbert']" in no_states.json()["error"]
    dense_only = httpx.post(f"{url}/embed_sparse", json={"inputs": "x"})
    assert dense_only.status_code == 424 and "sparse" in dense_only.json()["error"]


# --- OpenAI: models.retrieve, 2,048 inputs, the payload limit ---------------------------------------------------

def test_openai_models_retrieve(url: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    for name in (MODEL, "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"):  # aliases resolve
        card = client.models.retrieve(name)
        assert card.id == MODEL and card.object == "model" and card.owned_by == "wde" and card.created > 0
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("text-embedding-3-small")
    r = httpx.get(f"{url}/v1/models/text-embedding-3-small")
    assert r.status_code == 404 and set(r.json()) == {"error", "message"}
    assert r.json()["error"]["type"] == "invalid_request_error" and "not served here" in r.json()["error"]["message"]


def test_payload_limit_default_fits_a_full_batch() -> None:
    assert ServerConfig().max_client_batch_size == 2048 and ServerConfig().payload_limit is None
    limit = ServerConfig().effective_payload_limit(256)
    assert limit == default_payload_limit(2048, 256) == 2048 * (256 * 16 + 64) + 65_536
    full = json.dumps({"model": MODEL, "input": [" ".join(["berlin"] * 255)] * 2048})  # 255 words, 2 KB each
    assert 2_000_000 < len(full) < limit  # TEI's 2 MB would refuse it
    assert ServerConfig(payload_limit=1000).effective_payload_limit(256) == 1000  # an explicit limit wins
    assert ServerConfig().effective_payload_limit(8) == 2_000_000  # never below TEI's default
    assert ServerConfig(max_client_batch_size=8).effective_payload_limit(8192) == 2_000_000
    with pytest.raises(ValueError, match="max_client_batch_size"):
        ServerConfig(max_client_batch_size=0)


def test_wde_serve_options() -> None:
    from click.testing import CliRunner

    from wde.cli import serve

    params = {p.name: p for p in serve.params}
    assert params["max_client_batch_size"].default == 2048 and params["payload_limit"].default is None
    assert params["token_id_inputs"].default is True
    help_text = CliRunner().invoke(serve, ["--help"], terminal_width=200).output
    assert "--no-token-id-inputs" in help_text and "OpenAI" in help_text


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine]]:
    """A tiny BERT taking 256 tokens, served with the default limits (2,048 inputs, the derived body limit)."""
    path = tiny_models.build_bert(tmp_path_factory.mktemp("long") / "tiny")
    cfg = path / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "model_max_length": 256}))
    with Engine.from_workflow("bert", path, overrides=[MEAN]) as served, \
            Engine.from_workflow("bert", path, overrides=[MEAN]) as offline, \
            serve(served, served_model_name="tiny") as (base, _):
        yield base, offline


def test_openai_client_full_batch_of_long_texts(long_tiny: tuple[str, Engine]) -> None:
    import random

    import openai

    base, offline = long_tiny
    assert offline.max_length == 256
    rng = random.Random(0)
    words = [w for w in tiny_models.WORDS if w.isascii()]
    texts = [" ".join(rng.choice(words) for _ in range(200 + i % 40)) for i in range(2048)]
    tokens = [len(ids) for ids in offline.tokenizer.hf_tokenizer(texts)["input_ids"]]
    assert 200 <= min(tokens) and max(tokens) <= 256
    assert len(json.dumps({"model": "tiny", "input": texts})) > 2_000_000  # over the old fixed limit
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=300)
    response = client.embeddings.create(model="tiny", input=texts)
    assert len(response.data) == 2048 and response.usage.prompt_tokens == sum(tokens)
    got = np.array([response.data[i].embedding for i in (0, 1337, 2047)])
    assert _close(got, offline.embed([texts[0], texts[1337], texts[2047]]), 1e-5)
    too_many = httpx.post(f"{base}/v1/embeddings", json={"input": ["x"] * 2049})
    assert too_many.status_code == 422 and "maximum allowed batch size 2048" in too_many.json()["error"]["message"]
    limit = default_payload_limit(2048, 256)
    over = httpx.post(f"{base}/v1/embeddings", content=b" " * (limit + 1), headers={"content-type": "application/json"})
    assert over.status_code == 413 and f"limit of {limit} bytes" in over.json()["error"]["message"]


# --- Infinity's client ------------------------------------------------------------------------------------------

def _infinity(base: str):  # noqa: ANN202
    from infinity_client import Client

    return Client(base_url=base, raise_on_unexpected_status=True, timeout=60)


@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_infinity_client_embeddings(url: str, st_model, prefix: str) -> None:  # noqa: ANN001
    from infinity_client.api.default import embeddings
    from infinity_client.models import OpenAIEmbeddingInputText, OpenAIEmbeddingResult

    with _infinity(url + prefix) as client:
        result = embeddings.sync(client=client, body=OpenAIEmbeddingInputText(input_=TEXTS))  # model unset
        named = embeddings.sync(client=client, body=OpenAIEmbeddingInputText(input_=TEXTS[0], model=MODEL))
    assert isinstance(result, OpenAIEmbeddingResult) and result.model == MODEL
    assert _close([d.embedding for d in result.data], st_model.encode(TEXTS))
    assert [d.index for d in result.data] == [0, 1, 2, 3]
    assert result.usage.prompt_tokens == result.usage.total_tokens > 0
    assert _close(named.data[0].embedding, st_model.encode(TEXTS[0]))
    image = httpx.post(f"{url}{prefix}/embeddings", json={"input": ["http://x/cat.jpg"], "modality": "image"})
    assert image.status_code == 424 and image.json()["error"]["param"] == "modality"


def test_infinity_client_models_and_health(url: str) -> None:
    from infinity_client.api.default import health, models

    with _infinity(url) as client:
        info = models.sync(client=client)
        alive = health.sync(client=client)
    card = info.data[0]
    assert card.id == MODEL and card.owned_by.value == "infinity" and card.capabilities == ["embed"]
    assert {"queue_fraction", "queue_absolute", "results_pending", "batch_size"} <= set(card.stats.additional_keys)
    assert card.stats["batch_size"] > 0 and isinstance(card.stats["queue_fraction"], float)
    assert alive["unix"] > 0


@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_infinity_client_rerank(reranker: tuple[str, Engine], prefix: str) -> None:
    from infinity_client.api.default import rerank
    from infinity_client.models import RerankInput, ReRankResult

    base, offline = reranker
    expected = offline.rerank(QUERY, DOCS)
    logits = offline.score([(QUERY, d) for d in DOCS], activation=False)
    with _infinity(base + prefix) as client:
        plain = rerank.sync(client=client, body=RerankInput(query=QUERY, documents=DOCS))
        full = rerank.sync(client=client, body=RerankInput(query=QUERY, documents=DOCS, return_documents=True,
                                                           raw_scores=True, top_n=2, model="rr"))
    assert isinstance(plain, ReRankResult) and plain.object_.value == "rerank" and plain.model == "rr"
    assert_ranked([(r.index, r.relevance_score) for r in plain.results], dict(expected))
    assert all("document" not in r.to_dict() for r in plain.results)  # return_documents: false, Infinity's default
    assert plain.usage.prompt_tokens == plain.usage.total_tokens > 0
    assert_ranked([(r.index, r.relevance_score) for r in full.results], logits.tolist(), top_n=2)
    assert [r.document for r in full.results] == [DOCS[r.index] for r in full.results]  # Infinity's plain strings
    # Cohere / Jina / vLLM bodies keep their {"text": ...} documents, in the same (superset) envelope
    cohere = httpx.post(f"{base}{prefix}/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 1}).json()
    best = cohere["results"][0]
    assert_ranked([(best["index"], best["relevance_score"])], dict(expected), top_n=1)
    assert best["document"] == {"text": DOCS[best["index"]]}
    assert set(cohere) == {"id", "object", "created", "model", "results", "usage"}
    assert set(cohere["usage"]) == {"prompt_tokens", "total_tokens"}


@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_infinity_client_classify(classifier: tuple[str, Engine], prefix: str) -> None:
    from infinity_client.api.default import classify
    from infinity_client.models import ClassifyInput, ClassifyResult

    base, offline = classifier
    texts = ["the water is hot", "paris and berlin"]
    with _infinity(base + prefix) as client:
        probs = classify.sync(client=client, body=ClassifyInput(input_=texts))
        logits = classify.sync(client=client, body=ClassifyInput(input_=texts, raw_scores=True))
    assert isinstance(probs, ClassifyResult) and probs.object_.value == "classify"
    assert probs.usage.prompt_tokens == probs.usage.total_tokens > 0
    for got, want in ((probs, offline.classify(texts)), (logits, offline.classify(texts, activation=False))):
        for row, expected in zip(got.data, want):
            assert_ranked([(c.label, c.score) for c in row], dict(expected))
    vllm = httpx.post(f"{base}{prefix}/classify", json={"input": texts}).json()  # vLLM's body keeps vLLM's answer
    assert set(vllm["data"][0]) == {"index", "label", "probs", "num_classes"}


# --- --no-token-id-inputs ---------------------------------------------------------------------------------------

def test_no_token_id_inputs_in_process(embedder: tuple[str, object]) -> None:
    base, app = embedder
    ids = [101, 7592, 2088, 102]
    assert httpx.post(f"{base}/v1/embeddings", json={"input": ids}).status_code == 200  # accepted by default
    config = app.state.service.config  # type: ignore[attr-defined]
    config.token_id_inputs = False  # what `wde serve --no-token-id-inputs` sets
    try:
        for path, body, name in [("/v1/embeddings", {"input": ids}, "input"),
                                 ("/v1/embeddings", {"input": [ids, ids]}, "input[0]"),
                                 ("/embeddings", {"input": [ids]}, "input[0]"),
                                 ("/pooling", {"input": [ids]}, "input[0]"),
                                 ("/embed", {"inputs": ids}, "inputs"),
                                 ("/embed_all", {"inputs": ["x", ids]}, "inputs[1]"),
                                 ("/", {"inputs": [ids]}, "inputs[0]")]:
            r = httpx.post(base + path, json=body)
            assert r.status_code == 422, (path, r.text)
            message = r.json()["error"] if isinstance(r.json()["error"], str) else r.json()["error"]["message"]
            assert message.startswith(f"{name} is a list of token ids") and "--no-token-id-inputs" in message
            assert "check_embedding_ctx_length=False" in message
        assert httpx.post(f"{base}/v1/embeddings", json={"input": ["text"]}).status_code == 200
    finally:
        config.token_id_inputs = True


def test_no_token_id_inputs_split_server(tiny_bert: Path) -> None:
    """The setting reaches the API-server processes; /embed_all works there too (token states over the wire)."""
    with serve_split(tiny_bert, 1, "--set", MEAN, "--no-token-id-inputs") as (base, _), \
            Engine.from_workflow("bert", tiny_bert, overrides=[MEAN]) as offline:
        refused = httpx.post(f"{base}/v1/embeddings", json={"input": [[5, 6, 7]]})
        assert refused.status_code == 422 and refused.json()["error"]["param"] == "input[0]"
        assert "token ids" in refused.json()["error"]["message"]
        assert httpx.post(f"{base}/v1/embeddings", json={"input": ["the water is hot"]}).status_code == 200
        states = httpx.post(f"{base}/embed_all", json={"inputs": ["the water is hot", "paris"]})
        want = offline.encode(["the water is hot", "paris"], PoolingParams(outputs=("token_embeddings",)))
        assert states.status_code == 200 and all(_close(g, w.outputs["token_embeddings"], 1e-5)
                                                 for g, w in zip(states.json(), want))
