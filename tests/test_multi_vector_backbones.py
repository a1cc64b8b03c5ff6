"""Late interaction on the other backbones WDE serves (issue 35): sentence-transformers 6 `MultiVectorEncoder` folders
on XLM-RoBERTa (jina-colbert-v2 style) and ModernBERT (GTE-ModernColBERT style, with its local attention layers)
give `encode_query` / `encode_document`'s token vectors (also with queries and documents in one engine step), each
through a workflow picked from the folder; the same backbones without a MultiVectorEncoder folder keep their dense
workflows."""

from __future__ import annotations

import string
from pathlib import Path

import pytest

from tests import test_modernbert, tiny_models
from tests.test_multi_vector import assert_one_step, assert_parity, build, st_model
from wde import Engine
from wde.engine import resolve

TEXTS = ["what is the capital of france?", "Paris is the capital of France. It has, many museums!",
         "berlin, bonn; and hamburg? " * 8, "naïve café: größe"]
COLBERT = dict(prompts={"query": "[Q] ", "document": "[D] "}, expansion={"strategy": "fixed", "length": 12},
               document_length=48, skiplist=list(string.punctuation))


@pytest.mark.parametrize("backbone, workflow, dense", [
    ("xlm_roberta", "multi_vector_xlm_roberta", "xlm_roberta"),
    ("modernbert", "multi_vector_modernbert", "modernbert"),
])
def test_backbone_matches_sentence_transformers(backbone: str, workflow: str, dense: str, tmp_path: Path) -> None:
    if backbone == "xlm_roberta":
        base = tiny_models.build_xlmr(tmp_path / "base")
    else:  # a window smaller than the texts, so local layers and the expansion key mask meet
        base = test_modernbert.build(tmp_path / "base", local_attention=8)
    folder = build(base, tmp_path / "colbert", **COLBERT)
    assert resolve(None, folder)[0].name == workflow
    assert resolve(None, base)[0].name == dense
    with Engine.from_workflow(None, folder) as engine:
        assert engine.workflow.name == workflow
        st = st_model(folder)
        assert_parity(engine, st, TEXTS)
        assert_one_step(engine, st, TEXTS)
