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
    """A post-norm BERT on CPU has the kernels before its first batch (a first compile there would hold it); a
    decoder embedder, which never calls them, never builds them."""
    from tests.tiny_decoders import build_qwen2, qwen2_tokenizer
    from tests.tiny_models import build_bert
    from wde import Engine

    monkeypatch.setenv("WDE_DEVICE", "cpu")
    cpp_build.cpu_ops.cache_clear()
    try:
        with Engine.from_workflow("gte_qwen2", str(build_qwen2(tmp_path / "qwen2", qwen2_tokenizer(real=False))),
                                  device="cpu"):
            assert cpp_build.cpu_ops.cache_info().currsize == 0
        with Engine.from_workflow("bert", str(build_bert(tmp_path / "bert")), device="cpu",
                                  overrides=["pooler.params.pooling=mean"]):
            assert cpp_build.cpu_ops.cache_info().currsize == 1  # decided at build; no batch has run
    finally:
        cpp_build.cpu_ops.cache_clear()
