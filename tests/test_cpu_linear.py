"""fp32 linear layers through oneDNN with prepacked weights (the default on AVX-512 CPUs): same outputs as
PyTorch's own path, and chosen only where it pays."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_cpu_bf16 import SKYLAKE_X, ZEN2_AVX2, ZEN4, fake_cpuinfo
from tests.tiny_models import varied_texts
from wde import Engine, device
from wde.components.models.cpu_linear import PackedLinear, onednn_available, resolve_cpu_linear

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN (mkldnn)")
TEXTS = varied_texts(64, seed=3)


@needs_onednn
@pytest.mark.parametrize("workflow", ["bert", "cross_encoder"])
def test_onednn_linears_match_torch(minilm_path: Path, workflow: str, tmp_path: Path) -> None:
    model = minilm_path
    if workflow == "cross_encoder":
        from tests.tiny_heads import build_minilm_classifier

        model = build_minilm_classifier(minilm_path, tmp_path / "ce", num_labels=1)
    inputs = TEXTS if workflow == "bert" else [(TEXTS[i], TEXTS[i + 1]) for i in range(0, 64, 2)]
    results = {}
    for choice in ("torch", "onednn"):
        with Engine.from_workflow(workflow, model, overrides=[f"model.params.cpu_linear={choice}"]) as engine:
            layers = [m for m in engine.components["model"].modules() if isinstance(m, PackedLinear)]
            assert engine.components["model"].linear_backend == choice and bool(layers) == (choice == "onednn")
            outs = engine.encode(inputs, raise_on_error=False)
            results[choice] = np.stack([next(iter(o.outputs.values())) for o in outs])
    assert np.abs(results["onednn"] - results["torch"]).max() <= 1e-5


@needs_onednn
def test_onednn_linears_in_a_decoder(tmp_path: Path) -> None:
    from tests.tiny_decoders import build_qwen2

    from tests.tiny_decoders import qwen2_tokenizer

    path = build_qwen2(tmp_path / "qwen2", qwen2_tokenizer(real=False))
    vectors = {}
    for choice in ("torch", "onednn"):
        with Engine.from_workflow("gte_qwen2", path, overrides=[f"model.params.cpu_linear={choice}"]) as engine:
            vectors[choice] = engine.embed(TEXTS[:16])
    assert np.abs(vectors["onednn"] - vectors["torch"]).max() <= 1e-5


def test_auto_picks_onednn_only_where_it_pays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    onednn = "onednn" if onednn_available() else "torch"
    monkeypatch.setattr(device, "CPUINFO_PATH", fake_cpuinfo(tmp_path, ZEN2_AVX2))
    assert resolve_cpu_linear("auto", cpu, torch.float32) == "torch"  # measured no faster on AVX2 hosts
    assert resolve_cpu_linear("auto", cpu, torch.bfloat16) == "torch"
    monkeypatch.setattr(device, "CPUINFO_PATH", fake_cpuinfo(tmp_path, SKYLAKE_X))  # AVX-512, no native bf16
    assert resolve_cpu_linear("auto", cpu, torch.float32) == onednn
    assert resolve_cpu_linear("auto", cpu, torch.bfloat16) == "torch"
    monkeypatch.setattr(device, "CPUINFO_PATH", fake_cpuinfo(tmp_path, ZEN4))
    assert resolve_cpu_linear("auto", cpu, torch.bfloat16) == onednn
    for dev, dtype in ((cpu, torch.float16), (cuda, torch.float32), (cuda, torch.float16), (cuda, torch.bfloat16)):
        assert resolve_cpu_linear("auto", dev, dtype) == "torch"
        assert resolve_cpu_linear("onednn", dev, dtype) == "torch"  # only fp32 / bf16 on a CPU ever take it
    assert resolve_cpu_linear("torch", cpu, torch.float32) == "torch"


@needs_onednn
def test_onednn_linears_in_bfloat16(minilm_path: Path) -> None:
    vectors = {}
    for choice in ("torch", "onednn"):
        with Engine.from_workflow("bert", minilm_path, dtype="bfloat16",
                                  overrides=[f"model.params.cpu_linear={choice}"]) as engine:
            vectors[choice] = engine.embed(TEXTS)
    assert float((vectors["onednn"] * vectors["torch"]).sum(axis=1).min()) >= 0.9999
