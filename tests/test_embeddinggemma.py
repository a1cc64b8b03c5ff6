"""EmbeddingGemma (bidirectional Gemma 3) against transformers' `Gemma3TextModel` and sentence-transformers on a tiny
random config (fp32 CPU, <= 1e-4): sliding and full attention layers with a `sliding_window` shorter than the
inputs, per-kind RoPE bases, through every CPU attention backend; the sentence-transformers folder EmbeddingGemma
ships (Transformer → Pooling(mean) → Dense → Dense → Normalize, with prompts); the window transformers' own mask
builds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tiny_models import corpus, varied_texts
from wde import Engine
from wde.api import window_keys

TOL = 1e-4
SLIDING_WINDOW = 16  # as written in config.json: every token sees 8 tokens each side in the sliding layers
CONFIG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, max_position_embeddings=512,
              layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
              use_bidirectional_attention=True, pad_token_id=0, eos_token_id=1, bos_token_id=2)
TEXTS = varied_texts(16, seed=7) + ["the water " * 40, "berlin paris " * 30, "x"]
PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: "}


def gemma_tokenizer():
    """A small BPE with Gemma's special tokens and ids (<pad> 0, <eos> 1, <bos> 2, <unk> 3), wrapped in
    `GemmaTokenizerFast`; like EmbeddingGemma's, it adds <bos> and <eos> and pads on the right."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import GemmaTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tk.normalizer = normalizers.Replace(" ", "▁")
    tk.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tk.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=320,
                                                         special_tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]))
    bpe = json.loads(tk.to_str())["model"]
    return GemmaTokenizerFast(vocab=bpe["vocab"], merges=[tuple(m) for m in bpe["merges"]], add_bos_token=True,
                              add_eos_token=True, padding_side="right", model_max_length=512)


def build(out: Path, seed: int = 0, **extra: object) -> Path:
    """A random tiny Gemma3TextModel saved with the config.json keys EmbeddingGemma's has (`rope_theta`,
    `rope_local_base_freq`, the unhalved `sliding_window`), random norm weights so a missing `1 +` shows."""
    import transformers

    torch.manual_seed(seed)
    tok = gemma_tokenizer()
    cfg = transformers.Gemma3TextConfig(vocab_size=len(tok), sliding_window=SLIDING_WINDOW, rope_theta=10000.0,
                                        rope_local_base_freq=100.0, **{**CONFIG, **extra})
    model = transformers.Gemma3TextModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    raw = json.loads((out / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw.update(rope_theta=rope["full_attention"]["rope_theta"], rope_scaling=None, architectures=["Gemma3TextModel"],
               rope_local_base_freq=rope["sliding_attention"]["rope_theta"])
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("gemma"))


def hf_states(folder: Path, texts: list[str]) -> list[np.ndarray]:
    from transformers import AutoTokenizer, Gemma3TextModel

    tok = AutoTokenizer.from_pretrained(folder)
    model = Gemma3TextModel.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return [model(**tok(t, return_tensors="pt")).last_hidden_state[0].numpy() for t in texts]


def test_the_tiny_config_is_embeddinggemmas_shape(gemma: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(gemma)
    assert cfg.use_bidirectional_attention and cfg.sliding_window == SLIDING_WINDOW // 2 + 1  # halved on load
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 100.0
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == 10000.0
    ids = AutoTokenizer.from_pretrained(gemma)("the water")["input_ids"]
    assert ids[0] == 2 and ids[-1] == 1  # <bos> ... <eos>
    with Engine.from_workflow(None, gemma, overrides=["pooler.params.pooling=all"]) as engine:
        assert engine.workflow.name == "embeddinggemma"
        model = engine.components["model"]
        assert model.causal is False
        assert [layer.attention_window for layer in model.layers] == [(8, 8), (8, 8), None, (8, 8)]
        assert {k: r.theta for k, r in model.rotary.items()} == {"sliding_attention": 100.0, "full_attention": 10000.0}
        lens = [len(ids) for ids in engine.tokenizer.hf_tokenizer(TEXTS)["input_ids"]]
    assert max(lens) > 4 * SLIDING_WINDOW


def test_the_window_is_the_one_transformers_masks(gemma: Path) -> None:
    """transformers' bidirectional sliding mask for an encoder (the overlay Gemma3TextModel passes) keeps exactly
    the keys of WDE's (left, right) window."""
    from transformers import AutoConfig
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.gemma3.modeling_gemma3 import _bidirectional_window_overlay

    from wde.components.models.gemma3 import gemma3_window

    cfg = AutoConfig.from_pretrained(gemma)
    cfg._attn_implementation = "eager"
    n = 40
    mask = create_sliding_window_causal_mask(
        config=cfg, inputs_embeds=torch.zeros(1, n, 64), attention_mask=torch.ones(1, n, dtype=torch.long),
        past_key_values=None, position_ids=torch.arange(n)[None],
        or_mask_function=_bidirectional_window_overlay(cfg.sliding_window))
    keep = mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] == 0
    window = gemma3_window(cfg)
    assert window == (SLIDING_WINDOW // 2, SLIDING_WINDOW // 2)
    assert torch.equal(keep, window_keys(n, window, causal=False))


@pytest.mark.parametrize("attention", ["auto", "torch_sdpa", "cpu_varlen"])
def test_hidden_states_match_transformers(gemma: Path, attention: str) -> None:
    expected = hf_states(gemma, TEXTS)
    with Engine.from_workflow(None, gemma, overrides=["pooler.params.pooling=all", "pooler.params.normalize=false",
                                                      f"attention.name={attention}"]) as engine:
        outs = engine.encode(TEXTS)
    worst = 0.0
    for out, ref in zip(outs, expected):
        got = out.outputs["token_embeddings"]
        assert got.shape == ref.shape
        worst = max(worst, float(np.abs(got - ref).max()))
    assert worst <= TOL, f"{attention}: max abs diff {worst:.2e}"


def test_the_window_matters(gemma: Path) -> None:
    """Guard against a test that cannot fail: with the sliding layers' windows dropped, the states differ."""
    expected = hf_states(gemma, TEXTS[-3:-1])
    with Engine.from_workflow(None, gemma, overrides=["pooler.params.pooling=all"]) as engine:
        for layer in engine.components["model"].layers:
            layer.attention_window = None
        outs = engine.encode(TEXTS[-3:-1])
    assert max(np.abs(o.outputs["token_embeddings"] - ref).max() for o, ref in zip(outs, expected)) > 1e-3


def test_sentence_transformers_folder_with_dense_modules_and_prompts(gemma: Path, tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    st_dir = tmp_path / "embeddinggemma"
    torch.manual_seed(1)
    st = SentenceTransformer(modules=[
        Transformer(str(gemma), max_seq_length=256), Pooling(64, "mean"),
        Dense(64, 96, bias=False, activation_function=torch.nn.Identity()),
        Dense(96, 48, bias=False, activation_function=torch.nn.Identity()), Normalize()],
        device="cpu", prompts=PROMPTS)
    st.save(str(st_dir))
    reference = SentenceTransformer(str(st_dir), device="cpu")
    with Engine.from_workflow(None, st_dir) as engine:
        assert engine.workflow.name == "embeddinggemma" and engine.dense_size == 48
        for prompt_name in ("query", "document", None):
            expected = reference.encode(TEXTS, prompt_name=prompt_name, batch_size=8)
            got = engine.embed(TEXTS, prompt_name=prompt_name)
            assert got.shape == expected.shape == (len(TEXTS), 48)
            diff = float(np.abs(got - expected).max())
            assert diff <= TOL, f"prompt {prompt_name}: max abs diff {diff:.2e}"
        alone = engine.embed(TEXTS[-3], prompt_name="query")
        assert np.abs(alone - engine.embed(TEXTS, prompt_name="query")[-3]).max() <= 1e-5
        # matryoshka: the first N features, re-normalized (what the card does with 512/256/128)
        short = engine.embed(TEXTS[:4], prompt_name="query", dimensions=16)
        full = reference.encode(TEXTS[:4], prompt_name="query")[:, :16]
        assert np.abs(short - full / np.linalg.norm(full, axis=1, keepdims=True)).max() <= TOL


def test_causal_gemma3_config_gets_a_causal_mask(tmp_path: Path) -> None:
    folder = build(tmp_path / "causal", seed=2, use_bidirectional_attention=False)
    texts = TEXTS[-4:-1]
    expected = hf_states(folder, texts)
    with Engine.from_workflow("embeddinggemma", folder, overrides=["pooler.params.pooling=all"]) as engine:
        assert engine.components["model"].causal is True
        assert engine.components["model"].layers[0].attention_window == (SLIDING_WINDOW - 1, SLIDING_WINDOW - 1)
        outs = engine.encode(texts)
    assert max(np.abs(o.outputs["token_embeddings"] - ref).max() for o, ref in zip(outs, expected)) <= TOL


def test_logit_softcapping_is_refused_by_name(gemma: Path, tmp_path: Path) -> None:
    import shutil

    from wde.errors import ModelLoadError

    folder = tmp_path / "softcap"
    shutil.copytree(gemma, folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "attn_logit_softcapping": 50.0}))
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping"):
        Engine.from_workflow(None, folder, overrides=["pooler.params.pooling=all"])
