"""MPNet (`mpnet` workflow): hidden states equal transformers' MPNetModel and embeddings equal
sentence-transformers (mean + Normalize, as all-mpnet-base-v2) on a tiny random model, with the relative position
bias scaled up so it shapes the result, on inputs from one token to well past the bias' 128-token max distance;
the public bucket function equals transformers' (T5 and MPNet)."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tiny_models import WORDS, corpus, varied_texts
from wde import Engine
from wde.errors import ModelLoadError, WorkflowError

TOL = 1e-4
SDPA = {"name": "torch_sdpa"}
TOKENS = {"name": "sentence", "params": {"pooling": "all", "normalize": False}}


def _long_text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


TEXTS = varied_texts(14, seed=21) + [_long_text(300, 1), _long_text(140, 2), "x", "Hello, World!! 42 ünïcödé"]
"""1 to ~310 tokens: exact buckets (< 8), logarithmic ones, and distances past max_distance 128."""


def mpnet_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import MPNetTokenizerFast

    tk = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.train_from_iterator(corpus(), trainers.WordPieceTrainer(
        vocab_size=500, special_tokens=["<s>", "<pad>", "</s>", "[UNK]", "<mask>"]))
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    tk.decoder = decoders.WordPiece()
    return MPNetTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                              cls_token="<s>", unk_token="[UNK]", pad_token="<pad>", mask_token="<mask>",
                              model_max_length=512)


def build_mpnet(out: Path, seed: int = 0, bias_gain: float = 50.0, **config) -> Path:
    """A tiny MPNetModel (hidden 64, 2 layers) whose relative bias table is scaled by `bias_gain` (to about the
    unit scale of a trained one: initialised at std 0.02 it would hardly show)."""
    from transformers import MPNetConfig, MPNetModel

    torch.manual_seed(seed)
    tok = mpnet_tokenizer()
    cfg = MPNetConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=128, max_position_embeddings=514, **config)
    model = MPNetModel(cfg).eval()
    with torch.no_grad():
        model.encoder.relative_attention_bias.weight.mul_(bias_gain)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_st(model: Path, out: Path) -> Path:
    """all-mpnet-base-v2's pipeline (Transformer, mean Pooling, Normalize), saved by sentence-transformers."""
    from sentence_transformers import SentenceTransformer

    try:  # sentence-transformers >= 6 moved the module classes
        from sentence_transformers.sentence_transformer import modules as st_models
    except ImportError:
        from sentence_transformers import models as st_models

    transformer = st_models.Transformer(str(model))
    st = SentenceTransformer(modules=[transformer, st_models.Pooling(64, "mean"), st_models.Normalize()],
                             device="cpu")
    st.save(str(out))
    return out


@pytest.fixture(scope="module")
def mpnet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mpnet(tmp_path_factory.mktemp("mpnet"))


@pytest.fixture(scope="module")
def mpnet_st(mpnet: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_st(mpnet, tmp_path_factory.mktemp("mpnet-st") / "model")


@functools.lru_cache(maxsize=None)
def _hf(path: str):
    from transformers import AutoModel, AutoTokenizer

    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()


def hf_states(path: Path, text: str) -> np.ndarray:
    tok, model = _hf(str(path))
    with torch.no_grad():
        return model(**tok(text, return_tensors="pt")).last_hidden_state[0].numpy()


def st_reference(folder: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(texts, batch_size=8, convert_to_numpy=True)


def test_bucket_function_equals_transformers() -> None:
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder
    from transformers.models.t5.modeling_t5 import T5Attention

    from wde.api import relative_position_bucket, relative_position_buckets

    relative = torch.arange(-1500, 1500)
    for num_buckets, max_distance in [(32, 128), (16, 20), (64, 256), (8, 16)]:
        for bidirectional in (True, False):
            ours = relative_position_bucket(relative, num_buckets, max_distance, bidirectional)
            theirs = T5Attention._relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
            assert torch.equal(ours, theirs), (num_buckets, max_distance, bidirectional)
    pos = torch.arange(600)
    assert torch.equal(relative_position_buckets(600, 32, 128),
                       MPNetEncoder.relative_position_bucket(pos[None, :] - pos[:, None]))
    assert torch.equal(relative_position_buckets(600, 32, 128)[:50, :50], relative_position_buckets(50, 32, 128))


def test_hidden_states_match_transformers(mpnet: Path) -> None:
    """Packed batches of every length, with `auto` (which must keep these biased batches off cpu_varlen) and
    with torch_sdpa."""
    from wde.components.attention.cpu_varlen import prefer_varlen

    refs = [hf_states(mpnet, t) for t in TEXTS]
    assert max(len(r) for r in refs) > 300 and min(len(r) for r in refs) == 3
    assert prefer_varlen([len(r) for r in refs])  # an unbiased batch like this one would go to cpu_varlen
    worst = {}
    for attention in ({"name": "auto"}, SDPA):
        with Engine.from_workflow("mpnet", mpnet, attention=attention, pooler=TOKENS, dtype="float32",
                                  device="cpu", runner={"params": {"cpu_streams": 1}}) as engine:
            backend, routed = engine.components["attention"], []
            build = backend.build_metadata

            def spy(*args: object, **kwargs: object) -> object:
                meta = build(*args, **kwargs)
                routed.append(meta.extra[0].name if attention["name"] == "auto" else backend.name)
                return meta

            backend.build_metadata = spy
            outs = engine.encode(TEXTS)
        assert routed and set(routed) == {"torch_sdpa"}
        worst[attention["name"]] = max(float(np.abs(o.outputs["token_embeddings"] - r).max())
                                       for o, r in zip(outs, refs))
        for o, r in zip(outs, refs):
            assert o.outputs["token_embeddings"].shape == r.shape
    assert max(worst.values()) <= TOL, worst


def test_matches_sentence_transformers(mpnet_st: Path) -> None:
    with Engine.from_workflow(None, mpnet_st, dtype="float32", device="cpu") as engine:
        assert engine.workflow.name == "mpnet"  # picked by the MPNetModel architecture
        pooler = engine.components["pooler"]
        assert (pooler.mode, pooler.normalize) == ("mean", True)  # from the sentence-transformers config
        got = engine.embed(TEXTS)
    ref = st_reference(mpnet_st, TEXTS)
    assert got.shape == ref.shape == (len(TEXTS), 64)
    diff = float(np.abs(got - ref).max())
    assert diff <= TOL, f"max abs diff {diff:.2e}"


def test_alone_equals_inside_a_batch(mpnet_st: Path) -> None:
    with Engine.from_workflow("mpnet", mpnet_st, dtype="float32", device="cpu") as engine:
        batched = engine.embed(TEXTS)
        alone = np.stack([engine.embed(t) for t in TEXTS])
    assert np.abs(alone - batched).max() <= 1e-5


def test_the_relative_bias_is_what_makes_parity(mpnet_st: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from wde.components.models.mpnet import MPNetModel

    texts = TEXTS[:6]
    monkeypatch.setattr(MPNetModel, "attention_bias", lambda self, batch: torch.zeros(
        self.config.num_attention_heads, batch.max_seqlen, batch.max_seqlen))
    with Engine.from_workflow("mpnet", mpnet_st, attention=SDPA, dtype="float32", device="cpu") as engine:
        unbiased = engine.embed(texts)
    assert np.abs(unbiased - st_reference(mpnet_st, texts)).max() > 1e-3


def test_backend_without_bias_and_short_bias_table_are_refused(mpnet: Path, tmp_path: Path) -> None:
    with pytest.raises(WorkflowError, match="attention 'cpu_varlen' does not support"):  # wde validate's check
        Engine.from_workflow("mpnet", mpnet, attention={"name": "cpu_varlen"}, device="cpu")
    short = build_mpnet(tmp_path / "short", relative_attention_num_buckets=16)
    with pytest.raises(ModelLoadError, match="relative_attention_num_buckets is 16"):
        Engine.from_workflow("mpnet", short, pooler=TOKENS, device="cpu")


def test_triton_kernel_with_bias_matches(mpnet: Path) -> None:
    """The Triton kernel (interpreted on CPU, so only short texts) with the same bias."""
    pytest.importorskip("triton")
    texts = ["hello world", "the water was hot", "a"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with Engine.from_workflow("mpnet", mpnet, attention={"name": "triton_varlen"}, pooler=TOKENS, dtype="float32",
                              device=device) as engine:
        outs = engine.encode(texts)
    for text, out in zip(texts, outs):
        assert np.abs(out.outputs["token_embeddings"] - hf_states(mpnet, text)).max() <= TOL
