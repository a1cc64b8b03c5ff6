"""bge-m3: dense, sparse and ColBERT outputs vs FlagEmbedding's math re-implemented on transformers' XLM-R."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests import tiny_heads, tiny_models
from tests.tiny_models import varied_texts
from wde import Engine
from wde.errors import ModelLoadError, RequestError
from wde.request import PoolingParams

TOL = 1e-4
ALL = ("dense", "sparse", "colbert")


@pytest.fixture(scope="module")
def m3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = tiny_models.real_xlmr_tokenizer() or tiny_models.xlmr_tokenizer()
    return tiny_heads.build_bge_m3(tmp_path_factory.mktemp("bge-m3"), tokenizer=tok)


@pytest.fixture(scope="module")
def m3_engine(m3_path: Path):
    with Engine.from_workflow("bge_m3", m3_path) as engine:
        yield engine


def _linear(path: Path) -> torch.nn.Linear:
    state = torch.load(path, weights_only=True)
    linear = torch.nn.Linear(state["weight"].shape[1], state["weight"].shape[0])
    linear.load_state_dict(state)
    return linear


class FlagEmbeddingReference:
    """BGEM3FlagModel.encode's math: padded batches, CLS dense, relu'd token weights, masked ColBERT rows."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer, XLMRobertaModel

        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = XLMRobertaModel.from_pretrained(path, add_pooling_layer=False).eval()
        self.sparse_linear = _linear(path / "sparse_linear.pt")
        self.colbert_linear = _linear(path / "colbert_linear.pt")
        named = self.tok.special_tokens_map
        roles = ("cls_token", "eos_token", "pad_token", "unk_token")
        self.unused = {self.tok.convert_tokens_to_ids(named[r]) for r in roles}

    @torch.inference_mode()
    def encode(self, texts: list[str], normalize: bool = True) -> list[dict]:
        results = []
        for i in range(0, len(texts), 16):
            enc = self.tok(texts[i:i + 16], padding=True, truncation=True, return_tensors="pt")
            h = self.model(**enc).last_hidden_state
            dense = h[:, 0]
            weights = torch.relu(self.sparse_linear(h)).squeeze(-1)
            colbert = self.colbert_linear(h[:, 1:]) * enc["attention_mask"][:, 1:, None].float()
            if normalize:
                dense, colbert = F.normalize(dense, dim=-1), F.normalize(colbert, dim=-1)
            for j, ids in enumerate(enc["input_ids"].tolist()):
                lexical: dict[int, float] = defaultdict(float)
                for w, tid in zip(weights[j].tolist(), ids):
                    if tid not in self.unused and w > 0 and w > lexical[tid]:
                        lexical[tid] = w
                n = int(enc["attention_mask"][j].sum())
                results.append({"dense": dense[j].numpy(), "sparse": dict(lexical),
                                "colbert": colbert[j, :n - 1].numpy()})
        return results


@pytest.fixture(scope="module")
def reference(m3_path: Path) -> FlagEmbeddingReference:
    return FlagEmbeddingReference(m3_path)


def _sparse_diff(a: dict, b: dict) -> float:
    return max((abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in a.keys() | b.keys()), default=0.0)


def test_all_three_outputs_match_flag_embedding(reference: FlagEmbeddingReference, m3_engine: Engine) -> None:
    texts = varied_texts(60, seed=21)
    expected = reference.encode(texts)
    outs = m3_engine.encode(texts, PoolingParams(outputs=ALL))
    assert m3_engine.supported_outputs == ALL
    worst = {"dense": 0.0, "sparse": 0.0, "colbert": 0.0}
    for out, ref in zip(outs, expected):
        assert set(out.outputs) == set(ALL)
        assert out.outputs["colbert"].shape == ref["colbert"].shape
        worst["dense"] = max(worst["dense"], float(np.abs(out.outputs["dense"] - ref["dense"]).max()))
        worst["colbert"] = max(worst["colbert"], float(np.abs(out.outputs["colbert"] - ref["colbert"]).max()))
        worst["sparse"] = max(worst["sparse"], _sparse_diff(out.outputs["sparse"], ref["sparse"]))
        assert all(isinstance(k, int) for k in out.outputs["sparse"])
    assert max(worst.values()) <= TOL, worst


def test_unrequested_heads_are_not_run(m3_engine: Engine) -> None:
    pooler = m3_engine.components["pooler"]
    with mock.patch.object(pooler.sparse_linear, "forward", wraps=pooler.sparse_linear.forward) as sparse, \
            mock.patch.object(pooler.colbert_linear, "forward", wraps=pooler.colbert_linear.forward) as colbert:
        (out,) = m3_engine.encode(["dense only please"])
        assert set(out.outputs) == {"dense"}
        assert sparse.call_count == 0 and colbert.call_count == 0
        (out,) = m3_engine.encode(["lexical weights"], PoolingParams(outputs=("sparse",)))
        assert set(out.outputs) == {"sparse"}
        assert sparse.call_count == 1 and colbert.call_count == 0
        (out,) = m3_engine.encode(["multi vector"], PoolingParams(outputs=("colbert",)))
        assert set(out.outputs) == {"colbert"}
        assert sparse.call_count == 1 and colbert.call_count == 1


def test_mixed_batch_respects_each_requests_outputs_and_normalize(reference: FlagEmbeddingReference,
                                                                  m3_engine: Engine) -> None:
    texts = ["the first text is here", "a second one, somewhat longer than the first"]
    raw = reference.encode(texts, normalize=False)
    m3_engine.add_request(texts[0], PoolingParams(outputs=("dense",)), request_id="a")
    m3_engine.add_request(texts[1], PoolingParams(outputs=("colbert", "dense"), normalize=False), request_id="b")
    done = {}
    while m3_engine.has_unfinished():
        done.update({o.request_id: o for o in m3_engine.step()})
    assert set(done["a"].outputs) == {"dense"}
    assert np.abs(done["a"].outputs["dense"] - raw[0]["dense"] / np.linalg.norm(raw[0]["dense"])).max() <= TOL
    assert set(done["b"].outputs) == {"colbert", "dense"}
    assert np.abs(done["b"].outputs["colbert"] - raw[1]["colbert"]).max() <= TOL
    assert np.abs(done["b"].outputs["dense"] - raw[1]["dense"]).max() <= TOL


def test_sparse_keys_can_be_token_strings(tmp_path: Path) -> None:
    path = tiny_heads.build_bge_m3(tmp_path, seed=3)
    text = "berlin paris berlin café"
    params = PoolingParams(outputs=("sparse",))
    with Engine.from_workflow("bge_m3", path) as engine:
        by_id = engine.encode([text], params)[0].outputs["sparse"]
        tokens = engine.tokenizer.convert_ids_to_tokens(list(by_id))
    with Engine.from_workflow("bge_m3", path, output_processor={"params": {"sparse_keys": "tokens"}}) as engine:
        by_token = engine.encode([text], params)[0].outputs["sparse"]
    assert by_id and all(isinstance(k, str) for k in by_token)
    assert by_token == dict(zip(tokens, by_id.values()))


def test_unknown_output_and_missing_heads_are_errors(m3_engine: Engine, tiny_xlmr: Path) -> None:
    with pytest.raises(RequestError, match=r"outputs \['splade'\] are not produced.*'dense', 'sparse', 'colbert'"):
        m3_engine.encode(["text"], PoolingParams(outputs=("dense", "splade")))
    with pytest.raises(RequestError, match="not produced"):
        m3_engine.add_request("text", PoolingParams(outputs=("splade",)))
    assert not m3_engine.has_unfinished()
    with pytest.raises(ModelLoadError, match="sparse_linear.pt"):
        Engine.from_workflow("bge_m3", tiny_xlmr)
