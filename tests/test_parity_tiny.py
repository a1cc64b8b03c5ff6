"""Tiny random BERT / XLM-R through WDE equal `transformers.AutoModel` + the same pooling, for every pooling mode."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tiny_models import varied_texts
from wde import Engine, PoolingParams

TOLERANCE = 1e-4
TEXTS = varied_texts(16, seed=5) + ["café naïve 東京 größe", "HELLO, World!!", "x"]
MODELS = {"tiny_bert": "bert", "tiny_xlmr": "xlm_roberta", "tiny_xlmr_realvocab": "xlm_roberta"}
MULTILINGUAL = ["Привет, мир", "Bonjour à tous !", "東京は日本の首都です。", "¿Dónde está la biblioteca?"]


@functools.lru_cache(maxsize=None)
def hf(path: str):
    from transformers import AutoModel, AutoTokenizer

    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()


def reference_states(path: Path, text: str, max_length: int, text_pair: str | None = None,
                     with_types: bool = True) -> np.ndarray:
    """[tokens, hidden] last hidden states of one unpadded input, as transformers computes them."""
    tok, model = hf(str(path))
    enc = tok(text, text_pair, truncation=True, max_length=max_length, return_tensors="pt")
    if not with_types:
        enc.pop("token_type_ids", None)
    with torch.no_grad():
        return model(**enc).last_hidden_state[0].numpy()


def reference_pool(states: np.ndarray, mode: str) -> np.ndarray:
    return {"cls": states[0], "last": states[-1], "mean": states.mean(0), "max": states.max(0), "all": states}[mode]


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def texts_for(fixture: str) -> list[str]:
    return TEXTS + MULTILINGUAL if fixture == "tiny_xlmr_realvocab" else TEXTS + MULTILINGUAL[:1]


@pytest.mark.parametrize("fixture", ["tiny_bert", "tiny_xlmr"])
@pytest.mark.parametrize("mode", ["cls", "mean", "max", "last", "all"])
def test_pooling_matches_transformers(request: pytest.FixtureRequest, fixture: str, mode: str) -> None:
    path: Path = request.getfixturevalue(fixture)
    texts = texts_for(fixture)
    pooler = {"params": {"pooling": mode, "normalize": False}}
    with Engine.from_workflow(MODELS[fixture], path, pooler=pooler) as engine:
        outs = engine.encode(texts, PoolingParams(truncate=True))
        max_length = engine.max_length
    key = "token_embeddings" if mode == "all" else "dense"
    worst = 0.0
    for text, out in zip(texts, outs):
        expected = reference_pool(reference_states(path, text, max_length), mode)
        got = out.outputs[key]
        assert got.shape == expected.shape, text
        worst = max(worst, float(np.abs(got - expected).max()))
    assert worst <= TOLERANCE, f"{fixture}/{mode}: max abs diff {worst:.2e}"


@pytest.mark.parametrize("fixture", sorted(MODELS))
def test_normalized_mean_and_token_ids_input(request: pytest.FixtureRequest, fixture: str) -> None:
    """One engine per model: the real 250k-token XLM-R tokenizer takes seconds to load."""
    path: Path = request.getfixturevalue(fixture)
    texts = texts_for(fixture)[-10:]
    pooler = {"params": {"pooling": "mean", "normalize": True}}
    with Engine.from_workflow(MODELS[fixture], path, pooler=pooler) as engine:
        from_text = engine.embed(texts, truncate=True)
        ids = [out.prompt_token_ids for out in engine.encode(texts, PoolingParams(truncate=True))]
        from_ids = engine.embed([{"token_ids": i} for i in ids])
        from_lists = engine.embed(ids)
        raw = engine.embed(texts, truncate=True, normalize=False)
        max_length = engine.max_length
    tok, _ = hf(str(path))
    assert ids[0] == tok(texts[0], truncation=True, max_length=max_length)["input_ids"]
    expected = np.stack([unit(reference_pool(reference_states(path, t, max_length), "mean")) for t in texts])
    assert np.abs(from_text - expected).max() <= TOLERANCE
    assert np.abs(from_ids - from_text).max() <= 1e-6
    assert np.abs(from_lists - from_text).max() <= 1e-6
    assert np.abs(unit(raw) - from_text).max() <= 1e-6 and np.abs(raw - from_text).max() > 1e-3


def test_bge_prompt_prepends_the_instruction(tiny_bert: Path) -> None:
    texts = ["what is the capital of france", "hot water"]
    with Engine.from_workflow("bge_v1_5", tiny_bert) as engine:
        prefix = engine.input_processor.prompts["query"]
        queries = engine.embed(texts, prompt_name="query")
        prefixed = engine.embed([prefix + t for t in texts])
        plain = engine.embed(texts)
    assert prefix == "Represent this sentence for searching relevant passages: "
    expected = np.stack([unit(reference_pool(reference_states(tiny_bert, prefix + t, 128), "cls")) for t in texts])
    assert np.abs(queries - expected).max() <= TOLERANCE
    assert np.abs(queries - prefixed).max() <= 1e-6
    assert np.abs(queries - plain).max() > 1e-3


def test_bert_pairs_use_token_type_ids(tiny_bert: Path) -> None:
    pairs = [("what is hot", "the water was hot"), ("paris", "berlin and paris are cities"), ("a", "b c d")]
    with Engine.from_workflow("bert", tiny_bert, input_processor={"params": {"pairs": "allow"}},
                              pooler={"params": {"pooling": "cls", "normalize": False}}) as engine:
        outs = engine.encode(pairs)
    tok, _ = hf(str(tiny_bert))
    for (query, doc), out in zip(pairs, outs):
        assert out.prompt_token_ids == tok(query, doc)["input_ids"]
        with_types = reference_pool(reference_states(tiny_bert, query, 128, doc), "cls")
        without_types = reference_pool(reference_states(tiny_bert, query, 128, doc, with_types=False), "cls")
        assert np.abs(out.outputs["dense"] - with_types).max() <= TOLERANCE
        assert np.abs(with_types - without_types).max() > 1e-3, "the test must tell token types apart"
