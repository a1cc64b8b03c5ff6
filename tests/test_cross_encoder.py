"""Cross-encoders / rerankers: WDE vs sentence-transformers' CrossEncoder and transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests import tiny_heads
from tests.tiny_models import varied_texts
from wde import Engine
from wde.errors import RequestError
from wde.request import PoolingParams

TOL = 1e-4


def _pairs(n: int, seed: int) -> list[tuple[str, str]]:
    queries = [" ".join(t.split()[:12]) for t in varied_texts(n, seed=seed)]
    documents = [" ".join(t.split()[:24]) for t in varied_texts(n, seed=seed + 100)]
    return list(zip(queries, documents))


def _hf_logits(path: Path, pairs: list[tuple[str, str]], **tokenize) -> np.ndarray:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    out = []
    with torch.inference_mode():
        for i in range(0, len(pairs), 16):
            chunk = pairs[i:i + 16]
            enc = tok([q for q, _ in chunk], [d for _, d in chunk], padding=True, return_tensors="pt", **tokenize)
            out.append(model(**enc).logits.squeeze(-1))
    return torch.cat(out).numpy()


@pytest.fixture(scope="module")
def minilm_ce(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_heads.build_minilm_classifier(minilm_path, tmp_path_factory.mktemp("minilm-ce"), num_labels=1)


@pytest.fixture(scope="module")
def ce_engine(minilm_ce: Path):
    with Engine.from_workflow("cross_encoder", minilm_ce) as engine:
        yield engine


@pytest.fixture(scope="module")
def xlmr_reranker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_heads.build_xlmr_classifier(tmp_path_factory.mktemp("xlmr-reranker"), num_labels=1)


def test_minilm_cross_encoder_matches_sentence_transformers(minilm_ce: Path, ce_engine: Engine) -> None:
    from sentence_transformers import CrossEncoder

    pairs = _pairs(60, seed=3)
    ce = CrossEncoder(str(minilm_ce), device="cpu")
    expected = ce.predict(pairs, batch_size=16)
    assert ce_engine.supported_outputs == ("score",)
    got = ce_engine.score(pairs)
    raw = ce_engine.score(pairs, activation=False)
    assert got.dtype == np.float32 and got.shape == (60,)
    assert np.abs(got - expected).max() <= TOL
    assert np.abs(raw - _hf_logits(minilm_ce, pairs)).max() <= TOL
    out = ce_engine.encode([pairs[0]])[0].outputs["score"]
    assert out.dtype == np.float32 and out.ndim == 0


def test_xlmr_reranker_matches_transformers(xlmr_reranker: Path) -> None:
    pairs = _pairs(55, seed=5)
    logits = _hf_logits(xlmr_reranker, pairs, truncation="only_second", max_length=128)
    with Engine.from_workflow("bge_reranker_v2_m3", xlmr_reranker) as engine:
        raw = engine.score(pairs, activation=False, truncate=True)
        scores = engine.score(pairs, truncate=True)
        assert np.abs(raw - logits).max() <= TOL
        assert np.abs(scores - torch.sigmoid(torch.from_numpy(logits)).numpy()).max() <= TOL
        query, docs = pairs[0][0], [d for _, d in pairs]
        ranked = engine.rerank(query, docs, truncate=True)
        reference = engine.score([(query, d) for d in docs], truncate=True)
        assert [i for i, _ in ranked] == sorted(range(len(docs)), key=lambda i: -reference[i])
        assert [s for _, s in ranked] == sorted(reference.tolist(), reverse=True)
        assert engine.rerank(query, docs, top_n=3, truncate=True) == ranked[:3]


def test_xlmr_classification_architecture_serves_score_by_default(xlmr_reranker: Path) -> None:
    with Engine.from_workflow(None, xlmr_reranker) as engine:
        assert engine.workflow.name == "xlm_roberta_sequence_classification"
        assert engine.supported_outputs == ("score",)


def test_long_pairs_truncate_document_only(minilm_ce: Path) -> None:
    from transformers import AutoTokenizer

    query = "how many people live in berlin"
    document = " ".join(varied_texts(40, seed=9))
    with Engine.from_workflow("cross_encoder", minilm_ce, tokenizer={"params": {"max_length": 48}}) as engine:
        with pytest.raises(RequestError, match="truncate"):
            engine.score([(query, document)])
        got = engine.score([(query, document)], truncate=True, activation=False)
        ids = engine.encode([(query, document)], PoolingParams(truncate=True))[0].prompt_token_ids
        with pytest.raises(RequestError, match="cannot be truncated"):
            engine.score([(document, query)], truncate=True)
    tok = AutoTokenizer.from_pretrained(minilm_ce)
    expected_ids = tok(query, document, truncation="only_second", max_length=48)["input_ids"]
    assert ids == expected_ids and len(ids) == 48
    assert ids[:len(tok(query)["input_ids"])] == tok(query)["input_ids"]
    expected = _hf_logits(minilm_ce, [(query, document)], truncation="only_second", max_length=48)
    assert np.abs(got - expected).max() <= TOL


def test_pair_truncation_keeps_the_whole_first_text_down_to_one_token_of_the_second(minilm_ce: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_ce)
    first, second = "how many people live in berlin", "berlin has about four million inhabitants today"
    shortest = len(tok(first, add_special_tokens=False)["input_ids"]) + tok.num_special_tokens_to_add(pair=True) + 1
    with Engine.from_workflow("cross_encoder", minilm_ce, tokenizer={"params": {"max_length": shortest}}) as engine:
        ids = engine.encode([(first, second)], PoolingParams(truncate=True))[0].prompt_token_ids
        assert ids == tok(first, second, truncation="only_second", max_length=shortest)["input_ids"]
    with Engine.from_workflow("cross_encoder", minilm_ce, tokenizer={"params": {"max_length": shortest - 1}}) as engine:
        with pytest.raises(RequestError, match=f"cannot be truncated to {shortest - 1} tokens.*already takes"
                                               f" {shortest - 1}"):
            engine.score([(first, second)], truncate=True)
        assert engine.score([(first[:10], second)], truncate=True).shape == (1,)


def test_cross_encoder_rejects_single_texts_and_bad_top_n(ce_engine: Engine) -> None:
    with pytest.raises(RequestError, match="pairs"):
        ce_engine.score(["just one text"])  # type: ignore[list-item]
    with pytest.raises(RequestError, match="top_n"):
        ce_engine.rerank("q", ["a", "b"], top_n=0)
    with pytest.raises(RequestError, match="probs"):
        ce_engine.classify(["text"])
    assert ce_engine.rerank("q", []) == []


def test_embedding_workflow_scores_with_cosine(minilm_engine: Engine) -> None:
    """An embedder scores with its scorer (tests/test_scorer.py); a cross-encoder's activation is refused."""
    assert minilm_engine.score([("a", "b")]).shape == (1,)
    with pytest.raises(RequestError, match="activation"):
        minilm_engine.score([("a", "b")], activation=True)
