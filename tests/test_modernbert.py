"""ModernBERT against transformers on tiny random configs (fp32 CPU, ≤ 1e-4): the encoder with local layers whose
window is shorter than the inputs, through every CPU attention backend; the sentence-transformers folder; and
ModernBertForSequenceClassification (CLS and mean heads) as reranker / classifier."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tiny_models import bert_tokenizer, varied_texts
from wde import Engine, PoolingParams

TOL = 1e-4
CONFIG = dict(hidden_size=64, num_hidden_layers=5, num_attention_heads=4, intermediate_size=96,
              max_position_embeddings=512, global_attn_every_n_layers=3, local_attention=16,
              global_rope_theta=160000.0, local_rope_theta=10000.0, norm_bias=False, attention_bias=False,
              mlp_bias=False, pad_token_id=0, bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3)
TEXTS = varied_texts(24, seed=5) + ["a " * 120, "berlin paris " * 40, "x"]


def build(out: Path, cls_name: str = "ModernBertModel", **extra: object) -> Path:
    import transformers

    torch.manual_seed(0)
    tok = bert_tokenizer()
    cfg = transformers.ModernBertConfig(vocab_size=len(tok), **{**CONFIG, **extra})
    model = getattr(transformers, cls_name)(cfg).eval()
    with torch.no_grad():  # random LayerNorm weights and biases so a bias-free norm or a wrong one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def modernbert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("modernbert"))


def hf_states(folder: Path, texts: list[str]) -> list[np.ndarray]:
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for t in texts:
            enc = tok(t, return_tensors="pt", truncation=True, max_length=128)
            out.append(model(**enc).last_hidden_state[0].numpy())
    return out


def test_the_tiny_config_has_local_layers_shorter_than_the_inputs(modernbert: Path) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(modernbert)
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention", "full_attention",
                               "sliding_attention"]
    assert cfg.sliding_window == 8
    with Engine.from_workflow(None, modernbert, overrides=["pooler.params.pooling=all"]) as engine:
        assert engine.workflow.name == "modernbert"
        model = engine.components["model"]
        assert [layer.attention_window for layer in model.encoder.layer] == [None, (8, 8), (8, 8), None, (8, 8)]
        lens = [len(ids) for ids in engine.tokenizer.hf_tokenizer(TEXTS)["input_ids"]]
    assert max(lens) > 4 * 16  # (128 after truncation: still 8 windows)


@pytest.mark.parametrize("attention", ["auto", "torch_sdpa", "cpu_varlen"])
def test_hidden_states_match_transformers(modernbert: Path, attention: str) -> None:
    expected = hf_states(modernbert, TEXTS)
    with Engine.from_workflow(None, modernbert, overrides=["pooler.params.pooling=all", "pooler.params.normalize=false",
                                                          f"attention.name={attention}"]) as engine:
        outs = engine.encode(TEXTS, PoolingParams(truncate=True))
    for text, out, ref in zip(TEXTS, outs, expected):
        got = out.outputs["token_embeddings"]
        assert got.shape == ref.shape
        diff = np.abs(got - ref).max()
        assert diff <= TOL, f"{attention}: max abs diff {diff:.2e} on {text[:40]!r}"


def test_sentence_transformers_folder(modernbert: Path, tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer, models

    st_dir = tmp_path / "st"
    SentenceTransformer(modules=[models.Transformer(str(modernbert), max_seq_length=128),
                                 models.Pooling(64, "mean"), models.Normalize()], device="cpu").save(str(st_dir))
    expected = SentenceTransformer(str(st_dir), device="cpu").encode(TEXTS, batch_size=8)
    with Engine.from_workflow(None, st_dir) as engine:
        got = engine.embed(TEXTS, truncate=True)
        alone = engine.embed(TEXTS[-3], truncate=True)
    assert np.abs(got - expected).max() <= TOL
    assert np.abs(alone - got[-3]).max() <= 1e-5  # a text alone equals it in a packed batch


@pytest.mark.parametrize(("labels", "pooling"), [(1, "cls"), (3, "mean")])
def test_sequence_classification(tmp_path: Path, labels: int, pooling: str) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = build(tmp_path / "cls", "ModernBertForSequenceClassification", num_labels=labels,
                   classifier_pooling=pooling, classifier_activation="gelu")
    pairs = [("what is the capital", "paris is the capital of " * 6), ("who", "a b c"), ("berlin " * 30, "x")]
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = np.stack([model(**tok(a, b, return_tensors="pt")).logits[0].numpy() for a, b in pairs])
    with Engine.from_workflow(None, folder) as engine:
        assert engine.workflow.name == "modernbert_sequence_classification"
        outs = engine.encode(pairs, PoolingParams(activation=False))
    got = np.stack([np.atleast_1d(o.outputs["score" if labels == 1 else "probs"]) for o in outs])
    assert np.abs(got - expected).max() <= TOL


def test_the_window_matters(modernbert: Path) -> None:
    """Guard against a test that cannot fail: with the local layers' windows dropped, the states differ."""
    expected = hf_states(modernbert, TEXTS[-3:-1])
    with Engine.from_workflow(None, modernbert, overrides=["pooler.params.pooling=all"]) as engine:
        for layer in engine.components["model"].encoder.layer:
            layer.attention_window = None
        outs = engine.encode(TEXTS[-3:-1], PoolingParams(truncate=True))
    assert max(np.abs(o.outputs["token_embeddings"] - ref).max() for o, ref in zip(outs, expected)) > 1e-3
