"""Sequence classifiers: WDE probabilities and labels vs transformers' *ForSequenceClassification."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests import tiny_heads
from tests.ranking import assert_ranked
from tests.tiny_models import varied_texts
from wde import Engine
from wde.errors import ModelLoadError, RequestError
from wde.request import PoolingParams

TOL = 1e-4
LABELS = {0: "neg", 1: "neu", 2: "pos"}


def _hf_logits(path: Path, texts: list[str], **tokenize) -> np.ndarray:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    out = []
    with torch.inference_mode():
        for i in range(0, len(texts), 16):
            enc = tok(texts[i:i + 16], padding=True, return_tensors="pt", **tokenize)
            out.append(model(**enc).logits)
    return torch.cat(out).numpy()


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [" ".join(t.split()[:40]) for t in varied_texts(56, seed=11)]


@pytest.fixture(scope="module")
def minilm_cls3(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_heads.build_minilm_classifier(minilm_path, tmp_path_factory.mktemp("minilm-cls3"), num_labels=3,
                                              id2label=LABELS, label2id={v: k for k, v in LABELS.items()})


def test_softmax_probs_and_labels_match_transformers(minilm_cls3: Path, texts: list[str]) -> None:
    logits = _hf_logits(minilm_cls3, texts)
    expected = torch.softmax(torch.from_numpy(logits), -1).numpy()
    with Engine.from_workflow(None, minilm_cls3) as engine:
        assert engine.workflow.name == "sequence_classification"
        assert engine.supported_outputs == ("probs",)
        assert engine.components["pooler"].labels == ["neg", "neu", "pos"]
        probs = np.stack([o.outputs["probs"] for o in engine.encode(texts)])
        raw = engine.classify(texts[:12], activation=False)
        ranked = engine.classify(texts[:12], top_k=2)
    assert probs.dtype == np.float32 and probs.shape == (len(texts), 3)
    assert np.abs(probs - expected).max() <= TOL
    for row, got in zip(logits, raw):
        assert max(abs(row[["neg", "neu", "pos"].index(label)] - value) for label, value in got) <= TOL
    for row, got in zip(expected, ranked):
        assert_ranked(got, {LABELS[j]: float(p) for j, p in enumerate(row)}, tol=TOL, top_n=2)


def test_multi_label_uses_sigmoid(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                  texts: list[str]) -> None:
    path = tiny_heads.build_minilm_classifier(minilm_path, tmp_path_factory.mktemp("minilm-multi"), num_labels=4,
                                              problem_type="multi_label_classification", seed=1)
    expected = torch.sigmoid(torch.from_numpy(_hf_logits(path, texts))).numpy()
    with Engine.from_workflow("sequence_classification", path) as engine:
        assert engine.components["pooler"].labels == [f"LABEL_{i}" for i in range(4)]
        probs = np.stack([o.outputs["probs"] for o in engine.encode(texts)])
    assert np.abs(probs - expected).max() <= TOL
    assert not np.allclose(probs.sum(-1), 1.0, atol=1e-3)


def test_xlmr_classifier_matches_transformers(tmp_path_factory: pytest.TempPathFactory, texts: list[str]) -> None:
    path = tiny_heads.build_xlmr_classifier(tmp_path_factory.mktemp("xlmr-cls"), num_labels=5)
    expected = torch.softmax(torch.from_numpy(_hf_logits(path, texts, truncation=True, max_length=128)), -1).numpy()
    with Engine.from_workflow(None, path) as engine:
        assert engine.workflow.name == "xlm_roberta_sequence_classification"
        probs = np.stack([o.outputs["probs"] for o in engine.encode(texts, PoolingParams(truncate=True))])
    assert np.abs(probs - expected).max() <= TOL


def test_classifier_errors(minilm_cls3: Path) -> None:
    with pytest.raises(ModelLoadError, match="3 labels"):
        Engine.from_workflow("cross_encoder", minilm_cls3)
    with Engine.from_workflow("sequence_classification", minilm_cls3) as engine:
        with pytest.raises(RequestError, match="top_k"):
            engine.classify(["text"], top_k=-1)
        with pytest.raises(RequestError, match="score"):
            engine.score([("a", "b")])
