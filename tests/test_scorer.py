"""The `scorer` component kind (wde/components/scorer.py): its contract (built after the pooler, what each side runs
with, pairs or embeddings, `score`), each built-in scorer (cross_encoder, cosine, maxsim, none, auto), a scorer that
does not fit its pooler refused at build by name, and every scoring entry point scoring with it: `Engine.score` /
`Engine.rerank`, /rerank (Cohere/Jina, TEI and Infinity shapes), /v1/rerank, /v2/rerank, /v1/score and TEI
/similarity, on an embedder (cosine <= 1e-5 of sentence-transformers') and on a multi-vector folder (MaxSim <= 1e-4
relative of `MultiVectorEncoder.similarity`), in one process and through a split engine's API server; a model that
scores nothing answered 424 by name."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from tests import tiny_heads
from tests.test_multi_vector import backbone, build, colbert_minilm, st_model  # noqa: F401 - fixtures
from tests.test_server import serve, serve_split
from wde import Engine, PoolingParams
from wde.components.base import COMPONENT_KINDS
from wde.components.scorer import CosineScorer, CrossEncoderScorer, MaxSimScorer, NoScorer, Scorer, scoring_plan
from wde.errors import ModelLoadError, RequestError, WorkflowError
from wde.workflow import load_workflow

QUERY = "where is the eiffel tower?"
DOCS = ["The Eiffel Tower is in Paris, France.", "Bananas are yellow.", "Paris is the capital of France.",
        "The tower was finished in 1889."]


@pytest.fixture(scope="module")
def colbert(colbert_minilm: Path):  # noqa: F811 - the fixture imported above
    with Engine.from_workflow(None, colbert_minilm) as engine:
        yield engine


@pytest.fixture(scope="module")
def minilm_ce(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_heads.build_minilm_classifier(minilm_path, tmp_path_factory.mktemp("scorer-ce"), num_labels=1)


@pytest.fixture(scope="module")
def minilm_cls3(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_heads.build_minilm_classifier(minilm_path, tmp_path_factory.mktemp("scorer-cls3"), num_labels=3,
                                              id2label={0: "a", 1: "b", 2: "c"}, label2id={"a": 0, "b": 1, "c": 2})


def st_cosine(minilm_path: Path, queries: list[str], docs: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm_path), device="cpu")
    return st.similarity(st.encode(queries), st.encode(docs)).numpy()


def st_maxsim(folder: Path, queries: list[str], docs: list[str]) -> np.ndarray:
    st = st_model(folder)
    return st.similarity(st.encode_query(queries), st.encode_document(docs)).numpy()


# --- the contract --------------------------------------------------------------------------------------------------

def test_scorer_is_built_after_the_pooler_and_exported() -> None:
    import wde.api

    assert COMPONENT_KINDS.index("scorer") == COMPONENT_KINDS.index("pooler") + 1
    assert wde.api.Scorer is Scorer and wde.api.scoring_plan is scoring_plan


def test_every_bundled_workflow_names_a_scorer() -> None:
    expected = {"bert": "auto", "multi_vector": "maxsim", "cross_encoder": "cross_encoder", "splade": "auto",
                "sequence_classification": "auto", "bge_reranker_v2_m3": "cross_encoder", "clip": "cosine",
                "qwen3_reranker": "cross_encoder", "qwen3_embedding": "auto", "decoder_features": "auto",
                "bge_m3": "cosine"}
    for name, scorer in expected.items():
        assert load_workflow(name).components["scorer"].name == scorer, name


def test_auto_follows_the_pooling(minilm_engine: Engine, minilm_path: Path) -> None:
    """`bert`'s auto: cosine for the dense vectors, none where `pooling: all` gives token states only."""
    assert minilm_engine.scorer.scoring == "cosine"
    with Engine.from_workflow("bert", minilm_path, overrides=["pooler.params.pooling=all"]) as engine:
        assert engine.scorer.scoring == "none"
        with pytest.raises(RequestError, match="scorer is 'none'"):
            engine.rerank("q", ["a"])


def test_side_params(minilm_engine: Engine, colbert: Engine, minilm_ce: Path) -> None:
    """What each side runs with: the scorer's output, cosine's normalization, maxsim's task; the caller's
    truncation kept; a cross-encoder's activation kept and an embedding scorer's refused."""
    base = PoolingParams(truncate=True, activation=False)
    cosine = minilm_engine.scorer  # bert's auto, standing for cosine
    assert isinstance(cosine.picked, CosineScorer) and not cosine.pairs
    assert cosine.side_params("query", base) == PoolingParams(truncate=True, normalize=True, outputs=("dense",))
    assert cosine.side_params("document", base) == cosine.side_params("query", base)
    maxsim = colbert.scorer
    assert isinstance(maxsim, MaxSimScorer) and maxsim.similarity == "maxsim"
    assert maxsim.side_params("query", base) == PoolingParams(truncate=True, outputs=("colbert",),
                                                              options={"task": "query"})
    assert maxsim.side_params("document", base).options == {"task": "document"}
    with pytest.raises(RequestError, match="activation"):
        cosine.side_params("query", PoolingParams(activation=True))
    with pytest.raises(RequestError, match="no 'pair'"):
        cosine.side_params("pair", base)
    with Engine.from_workflow(None, minilm_ce) as engine:
        ce = engine.scorer
        assert engine.scorer.scoring == "cross_encoder" and ce.pairs
        assert ce.side_params("pair", base) == PoolingParams(truncate=True, activation=False, outputs=("score",))


def test_scoring_plan_runs_each_text_once() -> None:
    """An embedding scorer runs each distinct query and document once (a text on both sides once where the sides
    run alike); a pair scorer runs each pair; a single text is not a pair."""

    class Fake(CosineScorer):
        def __init__(self) -> None:  # the plan needs no component: plain settings only
            pass

    plan = scoring_plan(Fake(), [("q", "a"), ("q", "b"), ("a", "q")], PoolingParams())
    assert plan.inputs == ["q", "a", "b"] and plan.origins == [(0, 0), (0, 1), (1, 1)]
    outputs = [{"dense": np.array(v, dtype=np.float32)} for v in ([1, 0], [0.6, 0.8], [0, 1])]
    assert plan.scores(outputs).tolist() == pytest.approx([0.6, 0.0, 0.6])
    with pytest.raises(RequestError, match=r"pairs\[0\]"):
        scoring_plan(Fake(), ["just one text"], PoolingParams())  # type: ignore[list-item]


def test_engine_info_carries_the_scorer_to_api_servers(colbert: Engine) -> None:
    """The scorer's state is plain settings: it pickles (a split engine's core sends EngineInfo) and scores."""
    info = pickle.loads(pickle.dumps(colbert.info))
    assert info.scorer.scoring == "maxsim" and info.scorer.similarity == "maxsim"
    q, d = np.ones((2, 4), np.float32) / 2, np.eye(4, dtype=np.float32)[:3]
    assert info.scorer.score({"colbert": q}, [{"colbert": d}]).tolist() == pytest.approx([1.0])


# --- fitting the pooler --------------------------------------------------------------------------------------------

def test_a_scorer_that_does_not_fit_its_pooler_fails_the_build(minilm_path: Path,
                                                              colbert_minilm: Path) -> None:  # noqa: F811
    with pytest.raises(ModelLoadError, match=r"scorer 'maxsim' scores output 'colbert', which pooler 'sentence'"):
        Engine.from_workflow("bert", minilm_path, overrides=["scorer.name=maxsim"])
    with pytest.raises(ModelLoadError, match=r"building scorer 'cosine' failed: .*'dense'.*pooler 'multi_vector'"):
        Engine.from_workflow("multi_vector", colbert_minilm, overrides=["scorer.name=cosine"])
    with pytest.raises(ModelLoadError, match="scorer 'cross_encoder' scores output 'score'"):
        Engine.from_workflow("bert", minilm_path, overrides=["scorer.name=cross_encoder"])


def test_wde_validate_names_an_unknown_scorer_and_defaults_a_missing_one(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: t\nextends: bert\nscorer:\n  name: cosin\n", encoding="utf-8")
    with pytest.raises(WorkflowError, match="unknown scorer component 'cosin'.*cosine"):
        load_workflow(bad)
    from wde.workflow import find_workflow_file

    text = re.sub(r"scorer:\n  name: auto[^\n]*\n", "", find_workflow_file("bert").read_text(encoding="utf-8"))
    assert "scorer" not in text
    (tmp_path / "none.yaml").write_text(text, encoding="utf-8")  # a workflow from before the scorer kind
    assert load_workflow(tmp_path / "none.yaml").components["scorer"].name == "auto"
    (tmp_path / "empty.yaml").write_text(text + "scorer: {}\n", encoding="utf-8")
    with pytest.raises(WorkflowError, match="sets no scorer component"):  # named, but without a name
        load_workflow(tmp_path / "empty.yaml")
    params = tmp_path / "params.yaml"
    params.write_text("name: t\nextends: multi_vector\nscorer:\n  params:\n    similarity: sum\n", encoding="utf-8")
    with pytest.raises(WorkflowError, match="scorer.params.similarity"):
        load_workflow(params)


def test_maxsim_similarity_from_the_pooler_or_the_params(backbone: Path, tmp_path: Path) -> None:  # noqa: F811
    folder = build(backbone, tmp_path / "mean", similarity="meanmaxsim")
    with Engine.from_workflow(None, folder) as engine:
        assert engine.scorer.similarity == "meanmaxsim"
        queries, docs = ["what is the capital of france?", "hi"], ["Paris is the capital of France.", "a b c"]
        got = np.stack([engine.score([(q, d) for d in docs]) for q in queries])
        np.testing.assert_allclose(got, st_maxsim(folder, queries, docs), rtol=1e-4, atol=0)
    with Engine.from_workflow(None, folder, overrides=["scorer.params.similarity=maxsim"]) as engine:
        assert engine.scorer.similarity == "maxsim"


def test_auto_picks_by_the_pooler_outputs(minilm_ce: Path, minilm_cls3: Path) -> None:
    """sequence_classification's `auto`: a one-label model is a cross-encoder; a classifier scores nothing."""
    with Engine.from_workflow(None, minilm_ce) as engine:
        assert engine.workflow.name == "sequence_classification" and engine.scorer.scoring == "cross_encoder"
        assert isinstance(engine.scorer.picked, CrossEncoderScorer)
        from sentence_transformers import CrossEncoder

        want = CrossEncoder(str(minilm_ce), device="cpu").predict([(QUERY, d) for d in DOCS])
        np.testing.assert_allclose(engine.score([(QUERY, d) for d in DOCS]), want, atol=1e-4)
    with Engine.from_workflow(None, minilm_cls3) as engine:
        assert isinstance(engine.scorer.picked, NoScorer) and engine.info.scorer.output is None
        with pytest.raises(RequestError, match="scorer is 'none'"):
            engine.score([("a", "b")])


# --- the engine ----------------------------------------------------------------------------------------------------

def test_engine_scores_an_embedder_with_cosine(minilm_engine: Engine, minilm_path: Path) -> None:
    want = st_cosine(minilm_path, [QUERY], DOCS)[0]
    got = minilm_engine.score([(QUERY, d) for d in DOCS])
    np.testing.assert_allclose(got, want, atol=1e-5)
    ranked = minilm_engine.rerank(QUERY, DOCS, top_n=2)
    assert [i for i, _ in ranked] == list(np.argsort(-want, kind="stable")[:2])


def test_engine_scores_a_multi_vector_model_with_maxsim(colbert: Engine, colbert_minilm: Path) -> None:  # noqa: F811
    queries = [QUERY, "bananas"]
    want = st_maxsim(colbert_minilm, queries, DOCS)
    got = np.stack([colbert.score([(q, d) for d in DOCS]) for q in queries])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=0)
    assert [i for i, _ in colbert.rerank(QUERY, DOCS)] == list(np.argsort(-want[0], kind="stable"))


# --- the routes ----------------------------------------------------------------------------------------------------

def route_scores(url: str) -> dict[str, list[float]]:
    """The query's score for each document, as each scoring route answers it (in document order)."""
    def by_index(results: list[dict], key: str) -> list[float]:
        return [r[key] for r in sorted(results, key=lambda r: r["index"])]

    docs = {"query": QUERY, "documents": DOCS}
    out = {
        "/rerank": by_index(httpx.post(f"{url}/rerank", json=docs).json()["results"], "relevance_score"),
        "/v1/rerank": by_index(httpx.post(f"{url}/v1/rerank", json=docs).json()["results"], "relevance_score"),
        "/v2/rerank": by_index(httpx.post(f"{url}/v2/rerank", json=docs).json()["results"], "relevance_score"),
        "tei /rerank": by_index(httpx.post(f"{url}/rerank", json={"query": QUERY, "texts": DOCS}).json(), "score"),
        "/v1/score": by_index(httpx.post(f"{url}/v1/score", json={"text_1": QUERY, "text_2": DOCS}).json()["data"],
                              "score"),
        "/similarity": httpx.post(f"{url}/similarity",
                                  json={"inputs": {"source_sentence": QUERY, "sentences": DOCS}}).json(),
    }
    infinity = httpx.post(f"{url}/rerank", json={**docs, "model": "m", "return_documents": True, "raw_scores": False})
    out["infinity /rerank"] = by_index(infinity.json()["results"], "relevance_score")
    assert infinity.json()["results"][0]["document"] in DOCS  # Infinity's plain string
    return out


def assert_routes_score(url: str, want: np.ndarray, rtol: float, atol: float) -> None:
    for route, got in route_scores(url).items():
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=route)


def test_routes_score_an_embedder_with_cosine(minilm_engine: Engine, minilm_path: Path) -> None:
    with serve(minilm_engine, model="m") as (url, _):
        assert_routes_score(url, st_cosine(minilm_path, [QUERY], DOCS)[0], 0, 1e-5)


def test_routes_score_a_multi_vector_model_with_maxsim(colbert: Engine, colbert_minilm: Path) -> None:  # noqa: F811
    with serve(colbert, model="m") as (url, _):
        assert_routes_score(url, st_maxsim(colbert_minilm, [QUERY], DOCS)[0], 1e-4, 0)
        pairs = httpx.post(f"{url}/v1/score", json={"queries": [QUERY, "bananas"], "documents": DOCS[:2]}).json()
        want = [st_maxsim(colbert_minilm, [q], [d])[0, 0] for q, d in zip([QUERY, "bananas"], DOCS[:2])]
        np.testing.assert_allclose([d["score"] for d in pairs["data"]], want, rtol=1e-4)


def test_split_engine_scores_a_multi_vector_model_as_one_does(colbert_minilm: Path) -> None:  # noqa: F811
    """The scorer travels to the API server in EngineInfo: MaxSim is computed there."""
    with serve_split(colbert_minilm, 1, "--served-model-name", "m") as (url, _):
        assert_routes_score(url, st_maxsim(colbert_minilm, [QUERY], DOCS)[0], 1e-4, 0)


def test_cross_encoder_routes_unchanged_and_no_similarity(minilm_ce: Path) -> None:
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(str(minilm_ce), device="cpu")
    want, raw = ce.predict([(QUERY, d) for d in DOCS]), ce.predict([(QUERY, d) for d in DOCS],
                                                                          activation_fn=torch.nn.Identity())
    with Engine.from_workflow("cross_encoder", minilm_ce) as engine, serve(engine, model="m") as (url, _):
        got = httpx.post(f"{url}/rerank", json={"query": QUERY, "texts": DOCS, "raw_scores": True}).json()
        np.testing.assert_allclose([r["score"] for r in sorted(got, key=lambda r: r["index"])], raw, atol=1e-4)
        got = httpx.post(f"{url}/v1/score", json={"text_1": QUERY, "text_2": DOCS}).json()["data"]
        np.testing.assert_allclose([d["score"] for d in got], want, atol=1e-4)
        similarity = httpx.post(f"{url}/similarity", json={"inputs": {"source_sentence": QUERY, "sentences": DOCS}})
        assert similarity.status_code == 424 and "'cross_encoder'" in similarity.json()["error"]


def test_a_model_that_scores_nothing_is_424_by_name(minilm_cls3: Path) -> None:
    with Engine.from_workflow(None, minilm_cls3) as engine, serve(engine, model="m") as (url, _):
        for path, body in (("/rerank", {"query": "q", "documents": ["a"]}), ("/v2/rerank", {"query": "q",
                                                                                             "documents": ["a"]}),
                           ("/v1/score", {"text_1": "q", "text_2": ["a"]})):
            r = httpx.post(f"{url}{path}", json=body)
            assert r.status_code == 424 and "scorer is 'none'" in r.json()["error"]["message"], path
        tei = httpx.post(f"{url}/rerank", json={"query": "q", "texts": ["a"]})
        assert tei.status_code == 424 and "scorer is 'none'" in tei.json()["error"]


def test_an_embedder_refuses_activation(minilm_engine: Engine) -> None:
    """raw_scores is the scores themselves for an embedder (no activation); use_activation is not refused on
    /v1/score, as before; Engine.score(activation=True) is."""
    with serve(minilm_engine, model="m") as (url, _):
        raw = httpx.post(f"{url}/rerank", json={"query": QUERY, "texts": DOCS, "raw_scores": True})
        plain = httpx.post(f"{url}/rerank", json={"query": QUERY, "texts": DOCS})
        assert raw.json() == plain.json()
    with pytest.raises(RequestError, match="activation"):
        minilm_engine.score([("a", "b")], activation=True)
