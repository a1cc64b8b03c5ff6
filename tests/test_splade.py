"""SPLADE (BertForMaskedLM + SpladePooling) against sentence-transformers' own `SparseEncoder` on a tiny random
masked LM (fp32 CPU): the non-zero weights (<= 1e-4) and the set of active tokens, for both module layouts
sentence-transformers saves (the legacy MLMTransformer and a fill-mask Transformer), max and sum pooling,
log1p_relu and `max_active_dims`; how the workflow is picked from the folder; and the HTTP routes (TEI
/embed_sparse, /pooling; OpenAI /v1/embeddings and Cohere /v2/embed refusing a sparse-only model)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest
import torch

from tests.ranking import BATCH_TOLERANCE
from tests.test_server import serve
from tests.tiny_models import bert_tokenizer, varied_texts
from wde import Engine, PoolingParams
from wde.errors import RegistryError

TOL = 1e-4
TEXTS = varied_texts(20, seed=11) + ["the water is hot", "berlin " * 50, "x"]
SHORT = ["the water is hot", "berlin paris café", "a b c d e f", "naïve größe 東京"]
CUT = PoolingParams(truncate=True)  # the tiny tokenizer allows 128 tokens, as sentence-transformers truncates


def build_mlm(out: Path, seed: int = 0, **config: object) -> Path:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    tok = bert_tokenizer()
    cfg = BertConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=512, **config)
    model = BertForMaskedLM(cfg).eval()
    with torch.no_grad():  # a non-zero decoder bias, so a dropped bias shows
        model.cls.predictions.bias.normal_(0.0, 0.5)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_sparse_encoder(mlm: Path, out: Path, legacy: bool = True, pooling: str = "max",
                         activation: str = "relu", **kwargs: object) -> Path:
    """A SparseEncoder folder saved by sentence-transformers itself."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling, Transformer

    first = MLMTransformer(str(mlm)) if legacy else Transformer(str(mlm), transformer_task="fill-mask")
    SparseEncoder(modules=[first, SpladePooling(pooling, activation)], device="cpu", **kwargs).save(str(out))
    return out


@pytest.fixture(scope="module")
def mlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mlm(tmp_path_factory.mktemp("mlm"))


@pytest.fixture(scope="module")
def splade(mlm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sparse_encoder(mlm, tmp_path_factory.mktemp("splade") / "st")


def st_sparse(folder: Path, texts: list[str], **kwargs: object) -> list[dict[int, float]]:
    from sentence_transformers import SparseEncoder

    rows = SparseEncoder(str(folder), device="cpu").encode(texts, batch_size=8, convert_to_sparse_tensor=False,
                                                           **kwargs)
    return [{int(i): float(row[i]) for i in torch.nonzero(row).flatten().tolist()} for row in rows]


def compare(got: list[dict], expected: list[dict]) -> tuple[float, int]:
    """(max abs diff over every token id, how many active ids differ); ids active on one side only may differ
    only where the weight is within float noise of zero."""
    worst, differ = 0.0, 0
    for g, e in zip(got, expected):
        for k in g.keys() | e.keys():
            worst = max(worst, abs(g.get(k, 0.0) - e.get(k, 0.0)))
        differ += sum(1 for k in g.keys() ^ e.keys() if max(g.get(k, 0.0), e.get(k, 0.0)) > 1e-5)
    return worst, differ


def test_the_workflow_is_picked_from_the_sparse_encoder_folder(splade: Path) -> None:
    with Engine.from_workflow(None, splade) as engine:
        assert engine.workflow.name == "splade"
        assert engine.supported_outputs == ("sparse",) and engine.dense_size is None


@pytest.mark.parametrize("legacy", [True, False], ids=["MLMTransformer", "fill-mask Transformer"])
def test_sparse_weights_match_sentence_transformers(mlm: Path, tmp_path: Path, legacy: bool) -> None:
    folder = build_sparse_encoder(mlm, tmp_path / "st", legacy=legacy, prompts={"query": "query: "})
    for prompt_name in (None, "query"):
        expected = st_sparse(folder, TEXTS, prompt_name=prompt_name)
        with Engine.from_workflow(None, folder) as engine:
            outs = engine.encode(TEXTS, PoolingParams(prompt_name=prompt_name, truncate=True))
        got = [o.outputs["sparse"] for o in outs]
        assert all(isinstance(k, int) and v > 0 for g in got for k, v in g.items())
        assert all(list(g) == sorted(g) for g in got)
        assert sum(map(len, expected)) > 10 * len(TEXTS)  # a random MLM: many active tokens to compare
        worst, differ = compare(got, expected)
        assert worst <= TOL and differ == 0, (worst, differ)


@pytest.mark.parametrize(("pooling", "activation"), [("sum", "relu"), ("max", "log1p_relu")])
def test_other_pooling_settings(mlm: Path, tmp_path: Path, pooling: str, activation: str) -> None:
    folder = build_sparse_encoder(mlm, tmp_path / "st", pooling=pooling, activation=activation)
    expected = st_sparse(folder, TEXTS)
    with Engine.from_workflow(None, folder) as engine:
        assert engine.components["pooler"].pooling_strategy == pooling
        got = [o.outputs["sparse"] for o in engine.encode(TEXTS, CUT)]
    worst, differ = compare(got, expected)
    assert worst <= TOL and differ == 0, (worst, differ)


def test_max_active_dims_from_the_folder(splade: Path, tmp_path: Path) -> None:
    folder = tmp_path / "top"
    shutil.copytree(splade, folder)
    cfg = json.loads((folder / "config_sentence_transformers.json").read_text())
    (folder / "config_sentence_transformers.json").write_text(json.dumps({**cfg, "max_active_dims": 7}))
    expected = st_sparse(folder, TEXTS[:6])
    with Engine.from_workflow(None, folder) as engine:
        got = [o.outputs["sparse"] for o in engine.encode(TEXTS[:6], CUT)]
    assert all(len(g) == 7 for g in got)
    worst, differ = compare(got, expected)
    assert worst <= TOL and differ == 0, (worst, differ)


def test_a_packed_batch_equals_each_text_alone(splade: Path) -> None:
    with Engine.from_workflow(None, splade) as engine:
        batch = [o.outputs["sparse"] for o in engine.encode(TEXTS[:5], CUT)]
        alone = [engine.encode([t], CUT)[0].outputs["sparse"] for t in TEXTS[:5]]
        tokens = engine.encode(TEXTS[:1])[0].outputs["sparse"]
    worst, differ = compare(batch, alone)
    assert worst <= 1e-5 and differ == 0
    with Engine.from_workflow(None, splade, output_processor={"params": {"sparse_keys": "tokens"}}) as engine:
        by_token = engine.encode(TEXTS[:1])[0].outputs["sparse"]
        assert by_token == dict(zip(engine.tokenizer.convert_ids_to_tokens(list(tokens)), tokens.values()))


def test_a_plain_masked_lm_is_not_picked_without_the_sparse_encoder_config(mlm: Path) -> None:
    with pytest.raises(RegistryError, match=r"BertForMaskedLM.*SparseEncoder.*no sentence-transformers modules.json"
                                            r".*--workflow splade"):
        Engine.from_workflow(None, mlm)
    with Engine.from_workflow("splade", mlm) as engine:  # explicitly: SpladePooling's defaults (max, relu)
        got = [o.outputs["sparse"] for o in engine.encode(TEXTS[:4], CUT)]
    tok_mlm = _reference_max_relu(mlm, TEXTS[:4])
    worst, differ = compare(got, tok_mlm)
    assert worst <= TOL and differ == 0


def _reference_max_relu(folder: Path, texts: list[str]) -> list[dict[int, float]]:
    """SPLADE's formula on transformers' BertForMaskedLM logits, independently of sentence-transformers."""
    from transformers import AutoTokenizer, BertForMaskedLM

    tok = AutoTokenizer.from_pretrained(folder)
    model = BertForMaskedLM.from_pretrained(folder).eval()
    out = []
    with torch.no_grad():
        for t in texts:
            enc = tok(t, return_tensors="pt", truncation=True, max_length=128)
            w = torch.log1p(torch.relu(model(**enc).logits[0])).amax(0)
            out.append({i: float(w[i]) for i in torch.nonzero(w).flatten().tolist()})
    return out


def test_a_sentence_transformer_folder_is_not_splade(mlm: Path, tmp_path: Path) -> None:
    folder = tmp_path / "dense"
    shutil.copytree(mlm, folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    with pytest.raises(RegistryError, match=r"\['Transformer', 'Pooling'\], not a masked-LM Transformer followed by"
                                            r" SpladePooling"):
        Engine.from_workflow(None, folder)


# --- HTTP ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(splade: Path) -> Iterator[tuple[str, Engine]]:
    with Engine.from_workflow(None, splade) as engine, serve(engine, served_model_name="splade") as (url, _):
        yield url, engine


def test_embed_sparse_route(served: tuple[str, Engine], splade: Path) -> None:
    url, _ = served
    texts = SHORT
    expected = st_sparse(splade, texts)
    r = httpx.post(f"{url}/embed_sparse", json={"inputs": texts})
    assert r.status_code == 200, r.text
    rows = r.json()
    assert len(rows) == len(texts)
    got = []
    for row in rows:
        assert all(set(v) == {"index", "value"} and isinstance(v["index"], int) for v in row)
        assert [v["index"] for v in row] == sorted(v["index"] for v in row)
        got.append({v["index"]: v["value"] for v in row})
    worst, differ = compare(got, expected)
    assert worst <= TOL and differ == 0
    # one text alone (a batch of its own): the same weights within the batch tolerance, not bit for bit
    single = httpx.post(f"{url}/embed_sparse", json={"inputs": texts[0]}).json()
    root = httpx.post(url, json={"inputs": texts[0]})  # TEI's root route answers by the model's kind
    assert root.status_code == 200
    for alone in (single, root.json()):
        assert len(alone) == 1 and [v["index"] for v in alone[0]] == sorted(v["index"] for v in alone[0])
        worst, differ = compare([{v["index"]: v["value"] for v in alone[0]}], got[:1])
        assert worst <= BATCH_TOLERANCE and differ == 0, (worst, differ)
    pooled = httpx.post(f"{url}/pooling", json={"input": texts[:2]}).json()["data"]
    worst, differ = compare([{int(k): v for k, v in d["data"].items()} for d in pooled], got[:2])
    assert len(pooled) == 2 and worst <= BATCH_TOLERANCE and differ == 0, (worst, differ)
    card = httpx.get(f"{url}/v1/models").json()["data"][0]
    assert card["outputs"] == ["sparse"] and card["workflow"] == "splade"


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/embeddings", {"input": ["hello"], "model": "splade"}),
    ("/embeddings", {"input": "hello"}),
    ("/v2/embed", {"texts": ["hello"], "model": "splade", "input_type": "search_query", "embedding_types": ["float"]}),
    ("/embed", {"inputs": "hello"}),
])
def test_dense_routes_refuse_a_sparse_only_model(served: tuple[str, Engine], route: str, body: dict) -> None:
    r = httpx.post(f"{served[0]}{route}", json=body)
    assert 400 <= r.status_code < 500, r.text
    text = r.text
    assert "/embed_sparse" in text and "sparse" in text and "'splade'" in text, text


def test_engine_embed_points_at_encode(served: tuple[str, Engine]) -> None:
    with pytest.raises(Exception, match="encode"):
        served[1].embed(["hello"])
    assert isinstance(np.asarray(list(served[1].encode(["hello"])[0].outputs["sparse"].values())), np.ndarray)
