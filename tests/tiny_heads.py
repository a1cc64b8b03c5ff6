"""Builders for models with task heads: classifiers / cross-encoders and bge-m3 (no weights are committed).

Heads are random; the encoders are either the real MiniLM or tiny random ones from `tests.tiny_models`.
"""

from __future__ import annotations

from pathlib import Path

from tests import tiny_models


def build_minilm_classifier(minilm: Path, out: Path, num_labels: int, seed: int = 0, **config) -> Path:
    """The real all-MiniLM-L6-v2 encoder under a random BertForSequenceClassification head."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(minilm, num_labels=num_labels, **config)
    model.eval().save_pretrained(out)
    AutoTokenizer.from_pretrained(minilm).save_pretrained(out)
    return out


def build_xlmr_classifier(out: Path, num_labels: int = 1, seed: int = 0, **config) -> Path:
    """A tiny random XLMRobertaForSequenceClassification (bge-reranker-v2-m3's shape when num_labels=1)."""
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    torch.manual_seed(seed)
    tok = tiny_models.xlmr_tokenizer()
    cfg = XLMRobertaConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, max_position_embeddings=514, pad_token_id=1, bos_token_id=0,
                           eos_token_id=2, num_labels=num_labels, **config)
    XLMRobertaForSequenceClassification(cfg).eval().save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_bge_m3(out: Path, tokenizer=None, seed: int = 0, colbert_dim: int | None = None) -> Path:
    """A tiny XLM-R plus bge-m3's side heads, saved as bare state dicts as BAAI/bge-m3 ships them:
    sparse_linear.pt = Linear(H, 1), colbert_linear.pt = Linear(H, colbert_dim or H)."""
    import torch

    tiny_models.build_xlmr(out, seed=seed, tokenizer=tokenizer, hidden_size=32, intermediate_size=64)
    torch.manual_seed(seed + 1)
    hidden = 32
    torch.save(torch.nn.Linear(hidden, 1).state_dict(), out / "sparse_linear.pt")
    torch.save(torch.nn.Linear(hidden, colbert_dim or hidden).state_dict(), out / "colbert_linear.pt")
    return out
