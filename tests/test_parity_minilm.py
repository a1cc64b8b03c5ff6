"""The real all-MiniLM-L6-v2 through the `bert` workflow equals sentence-transformers on varied text (fp32)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from tests.tiny_models import WORDS, varied_texts
from wde import Engine, RequestError

TOLERANCE = 1e-4


def parity_texts() -> list[str]:
    """Short, long (> 256 tokens), non-ASCII, mixed-case and punctuated texts."""
    rng = random.Random(3)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 2, 3, 5, 8, 13, 21]))) for _ in range(150)]
    texts += [t for t in varied_texts(40, seed=11) if len(t.split()) <= 60]
    texts += [" ".join(rng.choice(WORDS) for _ in range(rng.randint(300, 400))) for _ in range(7)]
    texts += [
        "Hi", "a", "?", "OK!", "This is an example sentence", "Each sentence is converted",
        "MiXeD CaSe TeXt WiTh ÜMLAUTS and ÀCCENTS", "naïve café — déjà vu; coöperate…",
        "東京は日本の首都です。", "Москва — столица России.", "مرحبا بالعالم", "🙂 emoji 🚀 and symbols ©®™",
        "Punctuation!!! Does it... matter??? (yes) [no] {maybe} <tag> 'quotes' \"double\"",
        "tabs\tand\nnewlines\r\nin the middle", "   leading and trailing whitespace   ",
        "numbers 3.14159 2,718 1e-10 -42 0x1F", "URLs https://example.com/a?b=c&d=e#f and e-mails a@b.co",
        "A" * 300, "word " * 400, "ÄÖÜ äöü ß " * 60,
    ]
    return texts


@pytest.fixture(scope="module")
def reference(minilm_path: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path), device="cpu")


def test_minilm_matches_sentence_transformers(minilm_engine: Engine, reference) -> None:
    texts = parity_texts()
    assert len(texts) >= 200
    ids = reference.tokenizer(texts, add_special_tokens=True)["input_ids"]
    assert sum(len(x) > 256 for x in ids) >= 8, "the long texts must exceed the 256-token limit"
    assert minilm_engine.max_length == reference.max_seq_length == 256

    expected = reference.encode(texts, batch_size=32, convert_to_numpy=True)
    got = minilm_engine.embed(texts, truncate=True)
    assert got.shape == expected.shape == (len(texts), 384)
    diff = np.abs(got - expected).max(axis=1)
    assert diff.max() <= TOLERANCE, f"max abs diff {diff.max():.2e} on {texts[int(diff.argmax())][:60]!r}"
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_minilm_pooling_comes_from_the_st_config(minilm_engine: Engine) -> None:
    pooler = minilm_engine.components["pooler"]
    assert (pooler.mode, pooler.normalize) == ("mean", True)
    raw = minilm_engine.embed(["an unnormalized vector"], normalize=False)[0]
    assert abs(np.linalg.norm(raw) - 1.0) > 1e-3
    np.testing.assert_allclose(raw / np.linalg.norm(raw), minilm_engine.embed("an unnormalized vector"), atol=1e-6)


@pytest.mark.parametrize("text", ["", "   ", "\n\t"])
def test_whitespace_only_text_is_an_error(minilm_engine: Engine, text: str) -> None:
    with pytest.raises(RequestError) as info:
        minilm_engine.embed(["fine", text])
    assert info.value.field == "input"
    assert str(info.value).startswith("input[1]: ") and "empty" in str(info.value)


def test_long_text_without_truncate_names_count_and_limit(minilm_engine: Engine, reference) -> None:
    text = "word " * 400
    n_tokens = len(reference.tokenizer(text)["input_ids"])
    with pytest.raises(RequestError) as info:
        minilm_engine.embed(text)
    assert f"{n_tokens} tokens" in str(info.value) and "limit of 256" in str(info.value)
    assert info.value.field == "input"
