"""`cpu_varlen` (per-sequence SDPA on views of the packed tensors) equals `torch_sdpa` and transformers, causal
and bidirectional, with single-token and uneven lengths and GQA; `auto` picks it for long CPU batches only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests import tiny_decoders
from tests.batches import bare_backend, packed_batch
from tests.test_attention_window import reference
from tests.test_decoders import Reference
from tests.test_parity_tiny import reference_states
from tests.tiny_models import varied_texts
from wde import Engine, PoolingParams
from wde.components.attention.auto import AutoBackend
from wde.components.attention.cpu_varlen import MIN_MEAN_LEN, CpuVarlenBackend, plan_runs, prefer_varlen
from wde.components.attention.torch_sdpa import TorchSDPABackend

TOL = 1e-5
TEXTS = varied_texts(24, seed=11) + ["x", "a b", "HELLO, World!!"]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", [[1], [1, 1, 1], [7], [4, 4, 4], [5, 1, 17, 9, 9, 3, 30], [1, 200, 3, 3, 64]])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_matches_torch_sdpa_and_per_sequence_attention(causal: bool, lens: list[int], kv_heads: int) -> None:
    torch.manual_seed(0)
    t = sum(lens)
    qkv = torch.randn(t, 4 + 2 * kv_heads, 16)  # q/k/v as strided views of one projection, as the models make them
    q, k, v = qkv.split([4, kv_heads, kv_heads], dim=1)
    varlen, sdpa = bare_backend(CpuVarlenBackend), bare_backend(TorchSDPABackend)
    out = varlen.forward(q, k, v, varlen.build_metadata(packed_batch(lens), causal), 0.25)
    assert out.shape == q.shape
    torch.testing.assert_close(out, sdpa.forward(q, k, v, sdpa.build_metadata(packed_batch(lens), causal), 0.25),
                               atol=TOL, rtol=TOL)
    torch.testing.assert_close(out, reference(q, k, v, lens, None, causal, 0.25), atol=TOL, rtol=TOL)


def test_adjacent_equal_lengths_share_one_call() -> None:
    assert plan_runs([3, 3, 5, 1, 1, 3]) == [(0, 2, 3), (6, 1, 5), (11, 2, 1), (13, 1, 3)]
    assert plan_runs([2]) == [(0, 1, 2)]


def test_a_bias_is_refused_with_a_clear_error() -> None:
    backend = bare_backend(CpuVarlenBackend)
    with pytest.raises(ValueError, match="cpu_varlen.*bias.*torch_sdpa"):
        backend.build_metadata(packed_batch([3, 2]), False, torch.zeros(4, 3, 3))


def test_auto_picks_cpu_varlen_for_long_cpu_batches_only(tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("wde.components.attention.auto.prefer_cpu_flash", lambda lens: False)  # its kernel not built
    with Engine.from_workflow("bert", tiny_bert, device="cpu", attention={"name": "auto"},
                              overrides=["pooler.params.pooling=mean"]) as engine:
        auto = engine.components["attention"]
        assert isinstance(auto, AutoBackend)
        short, long = [MIN_MEAN_LEN - 1] * 4, [MIN_MEAN_LEN, MIN_MEAN_LEN + 40, MIN_MEAN_LEN - 20]
        assert not prefer_varlen(short) and prefer_varlen(long)
        assert isinstance(auto.build_metadata(packed_batch(short), False).extra[0], TorchSDPABackend)
        assert isinstance(auto.build_metadata(packed_batch(long), False).extra[0], CpuVarlenBackend)
        biased = auto.build_metadata(packed_batch(long), False, torch.zeros(2, 200, 200))  # tiny BERT: 2 heads
        assert isinstance(biased.extra[0], TorchSDPABackend) and biased.bias is not None


def test_bert_matches_transformers(tiny_bert: Path) -> None:
    with Engine.from_workflow("bert", tiny_bert, attention={"name": "cpu_varlen"},
                              pooler={"params": {"pooling": "all", "normalize": False}}) as engine:
        assert isinstance(engine.components["attention"], CpuVarlenBackend)
        outs = engine.encode(TEXTS, PoolingParams(truncate=True))
        max_length = engine.max_length
    worst = max(float(np.abs(o.outputs["token_embeddings"] - reference_states(tiny_bert, t, max_length)).max())
                for t, o in zip(TEXTS, outs))
    assert worst <= TOL, f"max abs diff {worst:.2e}"


@pytest.fixture(scope="module")
def mistral_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_decoders.build_mistral(tmp_path_factory.mktemp("tiny-mistral-varlen"))  # 4 query heads, 2 kv heads


@pytest.mark.parametrize(("workflow", "causal"), [("decoder_features", True), ("llm2vec", False)])
def test_decoder_matches_transformers(mistral_path: Path, workflow: str, causal: bool) -> None:
    ref = Reference(mistral_path)
    with Engine.from_workflow(workflow, mistral_path, attention={"name": "cpu_varlen"},
                              pooler={"params": {"pooling": "all"}}) as engine:
        assert engine.components["model"].causal is causal
        outs = engine.encode(TEXTS)
    worst = max(float(np.abs(o.outputs["token_embeddings"] - h).max())
                for o, h in zip(outs, ref.hidden(TEXTS, causal)))
    assert worst <= TOL, f"{workflow}: max abs diff {worst:.2e}"
