"""Token pooling (sentence-transformers' `HierarchicalTokenPooling` as a MultiVectorEncoder folder's last module) in
the multi_vector workflows, against sentence-transformers 6.2 on folders it saves here (fp32 CPU): each token matrix
of `encode_document` / `encode_query` (same rows, <= 1e-4) with integer and fractional pool factors, protected
tokens or none, `normalize_embeddings` on and off (and absent from the saved config, which loads as off), queries
pooled too (`tasks`), the pooling after a Dense without a Normalize before it, a factor that merges every token into
one; queries and documents in one engine step; a request's `normalize`; `pool_tokens` itself against the reference's
per-document function on random vectors; and what is refused, by name."""

from __future__ import annotations

import json
import string
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_multi_vector import (DOCUMENT, QUERY, TOL, assert_one_step, assert_parity, st_model,
                                     tiny_backbone)
from wde import Engine
from wde.components.multi_vector_config import TokenPooling
from wde.components.token_pooling import pool_tokens
from wde.errors import ModelLoadError

TEXTS = ["what is the capital of france?", "hi", "Paris is the capital of France. It has, many museums!",
         "berlin, bonn; and hamburg? " * 6, "a b c d e f g h i j k l m n o p q r s t", "naïve café: größe, 東京!"]


@pytest.fixture(scope="module")
def backbone(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> Path:
    return tiny_backbone(minilm_path, tmp_path_factory.mktemp("pooling-backbone"))


def build(backbone: Path, out: Path, *, normalize_before: bool = True, **pooling: object) -> Path:
    """A MultiVectorEncoder folder saved by sentence-transformers: Transformer (fixed 12-token query expansion),
    a per-token Dense, MultiVectorMask (punctuation), a per-token Normalize (unless not `normalize_before`), then
    HierarchicalTokenPooling(**pooling)."""
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.multi_vector_encoder.modules import HierarchicalTokenPooling, MultiVectorMask

    torch.manual_seed(1)
    transformer = Transformer(str(backbone), query_expansion={"strategy": "fixed", "length": 12})
    modules = [transformer, Dense(transformer.get_embedding_dimension(), 16, bias=False,
                                  module_input_name="token_embeddings"),
               MultiVectorMask(list(string.punctuation))]
    if normalize_before:
        modules.append(Normalize(module_input_name="token_embeddings"))
    modules.append(HierarchicalTokenPooling(**pooling))
    MultiVectorEncoder(modules=modules, prompts={"query": "[Q] ", "document": "[D] "}, device="cpu").save(str(out))
    return out


def _pooling_config(folder: Path) -> Path:
    modules = json.loads((folder / "modules.json").read_text())
    return folder / modules[-1]["path"] / "config.json"


VARIANTS = {
    "factor-2": dict(pool_factor=2),
    "factor-1.5-unprotected": dict(pool_factor=1.5, num_protected_tokens=0),
    "factor-3-two-protected-unnormalized": dict(pool_factor=3, num_protected_tokens=2, normalize_embeddings=False),
    "queries-too": dict(pool_factor=2, tasks=["query", "document"]),
    "factor-1-normalizes-only": dict(pool_factor=1),
    "all-into-one": dict(pool_factor=1000),
    "no-normalize-before": dict(pool_factor=2, normalize_before=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_sentence_transformers(variant: str, backbone: Path, tmp_path: Path) -> None:
    folder = build(backbone, tmp_path / variant, **VARIANTS[variant])
    st = st_model(folder)
    assert type(list(st)[-1]).__name__ == "HierarchicalTokenPooling"
    with Engine.from_workflow(None, folder) as engine:
        assert engine.workflow.name == "multi_vector"
        assert_parity(engine, st, TEXTS)
        assert_one_step(engine, st, TEXTS)
        if VARIANTS[variant].get("pool_factor", 1) >= 2:  # the documents really were pooled
            long, = engine.encode([TEXTS[3]], DOCUMENT)
            assert long.outputs["colbert"].shape[0] <= len(long.prompt_token_ids) // 2


def test_saved_config_without_normalize_embeddings_loads_it_off(backbone: Path, tmp_path: Path) -> None:
    """A config saved before `normalize_embeddings` existed loads with it off (sentence-transformers' load_config):
    the cluster means are not unit vectors."""
    folder = build(backbone, tmp_path / "old", pool_factor=2)
    config = _pooling_config(folder)
    saved = json.loads(config.read_text())
    assert saved.pop("normalize_embeddings") is True
    config.write_text(json.dumps(saved))
    st = st_model(folder)
    with Engine.from_workflow(None, folder) as engine:
        assert_parity(engine, st, TEXTS)
        norms = np.linalg.norm(engine.encode([TEXTS[3]], DOCUMENT)[0].outputs["colbert"], axis=1)
        assert norms.min() < 0.99


def test_request_normalize_decides_the_last_normalization(backbone: Path, tmp_path: Path) -> None:
    """normalize=false on a pooled document gives the cluster means of the unit vectors (the pooling's own
    normalization skipped); on a query (not pooled) the vectors before the last Normalize."""
    folder = build(backbone, tmp_path / "norm", pool_factor=2)
    st = st_model(folder)
    pooling = list(st)[-1]
    pooling.normalize_embeddings = False
    want_documents = st.encode_document(TEXTS)
    unnormalized = type(st)(modules=list(st)[:-2], prompts=st.prompts, device="cpu")
    want_queries = unnormalized.encode_query(TEXTS)
    with Engine.from_workflow(None, folder) as engine:
        for params, expected in ((replace(DOCUMENT, normalize=False), want_documents),
                                 (replace(QUERY, normalize=False), want_queries)):
            for out, want in zip(engine.encode(TEXTS, params), expected):
                got = out.outputs["colbert"]
                assert got.shape == tuple(want.shape) and np.abs(got - want.numpy()).max() <= TOL


@pytest.mark.parametrize("budget", [1 << 24, 2000])
def test_pool_tokens_matches_the_reference_function(budget: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`pool_tokens` on a batch of random unit vectors (sequences shorter than the protected tokens, of one token,
    long ones; some not pooled) against `_hierarchical_pool_one` applied to each pooled sequence; the distances in
    one batched product, or (a small budget) in several."""
    from sentence_transformers.multi_vector_encoder.modules.token_pooling import _hierarchical_pool_one

    from wde.components import token_pooling

    monkeypatch.setattr(token_pooling, "DISTANCE_BUDGET", budget)

    torch.manual_seed(3)
    sizes = [0, 1, 2, 5, 40, 17, 3, 64, 9]
    pooled = [True, True, True, True, True, False, True, True, False]
    x = torch.nn.functional.normalize(torch.randn(sum(sizes), 8), dim=-1)
    for factor, protected in ((2.0, 1), (1.5, 0), (4.0, 3)):
        pooling = TokenPooling(factor, protected, False, ("document",))
        got, counts = pool_tokens(x, torch.tensor(sizes), pooled, pooling)
        pieces, start = [], 0
        for size, pool in zip(sizes, pooled):
            seq = x[start:start + size]
            pieces.append(_hierarchical_pool_one(seq, factor, protected, False) if pool and size else seq)
            start += size
        assert counts.tolist() == [p.shape[0] for p in pieces]
        assert torch.allclose(got, torch.cat(pieces), atol=1e-6, rtol=0)


def _edit_pooling(folder: Path, **changes: object) -> None:
    config = _pooling_config(folder)
    config.write_text(json.dumps({**json.loads(config.read_text()), **changes}))


def _move_pooling_first(folder: Path) -> None:
    modules = json.loads((folder / "modules.json").read_text())
    modules.insert(1, modules.pop())
    (folder / "modules.json").write_text(json.dumps([{**m, "idx": i} for i, m in enumerate(modules)]))


REFUSALS = {
    "unknown-setting": (lambda f: _edit_pooling(f, clustering="kmeans"),
                        "HierarchicalTokenPooling settings \\['clustering'\\] are not implemented"),
    "factor-below-one": (lambda f: _edit_pooling(f, pool_factor=0.5), "pool_factor must be a number >= 1"),
    "negative-protected": (lambda f: _edit_pooling(f, num_protected_tokens=-1),
                           "num_protected_tokens must be an integer >= 0"),
    "unknown-task": (lambda f: _edit_pooling(f, tasks=["image"]), "tasks \\['image'\\] are not implemented"),
    "not-last": (_move_pooling_first, "HierarchicalTokenPooling as the last module only"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_by_name(case: str, backbone: Path, tmp_path: Path) -> None:
    folder = build(backbone, tmp_path / case, pool_factor=2)
    change, message = REFUSALS[case]
    change(folder)
    with pytest.raises(ModelLoadError, match=message):
        Engine.from_workflow(None, folder)


def test_plain_requests_unchanged_by_the_module(backbone: Path, tmp_path: Path) -> None:
    """A query (not in `tasks`) gets the same vectors as from the folder without the pooling module."""
    pooled = build(backbone, tmp_path / "pooled", pool_factor=2)
    plain_st = type(st := st_model(pooled))(modules=list(st)[:-1], prompts=st.prompts, device="cpu")
    with Engine.from_workflow(None, pooled) as engine:
        for out, want in zip(engine.encode(TEXTS, QUERY), plain_st.encode_query(TEXTS)):
            assert out.outputs["colbert"].shape == tuple(want.shape)
            assert np.abs(out.outputs["colbert"] - want.numpy()).max() <= TOL
