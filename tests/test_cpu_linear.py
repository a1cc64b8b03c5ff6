"""fp32 linear layers through oneDNN with prepacked weights (the default on AVX-512 CPUs): same outputs as
PyTorch's own path, GELU fused into the GEMM before it, and chosen only where it pays and runs, as PyTorch sees
the CPU."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from transformers.activations import ACT2FN

from tests.test_cpu_bf16 import SAPPHIRE_RAPIDS, fake_cpuinfo
from tests.tiny_models import varied_texts
from wde import Engine, device
from wde.components.models import cpu_linear
from wde.components.models.cpu_linear import (PackedLinear, onednn_available, onednn_error, pack_linears,
                                              resolve_cpu_linear)

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN (mkldnn)")
needs_onednn_bf16 = pytest.mark.skipif(not onednn_available() or onednn_error(torch.bfloat16) is not None,
                                       reason="oneDNN runs no bfloat16 linear on this CPU")
AVX2 = {"avx2": True, "avx512_f": False, "avx512_bf16": False, "amx_bf16": False}
AVX512 = {**AVX2, "avx512_f": True}
AVX512_BF16 = {**AVX512, "avx512_bf16": True}
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
            if choice == "onednn":  # MiniLM's 6 intermediate blocks: GELU (erf) fused into their linear layer
                assert sum(m.post_op == ("gelu", "none") for m in layers) == (6 if cpu_linear.fusion_pays() else 0)
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


def test_auto_picks_onednn_only_where_it_pays(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    onednn = "onednn" if onednn_available() else "torch"
    monkeypatch.setattr(cpu_linear, "onednn_bf16_supported", lambda: True)
    monkeypatch.setattr(cpu_linear, "cpu_capabilities", lambda: AVX2)
    assert resolve_cpu_linear("auto", cpu, torch.float32) == "torch"  # measured slower on AVX2 hosts
    assert resolve_cpu_linear("auto", cpu, torch.bfloat16) == "torch"
    monkeypatch.setattr(cpu_linear, "cpu_capabilities", lambda: AVX512)  # AVX-512, no native bf16
    assert resolve_cpu_linear("auto", cpu, torch.float32) == onednn
    assert resolve_cpu_linear("auto", cpu, torch.bfloat16) == "torch"
    monkeypatch.setattr(cpu_linear, "cpu_capabilities", lambda: AVX512_BF16)
    runs_bf16 = onednn_available() and onednn_error(torch.bfloat16) is None  # the probe runs on the real CPU
    assert resolve_cpu_linear("auto", cpu, torch.bfloat16) == ("onednn" if runs_bf16 else "torch")
    monkeypatch.setattr(cpu_linear, "onednn_bf16_supported", lambda: False)
    assert resolve_cpu_linear("auto", cpu, torch.bfloat16) == "torch"
    for dev, dtype in ((cpu, torch.float16), (cuda, torch.float32), (cuda, torch.float16), (cuda, torch.bfloat16)):
        assert resolve_cpu_linear("auto", dev, dtype) == "torch"
        assert resolve_cpu_linear("onednn", dev, dtype) == "torch"  # only fp32 / bf16 on a CPU ever take it
    assert resolve_cpu_linear("torch", cpu, torch.float32) == "torch"


def test_auto_ignores_cpuinfo_and_falls_back_when_onednn_refuses(
        tiny_bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """/proc/cpuinfo claiming AMX does not make `auto` prepack bf16 (what PyTorch detects decides), and where
    the detection says yes but oneDNN's kernel refuses, the engine builds on PyTorch's path with one warning."""
    monkeypatch.setattr(device, "CPUINFO_PATH", fake_cpuinfo(tmp_path, SAPPHIRE_RAPIDS))
    real = cpu_linear._onednn_pays(torch.bfloat16)
    assert resolve_cpu_linear("auto", torch.device("cpu"), torch.bfloat16) == (
        "onednn" if real and onednn_error(torch.bfloat16) is None else "torch")
    monkeypatch.setattr(cpu_linear, "_onednn_pays", lambda dtype: True)
    monkeypatch.setattr(cpu_linear, "onednn_error", lambda dtype: "bf16 path needs avx512bw (test)")
    monkeypatch.setattr(cpu_linear, "_warned", set())  # said once per process: this test's own process-state
    caplog.set_level(logging.WARNING, logger="wde.models")
    with Engine.from_workflow("bert", tiny_bert, dtype="bfloat16", device="cpu",
                              overrides=["pooler.params.pooling=mean"]) as engine:
        assert engine.components["model"].linear_backend == "torch"
        assert np.isfinite(engine.embed(["still runs"])).all()
        resolve_cpu_linear("auto", torch.device("cpu"), torch.bfloat16)  # asked again: nothing more is said
    warnings = [r.getMessage() for r in caplog.records if r.name == "wde.models"]
    # Once per dtype asked: the model's linear dtype, and float32 too where mixed precision's probe times it
    # (a fresh kernel cache; the H200's 16 cores gave three warnings before they were said once).
    assert 1 <= len(warnings) <= 2 and len(set(warnings)) == len(warnings), warnings
    assert all("bf16 path needs avx512bw (test)" in w for w in warnings)
    with pytest.raises(ValueError, match="cpu_linear=onednn.*bf16 path needs avx512bw"):
        resolve_cpu_linear("onednn", torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize(("act", "post_op"), [("gelu", ("gelu", "none")), ("gelu_new", ("gelu", "tanh")),
                                              ("gelu_pytorch_tanh", ("gelu", "tanh")), ("relu", ("relu", ""))])
@needs_onednn
def test_fused_activation_matches_unfused(act: str, post_op: tuple[str, str]) -> None:
    class Intermediate(nn.Module):  # BERT's shape: act(dense(x))
        def __init__(self) -> None:
            super().__init__()
            self.dense, self.intermediate_act_fn = nn.Linear(48, 96), ACT2FN[act]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.intermediate_act_fn(self.dense(x))

    torch.manual_seed(0)
    block, x = Intermediate().eval(), torch.randn(37, 48)
    expected = block(x)
    assert pack_linears(block, 64, fuse=True) == 1
    assert isinstance(block.dense, PackedLinear) and block.dense.post_op == post_op
    assert isinstance(block.intermediate_act_fn, nn.Identity)
    torch.testing.assert_close(block(x), expected, atol=1e-5, rtol=1e-5)


@needs_onednn
@pytest.mark.parametrize("fuse", [True, False])
def test_fusion_follows_the_isa_unless_asked(monkeypatch: pytest.MonkeyPatch, fuse: bool) -> None:
    monkeypatch.setattr(cpu_linear, "cpu_capabilities", lambda: AVX512 if fuse else AVX2)
    block = nn.Sequential()
    block.dense, block.act = nn.Linear(8, 8), nn.GELU()
    pack_linears(block, 8)
    assert block.dense.post_op == (("gelu", "none") if fuse else ("none", ""))


@needs_onednn
def test_only_a_verified_pair_is_fused() -> None:
    class ActFirst(nn.Module):  # `dense` + GELU, but applied the other way round: fusing would change it
        def __init__(self) -> None:
            super().__init__()
            self.dense, self.act = nn.Linear(16, 16), nn.GELU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dense(self.act(x))

    class Gated(nn.Module):  # SiLU is no post-op we fuse
        def __init__(self) -> None:
            super().__init__()
            self.dense, self.act = nn.Linear(16, 16), nn.SiLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.dense(x))

    torch.manual_seed(0)
    x = torch.randn(5, 16)
    for block in (ActFirst().eval(), Gated().eval()):
        expected = block(x)
        assert pack_linears(block, 8, fuse=True) == 1
        assert block.dense.post_op == ("none", "") and not isinstance(block.act, nn.Identity)
        torch.testing.assert_close(block(x), expected, atol=1e-5, rtol=1e-5)


@needs_onednn_bf16
def test_onednn_linears_in_bfloat16(minilm_path: Path) -> None:
    vectors = {}
    for choice in ("torch", "onednn"):
        with Engine.from_workflow("bert", minilm_path, dtype="bfloat16",
                                  overrides=[f"model.params.cpu_linear={choice}"]) as engine:
            vectors[choice] = engine.embed(TEXTS)
    assert float((vectors["onednn"] * vectors["torch"]).sum(axis=1).min()) >= 0.9999


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_rows_already_in_the_storage_are_used_without_a_copy(dtype: torch.dtype,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """An input that is a row prefix of a tensor holding the padded rows (another linear's output, cut back) goes
    to oneDNN over its own storage, not copied; what those spare rows hold (NaN here) does not reach the real rows,
    which equal those of the copying path. An input that is not such a prefix, or of another dtype, is copied."""
    if dtype == torch.bfloat16 and onednn_error(torch.bfloat16) is not None:
        pytest.skip("oneDNN runs no bfloat16 linear on this CPU")
    g = torch.Generator().manual_seed(4)
    linear = nn.Linear(48, 24).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
    bias = linear.bias.detach()
    whole = torch.randn(64, 48, generator=g).to(dtype)
    whole[45:] = float("nan")  # the spare rows past the 45 real ones
    x = whole[:45]
    assert cpu_linear.padded_rows(45) == 64
    spared = cpu_linear._padded_in_place(x, 64, dtype)
    assert spared is not None and spared.data_ptr() == whole.data_ptr() and spared.shape == (64, 48)
    assert cpu_linear._padded_in_place(x.clone(), 64, dtype) is None  # its storage ends with its rows
    assert cpu_linear._padded_in_place(whole[:45, :40], 64, dtype) is None  # not contiguous
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    assert cpu_linear._padded_in_place(x, 64, other) is None  # a cast copies anyway
    got = cpu_linear.onednn_linear(x, dtype, packed, bias)
    monkeypatch.setattr(cpu_linear, "_padded_in_place", lambda *a: None)
    copied = cpu_linear.onednn_linear(x, dtype, packed, bias)
    assert got.shape == copied.shape == (45, 24) and bool(torch.isfinite(got).all())
    assert torch.equal(got, copied)


def test_capped_kernels_decide_as_an_avx2_host() -> None:
    """With PyTorch's and oneDNN's kernels capped to AVX2 (how CI covers the AVX2 path on an AVX-512 host), WDE
    decides as on an AVX2-only CPU: no AVX-512 or AMX feature, PyTorch's fp32 linears, no oneDNN bf16."""
    code = ("import torch; from wde.components.models import cpu_linear as c; caps = c.cpu_capabilities();"
            "assert torch.backends.cpu.get_cpu_capability() == 'AVX2', torch.backends.cpu.get_cpu_capability();"
            "assert not any(v for k, v in caps.items() if k.startswith(('avx512', 'amx'))), caps;"
            "assert c.resolve_cpu_linear('auto', torch.device('cpu'), torch.float32) == 'torch';"
            "assert c.resolve_cpu_linear('auto', torch.device('cpu'), torch.bfloat16) == 'torch';"
            "assert not c.fusion_pays()")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
