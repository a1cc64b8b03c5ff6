"""The C++ CPU kernels of `kernels/cpu_ops.cpp` (`wde.kernels.cpp_build.cpu_ops`): LayerNorm(x + residual) for
post-norm blocks against PyTorch, the cases that keep PyTorch's path, and the switch. (The int8 passes:
tests/test_int8.py.)"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from wde.components.models import fused
from wde.components.models.fused import add_layer_norm
from wde.kernels import cpp_build

needs_kernel = pytest.mark.skipif(cpp_build.cpu_ops() is None, reason="the C++ CPU kernels cannot be built here")


def norm(width: int, bias: bool = True, affine: bool = True) -> nn.LayerNorm:
    ln = nn.LayerNorm(width, eps=1e-12, bias=bias, elementwise_affine=affine)
    g = torch.Generator().manual_seed(width)
    with torch.no_grad():
        for p in ln.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return ln


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [384, 768, 100, 7])  # multiples of the kernel's 16 lanes, and tails
@pytest.mark.parametrize("params", ["affine", "no bias", "none"])
def test_add_layer_norm_equals_pytorch(dtype: torch.dtype, width: int, params: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    ln = norm(width, bias=params == "affine", affine=params != "none")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 41, width, generator=g) * 5 + 2).to(dtype)  # an offset: the mean matters
    residual = torch.randn(3, 41, width, generator=g) * 3
    calls = []
    monkeypatch.setattr(fused, "cpu_fusable", lambda *a: calls.append(1) or True)
    with torch.inference_mode():
        got = add_layer_norm(x, residual, ln)
        want = ln(x + residual)
    assert calls and got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    assert (got - want).abs().max() <= 1e-5 * max(1.0, float(want.abs().max()))


def test_cases_the_kernel_does_not_cover_take_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    ln = norm(64)
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    fusable = fused.cpu_fusable
    with torch.no_grad():
        assert fusable(x, residual, ln)
        assert not fusable(x, residual.bfloat16(), ln)  # a bf16 residual (pure bf16 models): PyTorch rounds the sum
        assert not fusable(x.half(), residual, ln)
        assert not fusable(x, residual, norm(32))  # normalized over another width
        assert not fusable(x[:, :32], residual[:, :32].clone(), ln)
        assert not fusable(x, residual, nn.LayerNorm(64).bfloat16())
    with torch.enable_grad():
        assert not fusable(x, residual, ln)  # the norm's parameters take gradients: autograd's path
    monkeypatch.setattr(cpp_build, "cpu_ops", lambda: None)  # no kernel: the same result through PyTorch
    with torch.inference_mode():
        torch.testing.assert_close(add_layer_norm(x, residual, ln), ln(x + residual))


def test_switched_off_says_so_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("WDE_CPU_OPS", "0")
    cpp_build.cpu_ops.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="wde"):
            assert cpp_build.cpu_ops() is None
            assert cpp_build.cpu_ops() is None
        assert [r.getMessage() for r in caplog.records if "cpu_ops" in r.getMessage()] == [
            "cpu_ops: C++ kernels switched off (WDE_CPU_OPS=0); PyTorch ops run instead"]
        ln, x, residual = norm(16), torch.randn(4, 16), torch.randn(4, 16)
        with torch.inference_mode():
            torch.testing.assert_close(add_layer_norm(x, residual, ln), ln(x + residual))
    finally:
        monkeypatch.delenv("WDE_CPU_OPS")
        cpp_build.cpu_ops.cache_clear()


def test_built_at_load_for_the_models_that_call_them(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A post-norm BERT and a pre-norm decoder embedder on CPU have the kernels before their first batch (a first
    compile there would hold it)."""
    from tests.tiny_decoders import build_qwen2, qwen2_tokenizer
    from tests.tiny_models import build_bert
    from wde import Engine

    monkeypatch.setenv("WDE_DEVICE", "cpu")
    cpp_build.cpu_ops.cache_clear()
    try:
        qwen2 = str(build_qwen2(tmp_path / "qwen2", qwen2_tokenizer(real=False)))
        with Engine.from_workflow("gte_qwen2", qwen2, device="cpu"):
            assert cpp_build.cpu_ops.cache_info().currsize == 1  # decided at build; no batch has run
        cpp_build.cpu_ops.cache_clear()
        with Engine.from_workflow("bert", str(build_bert(tmp_path / "bert")), device="cpu",
                                  overrides=["pooler.params.pooling=mean"]):
            assert cpp_build.cpu_ops.cache_info().currsize == 1
    finally:
        cpp_build.cpu_ops.cache_clear()


# ---- pre-norm decoders: add + RMSNorm, rotary, SiLU * up (kernels/cpu_ops.cpp) ----

def rms_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What the reference modules compute (transformers' LlamaRMSNorm / Qwen3RMSNorm after a residual add)."""
    h = x if residual is None else x + residual
    hf = h.float()
    return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype), h


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 1024), (5, 3, 130), (19, 16, 128), (4, 7)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_equals_the_reference(dtype: torch.dtype, weight_dtype: torch.dtype, shape: tuple[int, ...],
                                           with_residual: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's output and new residual against the reference: bfloat16 the same values (a rare 1-ulp step where
    the float32 mean square rounds the other way), float32 within float rounding; dtypes as PyTorch promotes them."""
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    residual = torch.randn(shape, generator=g).to(dtype) if with_residual else None
    weight = (torch.rand(shape[-1], generator=g) + 0.5).to(weight_dtype)
    calls = []
    kernel = cpp_build.cpu_ops()
    monkeypatch.setattr(cpp_build, "cpu_ops", lambda: calls.append(1) or kernel)
    got, h = fused.add_rms_norm(x, residual, weight, 1e-6)
    want, want_h = rms_reference(x, residual, weight, 1e-6)
    assert calls, "the kernel was not called"
    assert got.dtype == want.dtype and got.shape == want.shape and h.dtype == x.dtype
    assert torch.equal(h, want_h) and (residual is not None or h is x)
    if got.dtype == torch.bfloat16:
        assert (got != want).float().mean() <= 1e-3
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@needs_kernel
def test_add_rms_norm_of_a_strided_per_head_view_and_non_finite_rows() -> None:
    """Qwen3's q norm reads a slice of the fused q|k|v output per head (not contiguous): no copy needed; a NaN or an
    infinity in a row makes that row's output non-finite (the engine's check sees it), the other rows unchanged."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(23, 4096, generator=g).bfloat16()
    qkv[5, 100] = float("nan")
    qkv[9, 300] = float("inf")
    q = qkv[:, :2048].view(-1, 16, 128)
    weight = (torch.rand(128, generator=g) + 0.5).bfloat16()
    got, _ = fused.add_rms_norm(q, None, weight, 1e-6)
    want, _ = rms_reference(q, None, weight, 1e-6)
    bad = ~want.isfinite().all(-1)
    assert bad.sum() == 2 and torch.equal(~got.isfinite().all(-1), bad)
    torch.testing.assert_close(got[~bad].float(), want[~bad].float(), rtol=2 ** -7, atol=0)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads_dim", [(16, 128), (8, 64), (3, 40)])  # 40: a half (20) not a multiple of 16
def test_rotary_equals_rotate_half(dtype: torch.dtype, heads_dim: tuple[int, int]) -> None:
    """`apply_rotary` through the kernel against the torch expression `x * cos + rotate_half(x) * sin`, on a strided
    [tokens, heads, d] slice of a fused projection: bfloat16 the same values, float32 within float rounding."""
    from wde.components.models.rotary import RotaryEmbedding, _rotate, apply_rotary

    heads, d = heads_dim
    g = torch.Generator().manual_seed(d)
    qkv = torch.randn(41, heads * d * 2, generator=g).to(dtype)
    x = qkv[:, :heads * d].view(-1, heads, d)
    cos, sin = RotaryEmbedding(d, 1e6)(torch.arange(41) * 13, dtype)
    got = apply_rotary(x, cos, sin)
    want = _rotate(x, cos, sin, False)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_equals_act_times_up(dtype: torch.dtype) -> None:
    from transformers.activations import ACT2FN

    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(33, 2 * 200, generator=g) * 4).to(dtype)
    gate_up[0, :3] = torch.tensor([float("nan"), 100.0, -100.0])
    for act in (ACT2FN["silu"], nn.SiLU()):
        got = fused.silu_mul(gate_up, act)
        gate, up = gate_up.split(200, dim=-1)
        want = act(gate) * up
        assert got.dtype == dtype and got.shape == want.shape and got[0, 0].isnan()
        if dtype == torch.bfloat16:
            assert (got != want).float().mean() <= 2e-3
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=1e-6, equal_nan=True)  # 1 ulp
        else:
            torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-5, equal_nan=True)
    gelu = fused.silu_mul(gate_up, nn.GELU())  # another activation: the torch path, exactly
    gate, up = gate_up.split(200, dim=-1)
    assert torch.equal(gelu.nan_to_num(), (nn.GELU()(gate) * up).nan_to_num())
