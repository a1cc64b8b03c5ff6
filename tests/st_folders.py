"""Model folders saved by sentence-transformers itself, built from the bundled all-MiniLM-L6-v2's Transformer."""

from __future__ import annotations

from pathlib import Path

import torch


def minilm_pipeline(minilm_path: Path, out: Path, pooling: str, dense: int, seed: int = 0) -> Path:
    """MiniLM's Transformer, then Pooling(`pooling`), a random Dense 384 -> `dense` (tanh) and Normalize, saved by
    sentence-transformers into `out`."""
    from sentence_transformers import SentenceTransformer

    try:
        from sentence_transformers.sentence_transformer import modules as models  # sentence-transformers >= 6
    except ImportError:
        from sentence_transformers import models
    torch.manual_seed(seed)
    transformer = SentenceTransformer(str(minilm_path), device="cpu")[0]
    model = SentenceTransformer(modules=[transformer, models.Pooling(384, pooling), models.Dense(384, dense),
                                         models.Normalize()], device="cpu")
    model.save(str(out))
    return out
