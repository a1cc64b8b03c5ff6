"""The `dot`, `euclidean` and `manhattan` scorers (wde/components/scorer.py) and `scorer: auto` reading the folder's
`similarity_fn_name`: a dense sentence-transformers folder saved with "dot" (no Normalize module, so dot and cosine
differ), "euclidean" and "manhattan", and a SPLADE SparseEncoder folder (sparse dot product, its default) score on
`Engine.score` and on every scoring route (/rerank in its shapes, /v1/rerank, /v2/rerank, TEI /rerank, /v1/score,
/similarity; SPLADE also through a split engine's API server) what sentence-transformers' `similarity` gives (<= 1e-4
relative); a similarity WDE does not score with is refused at build, by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_scorer import DOCS, QUERY, assert_routes_score
from tests.test_server import serve, serve_split
from tests.test_splade import build_mlm, build_sparse_encoder
from wde import Engine
from wde.components.scorer import CosineScorer, DotScorer, EuclideanScorer, ManhattanScorer
from wde.errors import ModelLoadError


def dense_folder(minilm_path: Path, out: Path, similarity: str | None) -> Path:
    """MiniLM's Transformer, mean Pooling and a random Dense 384 -> 32 (tanh), no Normalize: vectors whose norms
    differ, saved by sentence-transformers with `similarity_fn_name` (None: left out of the config)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    torch.manual_seed(3)
    transformer = SentenceTransformer(str(minilm_path), device="cpu")[0]
    model = SentenceTransformer(modules=[transformer, modules.Pooling(384, "mean"), modules.Dense(384, 32)],
                                device="cpu", similarity_fn_name=similarity)
    model.save(str(out))
    if similarity is None:
        config = json.loads((out / "config_sentence_transformers.json").read_text())
        config.pop("similarity_fn_name", None)
        (out / "config_sentence_transformers.json").write_text(json.dumps(config))
    return out


def st_scores(folder: Path, queries: list[str], docs: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu")
    return st.similarity(st.encode(queries), st.encode(docs)).numpy()


@pytest.fixture(scope="module")
def minilm_dot(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dense_folder(minilm_path, tmp_path_factory.mktemp("dot") / "st", "dot")


@pytest.fixture(scope="module")
def splade(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("splade-dot")
    return build_sparse_encoder(build_mlm(root / "mlm"), root / "st")


@pytest.mark.parametrize("similarity, picked", [("dot", DotScorer), ("euclidean", EuclideanScorer),
                                                ("manhattan", ManhattanScorer), (None, CosineScorer)])
def test_auto_scores_with_the_folders_similarity(similarity: str | None, picked: type, minilm_path: Path,
                                                 tmp_path: Path) -> None:
    folder = dense_folder(minilm_path, tmp_path / "st", similarity)
    want = st_scores(folder, [QUERY, "bananas"], DOCS)
    assert len({round(float(x), 4) for x in want[0]}) == len(DOCS)  # the scores tell the documents apart
    with Engine.from_workflow(None, folder) as engine:
        assert isinstance(engine.scorer.picked, picked)
        got = np.stack([engine.score([(q, d) for d in DOCS]) for q in (QUERY, "bananas")])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_dot_differs_from_cosine_here(minilm_dot: Path) -> None:
    """The folder's vectors are not unit length, so scoring them with cosine would be a different answer."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm_dot), device="cpu")
    q, d = st.encode([QUERY]), st.encode(DOCS)
    cosine = (d / np.linalg.norm(d, axis=1, keepdims=True)) @ (q[0] / np.linalg.norm(q[0]))
    assert np.abs(st.similarity(q, d).numpy()[0] - cosine).max() > 0.1


def test_routes_score_a_dot_product_model(minilm_dot: Path) -> None:
    with Engine.from_workflow(None, minilm_dot) as engine, serve(engine, model="m") as (url, _):
        assert engine.scorer.scoring == "dot"
        assert_routes_score(url, st_scores(minilm_dot, [QUERY], DOCS)[0], 1e-4, 1e-6)


def st_sparse(folder: Path, queries: list[str], docs: list[str]) -> np.ndarray:
    from sentence_transformers import SparseEncoder

    st = SparseEncoder(str(folder), device="cpu")
    assert st.similarity_fn_name == "dot"
    return st.similarity(st.encode(queries), st.encode(docs)).to_dense().numpy()


def test_splade_scores_the_sparse_dot_product(splade: Path) -> None:
    queries = [QUERY, "bananas"]
    want = st_sparse(splade, queries, DOCS)
    assert np.count_nonzero(want) > 0
    with Engine.from_workflow(None, splade) as engine:
        assert engine.workflow.name == "splade" and engine.scorer.scoring == "dot"
        assert engine.scorer.output == "sparse"
        got = np.stack([engine.score([(q, d) for d in DOCS]) for q in queries])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
        with serve(engine, model="m") as (url, _):
            assert_routes_score(url, want[0], 1e-4, 1e-6)


def test_split_engine_scores_splade_as_one_does(splade: Path) -> None:
    """The dot scorer travels to the API server in EngineInfo and scores the sparse weights there."""
    with serve_split(splade, 1, "--served-model-name", "m") as (url, _):
        assert_routes_score(url, st_sparse(splade, [QUERY], DOCS)[0], 1e-4, 1e-6)


def test_sparse_scores_by_key_whatever_the_order() -> None:
    """Sparse weights are matched by token id, not by position; a token only one side has adds nothing."""

    class Fake(DotScorer):
        def __init__(self) -> None:
            self.output = "sparse"

    query = {"sparse": {7: 2.0, 3: 1.0}}
    docs = [{"sparse": {3: 4.0, 7: 0.5}}, {"sparse": {9: 5.0}}, {"sparse": {}}]
    assert Fake().score(query, docs).tolist() == [5.0, 0.0, 0.0]


@pytest.mark.parametrize("similarity", ["angle", "maxsim", "dot_product"])
def test_a_similarity_wde_does_not_score_with_is_refused(similarity: str, minilm_path: Path, tmp_path: Path) -> None:
    folder = dense_folder(minilm_path, tmp_path / "st", "dot")
    config = json.loads((folder / "config_sentence_transformers.json").read_text())
    (folder / "config_sentence_transformers.json").write_text(json.dumps({**config, "similarity_fn_name": similarity}))
    with pytest.raises(ModelLoadError, match=f"similarity_fn_name '{similarity}' is not a similarity WDE scores"):
        Engine.from_workflow(None, folder)
    # naming a scorer serves it anyway
    with Engine.from_workflow(None, folder, overrides=["scorer.name=dot"]) as engine:
        assert engine.scorer.scoring == "dot"


def test_sparse_cosine_is_refused(splade: Path, tmp_path: Path) -> None:
    import shutil

    folder = Path(shutil.copytree(splade, tmp_path / "st"))
    config = json.loads((folder / "config_sentence_transformers.json").read_text())
    (folder / "config_sentence_transformers.json").write_text(json.dumps({**config, "similarity_fn_name": "cosine"}))
    with pytest.raises(ModelLoadError, match="similarity_fn_name 'cosine' is not a similarity WDE scores sparse"):
        Engine.from_workflow(None, folder)
