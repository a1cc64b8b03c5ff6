"""Several models behind one `wde serve` (wde/server/model_config.py, `ServedModels` in wde/server/service.py):
an embedder and a reranker in one process and in split mode, each route answering for the model its request
names, a 404 naming the served ones, start-up refusals of mismatched options in one line, the YAML serve config,
per-model /metrics series, and Jina's `task` refused by name where the model takes no task option; three models
(embedder, reranker, classifier) each answering its routes and refusing the others by name; the token pool the
engines of one process share (wde/token_pool.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest

from tests import tiny_models
from tests.test_server import REPO, free_port, metric, serve, stop_server, wait_healthy
from wde import Engine
from wde.server import ServerConfig
from wde.server.model_config import ModelConfig, from_options, load_serve_config, name_table, with_overrides
from wde.server.startup import StartupError

TOL = 1e-4
TEXTS = ["A man is eating food.", "The new movie is awesome", "Berlin has 3.5 million people.", "hello"]
QUERY = "how many people live in berlin"
DOCS = ["Berlin has a population of 3.5 million.", "The cat sat on the mat.", "Paris is in France."]


@pytest.fixture(scope="module")
def reranker_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random BERT cross-encoder (one logit), as sentence-transformers' CrossEncoder loads it."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    out = tmp_path_factory.mktemp("tiny-reranker")
    torch.manual_seed(0)
    tok = tiny_models.bert_tokenizer()
    cfg = BertConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=512, num_labels=1)
    BertForSequenceClassification(cfg).eval().save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def expected(minilm_path: Path, reranker_path: Path) -> dict[str, np.ndarray]:
    """The reference library's answers: MiniLM's sentence-transformers vectors, the CrossEncoder's scores."""
    from sentence_transformers import CrossEncoder, SentenceTransformer

    vectors = SentenceTransformer(str(minilm_path), device="cpu").encode(TEXTS, convert_to_numpy=True)
    scores = CrossEncoder(str(reranker_path), device="cpu").predict([(QUERY, d) for d in DOCS])
    return {"vectors": np.asarray(vectors), "scores": np.asarray(scores)}


MODELS = (ModelConfig(served_model_name="embedder"), ModelConfig(served_model_name="reranker"))


@pytest.fixture(scope="module")
def two_app(minilm_path: Path, reranker_path: Path) -> Iterator[tuple[str, object]]:
    """MiniLM (`embedder`, the default) and the tiny reranker (`reranker`) in one process: (url, app)."""
    models = (ModelConfig(str(minilm_path), "bert", "embedder"), ModelConfig(str(reranker_path), None, "reranker"))
    with Engine.from_workflow("bert", minilm_path) as embedder, Engine.from_workflow(None, reranker_path) as ranker, \
            serve([embedder, ranker], models=models) as running:  # type: ignore[arg-type]
        yield running


@pytest.fixture(scope="module")
def two(two_app: tuple[str, object]) -> str:
    return two_app[0]


def _rerank_scores(answer: dict) -> np.ndarray:
    return np.array([r["relevance_score"] for r in sorted(answer["results"], key=lambda r: r["index"])])


def test_each_route_answers_for_the_model_its_request_names(two: str, expected: dict[str, np.ndarray]) -> None:
    url = two
    got = httpx.post(f"{url}/v1/embeddings", json={"model": "embedder", "input": TEXTS})
    assert got.status_code == 200 and got.json()["model"] == "embedder"
    vectors = np.array([d["embedding"] for d in got.json()["data"]])
    assert np.abs(vectors - expected["vectors"]).max() <= TOL
    default = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS}).json()  # no model: the first listed
    assert default["model"] == "embedder"

    ranked = httpx.post(f"{url}/v1/rerank", json={"model": "reranker", "query": QUERY, "documents": DOCS})
    assert ranked.status_code == 200 and ranked.json()["model"] == "reranker"
    assert np.abs(_rerank_scores(ranked.json()) - expected["scores"]).max() <= TOL
    v2 = httpx.post(f"{url}/v2/rerank", json={"model": "reranker", "query": QUERY, "documents": DOCS}).json()
    assert np.abs(_rerank_scores(v2) - expected["scores"]).max() <= TOL
    # the embedder scores too (cosine): the same body naming it is answered by it, not by the reranker
    cosine = httpx.post(f"{url}/v1/rerank", json={"model": "embedder", "query": QUERY, "documents": DOCS}).json()
    assert cosine["model"] == "embedder" and np.abs(_rerank_scores(cosine) - expected["scores"]).max() > 1e-3
    scored = httpx.post(f"{url}/score", json={"model": "reranker", "text_1": QUERY, "text_2": DOCS}).json()
    assert np.abs(np.array([d["score"] for d in scored["data"]]) - expected["scores"]).max() <= TOL

    # TEI's bodies name no model: ?model= picks one, else the default answers
    tei = httpx.post(f"{url}/rerank?model=reranker", json={"query": QUERY, "texts": DOCS}).json()
    assert np.abs(np.array([r["score"] for r in sorted(tei, key=lambda r: r["index"])])
                  - expected["scores"]).max() <= TOL
    embedded = np.array(httpx.post(f"{url}/embed", json={"inputs": TEXTS}).json())
    assert np.abs(embedded - expected["vectors"]).max() <= TOL
    refused = httpx.post(f"{url}/embed?model=reranker", json={"inputs": TEXTS})
    assert refused.status_code == 424  # the reranker makes no vectors: its own refusal, not the embedder's answer

    # vLLM's /tokenize by the model the body names (the two tokenizers differ)
    minilm = httpx.post(f"{url}/tokenize", json={"model": "embedder", "prompt": "hello world"}).json()
    tiny = httpx.post(f"{url}/tokenize", json={"model": "reranker", "prompt": "hello world"}).json()
    assert minilm["max_model_len"] == 256 and tiny["max_model_len"] != 256


def test_a_model_not_served_is_a_404_naming_the_served_ones(two: str) -> None:
    for path, body in (("/v1/embeddings", {"model": "nope", "input": "x"}),
                       ("/v1/rerank", {"model": "nope", "query": QUERY, "documents": DOCS}),
                       ("/v2/embed", {"model": "nope", "texts": ["x"], "input_type": "search_query",
                                      "embedding_types": ["float"]}),
                       ("/score", {"model": "nope", "text_1": "a", "text_2": "b"}),
                       ("/embed?model=nope", {"inputs": "x"})):
        got = httpx.post(f"{two}{path}", json=body)
        assert got.status_code == 404, (path, got.text)
        assert "'nope'" in got.text and "'embedder'" in got.text and "'reranker'" in got.text, got.text
    assert httpx.get(f"{two}/v1/models/nope").status_code == 404
    conflict = httpx.post(f"{two}/v1/rerank?model=embedder", json={"model": "reranker", "query": QUERY,
                                                                    "documents": DOCS})
    assert conflict.status_code == 422 and "model" in conflict.text


def test_model_lists_name_every_served_model(two: str) -> None:
    listed = httpx.get(f"{two}/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["embedder", "reranker"]
    assert [m["outputs"][0] for m in listed] == ["dense", "score"]
    assert httpx.get(f"{two}/v1/models/reranker").json()["id"] == "reranker"
    infinity = httpx.get(f"{two}/models").json()["data"]
    assert [(m["id"], m["capabilities"]) for m in infinity] == [("embedder", ["embed"]), ("reranker", ["rerank"])]
    info = httpx.get(f"{two}/info").json()
    assert info["model_id"] == "embedder" and [m["model_id"] for m in info["models"]] == ["embedder", "reranker"]
    assert httpx.get(f"{two}/info?model=reranker").json()["model_id"] == "reranker"
    assert httpx.get(f"{two}/health").status_code == 200


def test_the_server_is_ready_only_while_every_model_is(two_app: tuple[str, object],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    url, app = two_app
    reranker = app.state.models.services[1]  # type: ignore[attr-defined]
    monkeypatch.setattr(reranker, "liveness", lambda: "the engine is not running: test")
    for path in ("/health", "/ping", "/.well-known/ready"):
        got = httpx.get(f"{url}{path}")
        assert got.status_code == 503 and "model 'reranker': the engine is not running" in got.text, (path, got.text)
    monkeypatch.undo()
    assert httpx.get(f"{url}/health").status_code == 200


def test_metrics_have_a_series_per_model(two: str) -> None:
    httpx.post(f"{two}/v1/embeddings", json={"model": "embedder", "input": TEXTS})
    httpx.post(f"{two}/v1/rerank", json={"model": "reranker", "query": QUERY, "documents": DOCS})
    for model in ("embedder", "reranker"):
        assert metric(two, "wde_inputs_total", model=model) > 0
        assert metric(two, "wde_prompt_tokens_total", model=model) > 0
        assert metric(two, "wde_engine_healthy", model=model) == 1
        assert metric(two, "wde_token_budget", model=model) > 0
    # MiniLM's weights (~90 MB in fp32) against the tiny reranker's (well under 10 MB)
    assert metric(two, "wde_model_weight_bytes", model="embedder") > 50e6
    assert 0 < metric(two, "wde_model_weight_bytes", model="reranker") < 10e6


def test_jina_task_is_refused_by_name_for_a_model_without_a_task_option(two: str) -> None:
    body = {"model": "embedder", "input": ["a query"], "task": "retrieval.query"}
    got = httpx.post(f"{two}/v1/embeddings", json=body)
    assert got.status_code == 422 and "task" in got.json()["error"]["message"], got.text
    assert "'retrieval.query'" in got.text
    late = httpx.post(f"{two}/v1/embeddings", json={**body, "input": ["one chunk", "two"], "late_chunking": True})
    assert late.status_code == 422 and "task" in late.text


def test_jina_encoding_fields_change_the_answer_as_they_ask(two: str, expected: dict[str, np.ndarray]) -> None:
    """Jina's embedding_type and normalized are honoured, not ignored (each changes the vectors)."""
    def post(**fields: object) -> httpx.Response:
        return httpx.post(f"{two}/v1/embeddings", json={"model": "embedder", "input": TEXTS, **fields})

    def data(response: httpx.Response) -> list:
        assert response.status_code == 200, response.text
        return [d["embedding"] for d in response.json()["data"]]

    assert data(post(embedding_type="binary")) == data(post(embed_dtype="binary"))
    assert data(post(embedding_type="ubinary")) == data(post(embed_dtype="ubinary"))
    assert data(post(embedding_type="base64")) == data(post(encoding_format="base64"))
    assert np.abs(np.array(data(post(embedding_type="float"))) - expected["vectors"]).max() <= TOL
    both = post(embedding_type="binary", embed_dtype="int8")
    assert both.status_code == 422 and "embedding_type" in both.text and "embed_dtype" in both.text
    raw = np.array(data(post(normalized=False)))
    assert np.abs(np.linalg.norm(raw, axis=1) - 1).min() > 1e-2  # MiniLM's mean-pooled vectors, not unit length
    assert np.abs(raw / np.linalg.norm(raw, axis=1, keepdims=True) - expected["vectors"]).max() <= TOL
    assert np.abs(np.array(data(post(normalized=True))) - expected["vectors"]).max() <= TOL
    chunked = httpx.post(f"{two}/v1/embeddings", json={"model": "embedder", "input": ["one chunk", "and two"],
                                                        "late_chunking": True, "normalized": False})
    assert chunked.status_code == 200
    assert abs(np.linalg.norm(chunked.json()["data"][0]["embedding"]) - 1) > 1e-2


def test_jina_task_maps_onto_a_multi_vector_models_task_option(minilm_path: Path,
                                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.test_multi_vector import classic_colbert
    from wde.server import create_app
    from wde.server.errors import ApiError

    folder = classic_colbert(minilm_path, tmp_path_factory.mktemp("colbert") / "st")
    with Engine.from_workflow(None, folder) as engine:
        svc = create_app(engine, ServerConfig(served_model_name="colbert")).state.service
        assert svc.jina_task("retrieval.query", None) == {"task": "query"}
        assert svc.jina_task("retrieval.passage", {"task": "document"}) == {"task": "document"}
        assert svc.jina_task("query", None) == {"task": "query"}  # the workflow's own value as it is
        with pytest.raises(ApiError, match="'separation' is not a task of model 'colbert'"):
            svc.jina_task("separation", None)
        with pytest.raises(ApiError, match="contradict"):
            svc.jina_task("retrieval.query", {"task": "document"})


# --- configuration: repeated options, scoped overrides, the YAML serve config ------------------------------------

def test_repeated_options_pair_up_in_order_and_mismatches_are_refused() -> None:
    models = from_options(["a/emb", "b/rr"], ["bert", "cross_encoder"], ["e", "r,rank"],
                          ["scheduler.params.max_num_requests=8", "r:pooler.name=x"])
    assert [(m.model, m.workflow, m.served_model_name) for m in models] == [("a/emb", "bert", "e"),
                                                                            ("b/rr", "cross_encoder", "r,rank")]
    assert models[0].overrides == ("scheduler.params.max_num_requests=8",)
    assert models[1].overrides == ("scheduler.params.max_num_requests=8", "pooler.name=x")
    assert name_table(models) == [("e", "a/emb", "emb"), ("r", "rank", "b/rr", "rr")]
    with pytest.raises(StartupError, match=r"^3 --model but 2 --workflow: give one --workflow per --model"):
        from_options(["a", "b", "c"], ["bert", "bert"], [], [])
    with pytest.raises(StartupError, match=r"^1 --model but 2 --served-model-name"):
        from_options(["a"], [], ["x", "y"], [])
    with pytest.raises(StartupError, match="no model is called 'nope'"):
        from_options(["a", "b"], [], [], ["nope:pooler.name=x"])
    with pytest.raises(StartupError, match="both called 'm'"):
        ServerConfig(models=(ModelConfig("x/m", served_model_name="m"), ModelConfig("y/m", served_model_name="m")))
    # a name one model was given wins over the alias another derived
    assert name_table((ModelConfig("x/m"), ModelConfig("y/m", served_model_name="m"))) == [("x/m",), ("m", "y/m")]
    # two folders of one name: each keeps its own hub id; the shared short alias is nobody's
    assert name_table((ModelConfig("org1/m"), ModelConfig("org2/m"))) == [("org1/m",), ("org2/m",)]
    with pytest.raises(ValueError, match="models lists every served model"):
        ServerConfig(model="x", models=MODELS)


def test_the_yaml_serve_config(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("models:\n"
                      "  - model: /models/emb\n"
                      "    served_model_name: [embedder, e5]\n"
                      "    set:\n"
                      "      scheduler.params.max_num_requests: 8\n"
                      "  - model: /models/rr\n"
                      "    workflow: cross_encoder\n"
                      "    set: ['pooler.params.activation=false']\n")
    models = with_overrides(load_serve_config(config), ["embedder:model.params.dtype=float32"])
    assert models == (ModelConfig("/models/emb", None, "embedder,e5", ("scheduler.params.max_num_requests=8",
                                                                        "model.params.dtype=float32")),
                      ModelConfig("/models/rr", "cross_encoder", None, ("pooler.params.activation=false",)))
    bad = {"models:\n  - model: x\n    worklfow: bert\n": f"{config}:3:5: models.0.worklfow: unknown key (did you"
                                                          " mean 'workflow'?)",
           "models: []\n": "models: must be a list of at least one model",
           "model: x\n": f"{config}:1:1: model: unknown key",
           "models:\n  - workflow: bert\n": "`model` is missing",
           "models:\n  - model: x\n    set: {a: [1]}\n": "models.0.set.a: must be a single value",
           "a: &a [*a]\n": "a cycle"}
    for text, message in bad.items():
        config.write_text(text)
        with pytest.raises(StartupError, match=re.escape(message)):
            load_serve_config(config)


def _wde(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wde.cli", "serve", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize("args, message", [
    (("--model", "a", "--model", "b", "--model", "c", "--workflow", "bert", "--workflow", "bert"),
     "3 --model but 2 --workflow"),
    (("--served-model-name", "a", "--served-model-name", "b"), "no --model (the default model) but 2"),
    (("--model", "x/m", "--model", "x/m"), "are both called 'x/m'"),
    (("--config", "serve.yaml", "--model", "x"), "--model cannot be given beside it"),
])
def test_wde_serve_refuses_mismatched_options_in_one_line(args: tuple[str, ...], message: str) -> None:
    done = _wde(*args, "--port", str(free_port()), "--api-servers", "0")
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], done.stderr


def test_wde_serve_with_repeated_models_and_a_scoped_override(minilm_path: Path, reranker_path: Path,
                                                               tmp_path: Path) -> None:
    """One process: `--set reranker:KEY=VALUE` reaches the reranker's engine only, `--set KEY=VALUE` both."""
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "wde.cli", "serve", "--model", str(minilm_path), "--model",
                                 str(reranker_path), "--workflow", "bert", "--workflow", "cross_encoder",
                                 "--served-model-name", "embedder", "--served-model-name", "reranker,rr",
                                 "--set", "reranker:scheduler.params.max_num_requests=7",
                                 "--set", "scheduler.params.max_num_batched_tokens=4096",
                                 "--port", str(port), "--api-servers", "0"],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, lambda: proc.poll() is None, timeout=300)
        except AssertionError:
            raise AssertionError(f"the server did not start:\n{log.read_text()[-3000:]}") from None
        embedder, reranker = httpx.get(f"{url}/info").json()["models"]
        assert (embedder["workflow"], reranker["workflow"]) == ("bert", "cross_encoder")
        assert reranker["max_batch_requests"] == 7 and embedder["max_batch_requests"] != 7
        assert embedder["max_batch_tokens"] == reranker["max_batch_tokens"] == 4096
        assert httpx.post(f"{url}/v1/rerank", json={"model": "rr", "query": QUERY, "documents": DOCS}
                          ).json()["model"] == "reranker"
    finally:
        stop_server(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]


# --- split mode: one core per model, every API server a client of each -------------------------------------------

def test_split_server_of_two_models_from_a_serve_config(minilm_path: Path, reranker_path: Path, tmp_path: Path,
                                                        expected: dict[str, np.ndarray]) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(f"models:\n  - model: {minilm_path}\n    served_model_name: embedder\n"
                      f"  - model: {reranker_path}\n    served_model_name: reranker\n")
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "wde.cli", "serve", "--config", str(config), "--port",
                                 str(port), "--api-servers", "2"], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, lambda: proc.poll() is None, timeout=300)
        except AssertionError:
            raise AssertionError(f"the split server did not start:\n{log.read_text()[-3000:]}") from None
        started = log.read_text()
        assert "API names: embedder" in started and "API names: reranker" in started and re.search(r"engine core pid \d+ \(embedder\), \d+ \(reranker\)", started), started
        for _ in range(4):  # over new connections: the kernel spreads them over both API servers
            with httpx.Client() as client:
                got = client.post(f"{url}/v1/embeddings", json={"model": "embedder", "input": TEXTS})
                ranked = client.post(f"{url}/v1/rerank", json={"model": "reranker", "query": QUERY,
                                                                "documents": DOCS})
            assert got.status_code == 200 and ranked.status_code == 200, (got.text, ranked.text)
            vectors = np.array([d["embedding"] for d in got.json()["data"]])
            assert np.abs(vectors - expected["vectors"]).max() <= TOL
            assert np.abs(_rerank_scores(ranked.json()) - expected["scores"]).max() <= TOL
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["embedder", "reranker"]
        assert httpx.post(f"{url}/v1/embeddings", json={"model": "nope", "input": "x"}).status_code == 404
        for model in ("embedder", "reranker"):
            assert metric(url, "wde_inputs_total", model=model) >= 4 * min(len(TEXTS), len(DOCS))
            assert metric(url, "wde_model_weight_bytes", model=model) > 0
            assert metric(url, "wde_engine_healthy", model=model) == 1
    finally:
        stop_server(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]


# --- three models in one server: an embedder, a reranker and a classifier ----------------------------------------

CLASS_LABELS = {0: "neg", 1: "neu", 2: "pos"}


@pytest.fixture(scope="module")
def classifier_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random XLM-R sequence classifier with three named labels (tests/tiny_heads.py)."""
    from tests import tiny_heads

    return tiny_heads.build_xlmr_classifier(tmp_path_factory.mktemp("tiny-classifier"), num_labels=3,
                                            id2label=CLASS_LABELS, label2id={v: k for k, v in CLASS_LABELS.items()})


@pytest.fixture(scope="module")
def class_probs(classifier_path: Path) -> np.ndarray:
    """transformers' softmax over the classifier's logits for TEXTS: the reference for every classify route."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(classifier_path)
    model = AutoModelForSequenceClassification.from_pretrained(classifier_path).eval()
    with torch.inference_mode():
        logits = model(**tok(TEXTS, padding=True, return_tensors="pt")).logits
    return torch.softmax(logits, -1).numpy()


@pytest.fixture(scope="module")
def three(minilm_path: Path, reranker_path: Path, classifier_path: Path) -> Iterator[str]:
    """MiniLM (`embedder`), the tiny reranker (`reranker`) and the tiny classifier (`classifier`) in one process."""
    models = (ModelConfig(str(minilm_path), "bert", "embedder"), ModelConfig(str(reranker_path), None, "reranker"),
              ModelConfig(str(classifier_path), None, "classifier"))
    with Engine.from_workflow("bert", minilm_path) as embedder, Engine.from_workflow(None, reranker_path) as ranker, \
            Engine.from_workflow(None, classifier_path) as classifier, \
            serve([embedder, ranker, classifier], models=models) as (url, _):  # type: ignore[arg-type]
        yield url


def test_three_models_each_route_answers_for_its_model(three: str, expected: dict[str, np.ndarray],
                                                       class_probs: np.ndarray) -> None:
    url = three
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["embedder", "reranker", "classifier"]
    assert [m["model_id"] for m in httpx.get(f"{url}/info").json()["models"]] == ["embedder", "reranker",
                                                                                   "classifier"]

    def ok(response: httpx.Response) -> object:
        assert response.status_code == 200, response.text
        return response.json()

    # embeddings: OpenAI's route by the body's model, TEI's by ?model=
    answer = ok(httpx.post(f"{url}/v1/embeddings", json={"model": "embedder", "input": TEXTS}))
    assert answer["model"] == "embedder"  # type: ignore[index]
    vectors = np.array([d["embedding"] for d in answer["data"]])  # type: ignore[index]
    assert np.abs(vectors - expected["vectors"]).max() <= TOL
    tei = np.array(ok(httpx.post(f"{url}/embed?model=embedder", json={"inputs": TEXTS})))
    assert np.abs(tei - expected["vectors"]).max() <= TOL

    # reranking and scoring: Cohere/Jina's /v1/rerank, TEI's /rerank, vLLM's /v1/score
    ranked = ok(httpx.post(f"{url}/v1/rerank", json={"model": "reranker", "query": QUERY, "documents": DOCS}))
    assert ranked["model"] == "reranker"  # type: ignore[index]
    assert np.abs(_rerank_scores(ranked) - expected["scores"]).max() <= TOL  # type: ignore[arg-type]
    tei_ranked = ok(httpx.post(f"{url}/rerank?model=reranker", json={"query": QUERY, "texts": DOCS}))
    tei_scores = np.array([r["score"] for r in sorted(tei_ranked, key=lambda r: r["index"])])  # type: ignore
    assert np.abs(tei_scores - expected["scores"]).max() <= TOL
    scored = ok(httpx.post(f"{url}/v1/score", json={"model": "reranker", "text_1": QUERY, "text_2": DOCS}))
    assert scored["model"] == "reranker"  # type: ignore[index]
    assert np.abs(np.array([d["score"] for d in scored["data"]]) - expected["scores"]).max() <= TOL  # type: ignore

    # classifying: vLLM's /classify, Infinity's /classify (raw_scores), TEI's /predict
    classified = ok(httpx.post(f"{url}/classify", json={"model": "classifier", "input": TEXTS}))
    assert classified["model"] == "classifier"  # type: ignore[index]
    probs = np.array([d["probs"] for d in classified["data"]])  # type: ignore[index]
    assert np.abs(probs - class_probs).max() <= TOL
    best = [CLASS_LABELS[int(i)] for i in class_probs.argmax(1)]
    assert [d["label"] for d in classified["data"]] == best  # type: ignore[index]
    infinity = ok(httpx.post(f"{url}/v1/classify", json={"model": "classifier", "input": TEXTS, "raw_scores": False}))
    for row, labelled in zip(class_probs, infinity["data"]):  # type: ignore[index]
        assert max(abs(row[[*CLASS_LABELS.values()].index(p["label"])] - p["score"]) for p in labelled) <= TOL
    predicted = ok(httpx.post(f"{url}/predict?model=classifier", json={"inputs": [[t] for t in TEXTS]}))
    for row, labelled in zip(class_probs, predicted):  # type: ignore[arg-type]
        assert labelled[0]["label"] == CLASS_LABELS[int(row.argmax())]
        assert max(abs(row[[*CLASS_LABELS.values()].index(p["label"])] - p["score"]) for p in labelled) <= TOL


@pytest.mark.parametrize("path, body, model", [
    ("/v1/embeddings", {"model": "classifier", "input": TEXTS}, "classifier"),
    ("/v1/embeddings", {"model": "reranker", "input": TEXTS}, "reranker"),
    ("/embed?model=classifier", {"inputs": TEXTS}, "classifier"),
    ("/v1/rerank", {"model": "classifier", "query": QUERY, "documents": DOCS}, "classifier"),
    ("/rerank?model=classifier", {"query": QUERY, "texts": DOCS}, "classifier"),
    ("/v1/score", {"model": "classifier", "text_1": QUERY, "text_2": DOCS}, "classifier"),
    ("/classify", {"model": "embedder", "input": TEXTS}, "embedder"),
    ("/classify", {"model": "reranker", "input": TEXTS}, "reranker"),
    ("/predict?model=embedder", {"inputs": TEXTS}, "embedder"),
])
def test_three_models_a_route_a_model_cannot_serve_is_its_own_424(three: str, path: str, body: dict,
                                                                   model: str) -> None:
    """The refusal a one-model server gives (424, what the route needs and what the model produces), naming the
    model the request named — never another model's answer."""
    got = httpx.post(f"{three}{path}", json=body)
    assert got.status_code == 424, (path, got.text)
    assert f"but model '{model}' (workflow " in got.text, got.text


# --- the token pool the engines of one process share (wde/token_pool.py) -----------------------------------------

def test_token_pool_takes_waits_and_never_waits_on_itself() -> None:
    import threading

    from wde.token_pool import TokenPool

    pool = TokenPool(100)
    assert pool.take("a", 60, wait=False) == 60 and pool.held("a") == 60 and pool.in_use == 60
    assert pool.take("b", 50, wait=False) is None  # short: a try fails at once
    assert pool.take("b", 40, wait=False) == 40 and pool.in_use == 100
    got: list[int | None] = []
    waiter = threading.Thread(target=lambda: got.append(pool.take("b", 500, wait=True)))  # more than the pool
    waiter.start()
    while not pool._waiting and waiter.is_alive():  # noqa: SLF001 - until the waiter is queued
        waiter.join(0.01)
    assert not got and pool.take("a", 1, wait=False) is None  # a waiter goes first: tries fail meanwhile
    pool.give("a", 60)
    assert not got  # 40 are still held by b's first batch
    pool.give("b", 40)
    waiter.join(30)
    assert got == [100] and pool.held("b") == 100  # a batch larger than the pool takes the whole pool
    pool.give("b", 100)
    assert pool.in_use == 0 and pool.held("a") == pool.held("b") == 0
    with pytest.raises(ValueError, match="at least 1 token"):
        TokenPool(0)


def test_two_engines_forwards_never_hold_more_than_the_shared_pool(minilm_path: Path, reranker_path: Path,
                                                                   expected: dict[str, np.ndarray],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Two engines driven from two threads at once, every forward instrumented: the tokens inside forwards, both
    engines together, never exceed the pool (sized by --shared-token-budget to one engine's budget)."""
    import threading
    import time
    from collections import Counter

    from tests.tiny_models import varied_texts
    from wde.server.app import share_tokens
    from wde.server.metrics import ServerMetrics

    budget = ["scheduler.params.max_num_batched_tokens=256"]
    texts = [" ".join(t.split()[:30]) for t in varied_texts(48, seed=5)]
    lock = threading.Lock()
    inside = {"now": 0, "peak": 0, "forwards": Counter()}

    def instrument(engine: Engine, name: str) -> None:
        runner = engine.executor._runner  # noqa: SLF001 - the forward itself
        run = runner.run

        def counted(batch):  # type: ignore[no-untyped-def]
            tokens = sum(batch.seq_lens)
            with lock:
                inside["now"] += tokens
                inside["peak"] = max(inside["peak"], inside["now"])
                inside["forwards"][name] += 1
            try:
                time.sleep(0.005)  # widen each forward so the two engines' overlap if the pool let them
                return run(batch)
            finally:
                with lock:
                    inside["now"] -= tokens

        monkeypatch.setattr(runner, "run", counted)

    with Engine.from_workflow("bert", minilm_path, overrides=budget) as embedder, \
            Engine.from_workflow(None, reranker_path, overrides=budget) as ranker:
        pool = share_tokens([embedder, ranker], ["embedder", "reranker"],
                            ServerConfig(models=(ModelConfig(str(minilm_path), "bert", "embedder"),
                                                        ModelConfig(str(reranker_path), None, "reranker")),
                                                shared_token_budget=256), ServerMetrics())
        assert pool is not None and pool.size == 256 and embedder.token_pool is pool is ranker.token_pool
        instrument(embedder, "embedder")
        instrument(ranker, "reranker")
        errors: list[BaseException] = []

        def drive(work) -> None:  # type: ignore[no-untyped-def]
            try:
                for _ in range(3):
                    work()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=drive, args=(lambda: embedder.embed(texts, truncate=True),)),
                   threading.Thread(target=drive, args=(lambda: ranker.score([(QUERY, t) for t in texts]),))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        assert inside["forwards"]["embedder"] > 1 and inside["forwards"]["reranker"] > 1, inside
        assert 0 < inside["peak"] <= 256, inside
        assert pool.in_use == 0  # every forward gave its tokens back
        vectors = embedder.embed(TEXTS)
    # the pool changes when batches run, not what they give
    assert np.abs(np.asarray(vectors) - expected["vectors"]).max() <= TOL


def test_the_shared_pool_is_in_metrics_per_model(three: str) -> None:
    httpx.post(f"{three}/v1/embeddings", json={"model": "embedder", "input": TEXTS})
    assert metric(three, "wde_shared_token_pool_size") == max(
        m["max_batch_tokens"] for m in httpx.get(f"{three}/info").json()["models"])
    for model in ("embedder", "reranker", "classifier"):
        assert f'wde_shared_token_pool_tokens{{model="{model}"}} 0.0' in httpx.get(f"{three}/metrics").text


@pytest.mark.parametrize("args, message", [
    (("--shared-token-budget", "0", "--api-servers", "0"), "--shared-token-budget must be an integer, at least 1"),
    (("--shared-token-budget", "512", "--api-servers", "2"), "--shared-token-budget shares tokens between the"
                                                              " engines of one process, but --api-servers 2"),
])
def test_wde_serve_refuses_a_shared_token_budget_it_cannot_honour(args: tuple[str, ...], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "wde.cli", "serve", *args, "--port", str(free_port())],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], done.stderr
