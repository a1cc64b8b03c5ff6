"""DeBERTa-v2 / v3 (`deberta_v2_sequence_classification`, `deberta_v2`): logits equal transformers'
DebertaV2ForSequenceClassification and hidden states equal DebertaV2Model on tiny random models (hidden 64) whose
disentangled attention is exercised by inputs much longer than the position buckets (exact, log-bucketed and
clamped distances): c2p + p2c and c2p alone, `share_att_key` both ways, LayerNorm'ed relative embeddings,
absolute positions and token types (deberta-v2 style), unbucketed distances with the convolution layer and an
`embed_proj`; one label (reranker score) and three (probs); pairs and single texts; a text alone equals it in a
packed batch. The tokenizer is a SentencePiece-style Unigram model wrapped in transformers' DebertaV2Tokenizer."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tiny_models import WORDS, corpus, varied_texts
from wde import Engine, PoolingParams
from wde.errors import ModelLoadError, WorkflowError

TOL = 1e-4
LABELS = {0: "entailment", 1: "neutral", 2: "contradiction"}
TOKENS = {"name": "sentence", "params": {"pooling": "all", "normalize": False}}


def _long_text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


TEXTS = varied_texts(10, seed=41) + [_long_text(120, 2), "x", "Hello, World!! 42 ünïcödé"]
PAIRS = [(" ".join(TEXTS[i].split()[:10]) or "q", TEXTS[(i * 5 + 2) % len(TEXTS)]) for i in range(8)]

V3 = dict(relative_attention=True, position_buckets=8, max_relative_positions=48, pos_att_type=["p2c", "c2p"],
          share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False, type_vocab_size=0)
"""deberta-v3's settings (256 buckets, 512 positions) scaled down so that ~150-token inputs reach every bucket
kind: exact (|d| <= 4), logarithmic, and clamped beyond max_relative_positions."""

CONFIGS = {
    "v3": V3,
    "c2p-separate-keys": {**V3, "pos_att_type": ["c2p"], "share_att_key": False, "norm_rel_ebd": "none",
                          "num_hidden_layers": 3},
    "p2c-separate-keys": {**V3, "pos_att_type": "p2c", "share_att_key": False},
    "v2-absolute-types": {**V3, "position_biased_input": True, "type_vocab_size": 2, "pos_att_type": "c2p|p2c",
                          "max_relative_positions": -1, "position_buckets": 16},
    "v2-xlarge-conv": {**V3, "position_buckets": -1, "max_relative_positions": 24, "conv_kernel_size": 3,
                       "conv_act": "gelu", "embedding_size": 48},
    "no-relative-attention": {**V3, "relative_attention": False, "position_biased_input": True},
}


@functools.lru_cache(maxsize=1)
def _tokenizer_vocab() -> tuple[list, int]:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tk = Tokenizer(models.Unigram())
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.train_from_iterator(corpus(), trainers.UnigramTrainer(
        vocab_size=400, special_tokens=["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"], unk_token="[UNK]"))
    model = json.loads(tk.to_str())["model"]
    return [tuple(piece) for piece in model["vocab"]], int(model["unk_id"])


def deberta_tokenizer():
    """A SentencePiece-style Unigram vocabulary in transformers' DeBERTa-v2 tokenizer ([CLS] A [SEP] B [SEP])."""
    from transformers import DebertaV2Tokenizer

    vocab, unk_id = _tokenizer_vocab()
    return DebertaV2Tokenizer(vocab=list(vocab), unk_id=unk_id, model_max_length=512)


def build_deberta(out: Path, seed: int = 0, num_labels: int | None = None, **config) -> Path:
    """A tiny DebertaV2Model, or with `num_labels` a DebertaV2ForSequenceClassification (hidden 64, 2 layers)."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification, DebertaV2Model

    torch.manual_seed(seed)
    tok = deberta_tokenizer()
    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
              "max_position_embeddings": 512, "layer_norm_eps": 1e-7, "pad_token_id": 0, "initializer_range": 0.2,
              **config}
    if num_labels is not None:
        config["num_labels"] = num_labels
        if num_labels == 3:
            config.update(id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    cfg = DebertaV2Config(vocab_size=len(tok), **config)
    model = (DebertaV2Model if num_labels is None else DebertaV2ForSequenceClassification)(cfg).eval()
    with torch.no_grad():  # large random weights (initializer_range), random biases and LayerNorms: no term can hide
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@functools.lru_cache(maxsize=None)
def _hf(path: str, head: bool):
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    cls = AutoModelForSequenceClassification if head else AutoModel
    return AutoTokenizer.from_pretrained(path), cls.from_pretrained(path).eval()


def _encode(tok, x):
    return tok(*x, return_tensors="pt") if isinstance(x, tuple) else tok(x, return_tensors="pt")


def hf_logits(path: Path, inputs: list) -> np.ndarray:
    tok, model = _hf(str(path), True)
    with torch.no_grad():
        return np.stack([model(**_encode(tok, x)).logits[0].numpy() for x in inputs])


def hf_states(path: Path, inputs: list) -> list[np.ndarray]:
    tok, model = _hf(str(path), False)
    with torch.no_grad():
        return [model(**_encode(tok, x)).last_hidden_state[0].numpy() for x in inputs]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("deberta")
    return {name: build_deberta(root / name, seed=i, num_labels=3 if i % 2 else 1, **cfg)
            for i, (name, cfg) in enumerate(CONFIGS.items())}


def test_the_inputs_reach_every_kind_of_bucket(models: dict) -> None:
    tok = _hf(str(models["v3"]), True)[0]
    longest = max(len(_encode(tok, x)["input_ids"][0]) for x in TEXTS + PAIRS)
    assert longest > 3 * V3["max_relative_positions"]  # exact, log-bucketed, and clamped beyond the table


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(models: dict, name: str) -> None:
    """Texts and pairs in one packed batch each, every length together; raw logits and the activated outputs."""
    path = models[name]
    num_labels = _hf(str(path), True)[1].config.num_labels
    inputs = TEXTS + PAIRS
    logits = hf_logits(path, inputs)
    with Engine.from_workflow(None, path, dtype="float32", device="cpu") as engine:
        assert engine.workflow.name == "deberta_v2_sequence_classification"
        task = "score" if num_labels == 1 else "probs"
        raw = np.array([o.outputs[task] for o in engine.encode(inputs, PoolingParams(activation=False))])
        out = np.array([o.outputs[task] for o in engine.encode(inputs)])
        alone = np.array([engine.encode([x], PoolingParams(activation=False))[0].outputs[task] for x in inputs[::3]])
    raw = raw.reshape(len(inputs), num_labels)
    diff = float(np.abs(raw - logits).max())
    print(f"{name}: max abs logit diff {diff:.2e}")
    assert diff <= TOL, f"{name}: max abs diff {diff:.2e}"
    if num_labels == 1:
        expected = 1 / (1 + np.exp(-logits[:, 0]))
    else:
        expected = torch.softmax(torch.from_numpy(logits), -1).numpy()
    assert np.abs(out - expected).max() <= TOL
    assert np.abs(alone.reshape(-1, num_labels) - raw[::3]).max() <= 1e-5  # alone == in a packed batch


def test_cross_encoder_scores_and_labels(models: dict) -> None:
    path = models["v3"]
    logits = hf_logits(path, PAIRS)[:, 0]
    with Engine.from_workflow("deberta_v2_sequence_classification", path, dtype="float32", device="cpu") as engine:
        scores = engine.score(PAIRS)
    assert np.abs(np.asarray(scores) - 1 / (1 + np.exp(-logits))).max() <= TOL
    with Engine.from_workflow(None, models["c2p-separate-keys"], dtype="float32", device="cpu") as engine:
        assert engine.components["pooler"].labels == ["entailment", "neutral", "contradiction"]


@pytest.mark.parametrize("attention", ["auto", "torch_sdpa"])
def test_hidden_states_match_transformers(tmp_path: Path, attention: str) -> None:
    """The bare encoder (`deberta_v2`, picked by DebertaV2Model): every token's final state."""
    path = build_deberta(tmp_path / "bare", seed=7, **{**V3, "num_hidden_layers": 3})
    inputs = TEXTS
    refs = hf_states(path, inputs)
    with Engine.from_workflow(None, path, pooler=TOKENS, attention={"name": attention}, dtype="float32",
                              device="cpu") as engine:
        assert engine.workflow.name == "deberta_v2"
        got = [o.outputs["token_embeddings"] for o in engine.encode(inputs)]
    worst = max(float(np.abs(g - r).max()) for g, r in zip(got, refs))
    assert all(g.shape == r.shape for g, r in zip(got, refs))
    assert worst <= TOL, f"max abs diff {worst:.2e}"


def test_mean_embeddings(tmp_path: Path) -> None:
    path = build_deberta(tmp_path / "bare", seed=8, **V3)
    refs = [s.mean(0) for s in hf_states(path, TEXTS)]
    with Engine.from_workflow("deberta_v2", path, overrides=["pooler.params.pooling=mean",
                                                              "pooler.params.normalize=false"],
                              dtype="float32", device="cpu") as engine:
        got = engine.embed(TEXTS)
    assert np.abs(got - np.stack(refs)).max() <= TOL


def test_the_relative_terms_matter(models: dict) -> None:
    """Without the c2p / p2c bias the logits move well beyond the tolerance (the test would catch a lost term)."""
    from wde.components.models import deberta_v2

    path = models["v3"]
    logits = hf_logits(path, PAIRS)
    original = deberta_v2.DisentangledSelfAttention.relative_bias
    try:
        deberta_v2.DisentangledSelfAttention.relative_bias = lambda self, q, k, *a: torch.zeros(  # type: ignore
            len(a[-1].batch.seq_lens), self.num_heads, a[-1].batch.max_seqlen, a[-1].batch.max_seqlen)
        with Engine.from_workflow(None, path, dtype="float32", device="cpu") as engine:
            raw = np.array([o.outputs["score"] for o in engine.encode(PAIRS, PoolingParams(activation=False))])
    finally:
        deberta_v2.DisentangledSelfAttention.relative_bias = original
    moved = float(np.abs(raw - logits[:, 0]).max())
    print(f"spread of the logits {np.ptp(logits):.3f}, moved without the bias by {moved:.3f}")
    assert moved > 1000 * TOL


def test_log_buckets_equal_transformers() -> None:
    from transformers.models.deberta_v2 import modeling_deberta_v2 as hf

    from wde.components.models.deberta_v2 import relative_positions

    for buckets, max_rel in [(8, 48), (16, 512), (256, 512), (4, 6), (-1, 24)]:
        q = torch.zeros(1, 300, 4)
        ref = hf.build_relative_position(q, q, bucket_size=buckets, max_position=max_rel)[0]
        assert torch.equal(relative_positions(300, buckets, max_rel), ref), (buckets, max_rel)


@pytest.mark.parametrize("setting, message", [
    ({"pos_att_type": ["c2p", "p2p"]}, "pos_att_type \\['p2p'\\] is not implemented"),
    ({"norm_rel_ebd": "layer_norm|rms"}, "norm_rel_ebd \\['rms'\\] is not implemented"),
    ({"conv_kernel_size": 2}, "conv_kernel_size 2 is even"),
    ({"position_buckets": 8, "max_relative_positions": 5}, "position_buckets 8 with max_relative_positions 5"),
])
def test_unsupported_settings_are_refused_by_name(tmp_path: Path, setting: dict, message: str) -> None:
    path = build_deberta(tmp_path / "m", num_labels=1, **{**V3, "num_hidden_layers": 1})
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(setting)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message):
        Engine.from_workflow(None, path, dtype="float32", device="cpu")


def test_a_backend_without_bias_is_refused(models: dict) -> None:
    with pytest.raises((ModelLoadError, WorkflowError), match="attention bias"):
        Engine.from_workflow("deberta_v2_sequence_classification", models["v3"], attention={"name": "cpu_varlen"},
                             device="cpu")


def test_wrong_config_is_refused(tiny_bert: Path) -> None:
    with pytest.raises((ModelLoadError, WorkflowError), match="DebertaV2|deberta-v2"):
        Engine.from_workflow("deberta_v2", tiny_bert, pooler=TOKENS, device="cpu")


def test_triton_kernel_with_per_sequence_bias_matches(tmp_path: Path) -> None:
    """The Triton kernel (interpreted on CPU, so only short texts) reading the per-sequence bias; the texts of
    different lengths are longer than the exact buckets."""
    pytest.importorskip("triton")
    path = build_deberta(tmp_path / "bare", seed=9, **V3)
    texts = ["hello world", "the water was hot and the people of berlin said so", "a",
             "one two three four five six seven eight nine ten eleven twelve"]
    refs = hf_states(path, texts)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with Engine.from_workflow("deberta_v2", path, attention={"name": "triton_varlen"}, pooler=TOKENS,
                              overrides=["runner.params.cpu_streams=1"],  # the interpreter is not thread-safe
                              dtype="float32", device=device) as engine:
        outs = engine.encode(texts)
    assert max(len(r) for r in refs) > 2 * V3["position_buckets"]
    for ref, out in zip(refs, outs):
        assert np.abs(out.outputs["token_embeddings"] - ref).max() <= TOL
