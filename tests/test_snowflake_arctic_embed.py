"""Snowflake arctic-embed workflows: CLS pooling, normalization and query prefixes vs transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.tiny_models import varied_texts
from wde import Engine

TOL = 1e-4


def _hf_cls_normalized(path: Path, texts: list[str]) -> np.ndarray:
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    out = []
    with torch.inference_mode():
        for i in range(0, len(texts), 16):
            enc = tok(texts[i:i + 16], padding=True, truncation=True, return_tensors="pt")
            out.append(F.normalize(model(**enc).last_hidden_state[:, 0], dim=-1))
    return torch.cat(out).numpy()


@pytest.mark.parametrize(("workflow", "fixture", "prefix"), [
    ("snowflake_arctic_embed", "tiny_bert", "Represent this sentence for searching relevant passages: "),
    ("snowflake_arctic_embed_l_v2", "tiny_xlmr", "query: "),
])
def test_queries_and_documents_match_transformers(workflow: str, fixture: str, prefix: str,
                                                  request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    texts = varied_texts(52, seed=31)
    queries, documents = texts[:26], texts[26:]
    expected_q = _hf_cls_normalized(path, [prefix + q for q in queries])
    expected_d = _hf_cls_normalized(path, documents)
    with Engine.from_workflow(workflow, path) as engine:
        got_q = engine.embed(queries, prompt_name="query", truncate=True)
        got_d = engine.embed(documents, truncate=True)
    assert np.abs(got_q - expected_q).max() <= TOL
    assert np.abs(got_d - expected_d).max() <= TOL
    assert np.allclose(np.linalg.norm(got_q, axis=1), 1.0, atol=1e-5)
