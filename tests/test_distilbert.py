"""DistilBERT (`distilbert`, `distilbert_sequence_classification`): hidden states equal transformers'
DistilBertModel (learned and sinusoidal position tables), embeddings equal sentence-transformers on the pipelines
DistilBERT models ship with (distiluse: mean → Dense(tanh); multi-qa-distilbert-cos: mean → Normalize), and
classifier logits equal DistilBertForSequenceClassification's, on tiny random models."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tiny_models import WORDS, bert_tokenizer, varied_texts
from wde import Engine, PoolingParams
from wde.errors import ModelLoadError

TOL = 1e-4
TOKENS = {"name": "sentence", "params": {"pooling": "all", "normalize": False}}
LABELS = {0: "neg", 1: "neu", 2: "pos"}


def _long_text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


TEXTS = varied_texts(14, seed=31) + [_long_text(300, 1), "x", "Hello, World!! 42 ünïcödé"]
PAIRS = [(" ".join(TEXTS[i].split()[:12]) or "q", TEXTS[(i * 5 + 2) % len(TEXTS)]) for i in range(10)]


def distilbert_tokenizer():
    from transformers import DistilBertTokenizerFast

    return bert_tokenizer(DistilBertTokenizerFast, model_max_length=512)


def build_distilbert(out: Path, seed: int = 0, head: str | None = None, **config) -> Path:
    """A tiny DistilBertModel (dim 64, 2 layers), or with `head="classification"` a
    DistilBertForSequenceClassification."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification, DistilBertModel

    torch.manual_seed(seed)
    tok = distilbert_tokenizer()
    cfg = DistilBertConfig(vocab_size=len(tok), dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                           max_position_embeddings=512, **config)
    model = (DistilBertForSequenceClassification if head == "classification" else DistilBertModel)(cfg).eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_st(model: Path, out: Path, pipeline: str) -> Path:
    """`model` saved by sentence-transformers with the pipeline of a published DistilBERT embedder."""
    from sentence_transformers import SentenceTransformer

    try:  # sentence-transformers >= 6 moved the module classes
        from sentence_transformers.sentence_transformer import modules as st_models
    except ImportError:
        from sentence_transformers import models as st_models

    torch.manual_seed(1)
    after = {
        "distiluse": lambda: [st_models.Pooling(64, "mean"),
                              st_models.Dense(64, 32, activation_function=torch.nn.Tanh())],
        "multi-qa-cos": lambda: [st_models.Pooling(64, "mean"), st_models.Normalize()],
    }[pipeline]()
    SentenceTransformer(modules=[st_models.Transformer(str(model)), *after], device="cpu").save(str(out))
    return out


@pytest.fixture(scope="module")
def distilbert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_distilbert(tmp_path_factory.mktemp("distilbert"))


@functools.lru_cache(maxsize=None)
def _hf(path: str, head: bool = False):
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    cls = AutoModelForSequenceClassification if head else AutoModel
    return AutoTokenizer.from_pretrained(path), cls.from_pretrained(path).eval()


def hf_states(path: Path, text: str) -> np.ndarray:
    tok, model = _hf(str(path))
    with torch.no_grad():
        return model(**tok(text, return_tensors="pt")).last_hidden_state[0].numpy()


def hf_logits(path: Path, inputs: list) -> np.ndarray:
    tok, model = _hf(str(path), head=True)
    rows = []
    with torch.no_grad():
        for x in inputs:
            enc = tok(*x, return_tensors="pt") if isinstance(x, tuple) else tok(x, return_tensors="pt")
            rows.append(model(**enc).logits[0].numpy())
    return np.stack(rows)


def assert_states_match(engine: Engine, path: Path, texts: list[str]) -> float:
    worst = 0.0
    for text, out in zip(texts, engine.encode(texts)):
        ref = hf_states(path, text)
        got = out.outputs["token_embeddings"]
        assert got.shape == ref.shape, text
        worst = max(worst, float(np.abs(got - ref).max()))
    assert worst <= TOL, f"max abs diff {worst:.2e}"
    return worst


def test_hidden_states_match_transformers(distilbert: Path) -> None:
    """Picked by the DistilBertModel architecture; every length in one packed batch (3 to ~300 tokens)."""
    with Engine.from_workflow(None, distilbert, pooler=TOKENS, dtype="float32", device="cpu") as engine:
        assert engine.workflow.name == "distilbert"
        assert_states_match(engine, distilbert, TEXTS)
    assert max(len(hf_states(distilbert, t)) for t in TEXTS) > 300


def test_sinusoidal_positions_match_transformers(tmp_path: Path) -> None:
    path = build_distilbert(tmp_path / "sinusoidal", seed=2, sinusoidal_pos_embds=True)
    table = _hf(str(path))[1].embeddings.position_embeddings.weight
    assert torch.allclose(table[1, :2], torch.tensor([np.sin(1.0), np.cos(1.0)], dtype=torch.float32))
    with Engine.from_workflow("distilbert", path, pooler=TOKENS, dtype="float32", device="cpu") as engine:
        assert_states_match(engine, path, TEXTS[:8] + TEXTS[-3:])


@pytest.mark.parametrize("pipeline", ["distiluse", "multi-qa-cos"])
def test_matches_sentence_transformers(distilbert: Path, tmp_path: Path, pipeline: str) -> None:
    from sentence_transformers import SentenceTransformer

    folder = build_st(distilbert, tmp_path / "st", pipeline)
    ref = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, batch_size=8, convert_to_numpy=True)
    with Engine.from_workflow(None, folder, dtype="float32", device="cpu") as engine:
        assert engine.workflow.name == "distilbert"
        got = engine.embed(TEXTS)
        alone = np.stack([engine.embed(t) for t in TEXTS])
    assert got.shape == ref.shape == (len(TEXTS), 32 if pipeline == "distiluse" else 64)
    diff = float(np.abs(got - ref).max())
    assert diff <= TOL, f"max abs diff {diff:.2e}"
    assert np.abs(alone - got).max() <= 1e-5  # a text alone equals the same text in a packed batch


def test_classifier_probs_match_transformers(tmp_path: Path) -> None:
    path = build_distilbert(tmp_path / "cls3", head="classification", num_labels=3, id2label=LABELS,
                            label2id={v: k for k, v in LABELS.items()})
    logits = hf_logits(path, TEXTS)
    with Engine.from_workflow(None, path, dtype="float32", device="cpu") as engine:
        assert engine.workflow.name == "distilbert_sequence_classification"
        assert engine.components["pooler"].labels == ["neg", "neu", "pos"]
        probs = np.stack([o.outputs["probs"] for o in engine.encode(TEXTS)])
        raw = engine.classify(TEXTS, activation=False)
    expected = torch.softmax(torch.from_numpy(logits), -1).numpy()
    assert np.abs(probs - expected).max() <= TOL
    got_logits = np.array([[dict(row)[LABELS[j]] for j in range(3)] for row in raw])
    assert np.abs(got_logits - logits).max() <= TOL


def test_cross_encoder_scores_match_transformers(tmp_path: Path) -> None:
    """One label: (query, document) pairs get a score; DistilBERT has no token types, so the pair's segment ids
    change nothing, as in transformers."""
    path = build_distilbert(tmp_path / "ce", seed=3, head="classification", num_labels=1)
    logits = hf_logits(path, PAIRS)[:, 0]
    with Engine.from_workflow(None, path, dtype="float32", device="cpu") as engine:
        scores = np.array([o.outputs["score"] for o in engine.encode(PAIRS)])
        raw = np.array([o.outputs["score"] for o in engine.encode(PAIRS, PoolingParams(activation=False))])
    assert np.abs(raw - logits).max() <= TOL
    assert np.abs(scores - 1 / (1 + np.exp(-logits))).max() <= TOL


def test_wrong_config_is_refused(tiny_bert: Path) -> None:
    with pytest.raises(ModelLoadError, match="serves \\['DistilBertModel'\\]|model_type 'distilbert'"):
        Engine.from_workflow("distilbert", tiny_bert, pooler=TOKENS, device="cpu")
