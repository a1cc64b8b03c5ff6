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


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """`cpp_build.cpu_ops` counted: the list grows each time code asks for the kernels, so a test can tell the
    kernel's path from PyTorch's (which gives the same values)."""
    calls: list[int] = []
    kernel = cpp_build.cpu_ops()
    monkeypatch.setattr(cpp_build, "cpu_ops", lambda: calls.append(1) or kernel)
    return calls


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
                                           with_residual: bool, kernel_calls: list[int]) -> None:
    """The kernel's output and new residual against the reference: bfloat16 the same values (a rare 1-ulp step where
    the float32 mean square rounds the other way), float32 within float rounding; dtypes as PyTorch promotes them."""
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    residual = torch.randn(shape, generator=g).to(dtype) if with_residual else None
    weight = (torch.rand(shape[-1], generator=g) + 0.5).to(weight_dtype)
    got, h = fused.add_rms_norm(x, residual, weight, 1e-6)
    want, want_h = rms_reference(x, residual, weight, 1e-6)
    assert kernel_calls, "the kernel was not called"
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
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(37, 1024), (300, 96), (5, 3, 40)])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
def test_add_rms_norm_of_a_low_precision_output_and_a_float32_residual(x_dtype: torch.dtype, shape: tuple[int, ...],
                                                                       out_dtype: torch.dtype | None,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       kernel_calls: list[int]) -> None:
    """A mixed-precision decoder's layer: a bfloat16 linear output added to the float32 residual stream (the sum in
    float32, as PyTorch promotes it), normed with a float32 weight; with `out_dtype` the output comes in the dtype the
    next linear layer casts it to, with storage for the rows a oneDNN layer pads it to, so that layer copies
    nothing (`_padded_in_place` takes it)."""
    from wde.components.models.cpu_linear import _padded_in_place, padded_rows

    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * 3).to(x_dtype)
    residual = torch.randn(shape, generator=g) * 2
    weight = torch.rand(shape[-1], generator=g) + 0.5
    got, h = fused.add_rms_norm(x, residual, weight, 1e-6, out_dtype)
    want, want_h = rms_reference(x, residual, weight, 1e-6)
    assert kernel_calls, "the kernel was not called"
    assert h.dtype == torch.float32 and torch.equal(h, want_h)
    if out_dtype is None:
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        want = want.to(out_dtype)
        assert got.dtype == out_dtype and got.shape == want.shape
        assert (got != want).float().mean() <= 1e-3  # a 1-ulp step where float32 rounding sits on a bf16 midpoint
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0)
        rows = got.numel() // shape[-1]
        assert _padded_in_place(got.reshape(rows, shape[-1]), padded_rows(rows), out_dtype) is not None
    # the torch path (no kernel) gives the same dtypes and values
    monkeypatch.setattr(cpp_build, "cpu_ops", lambda: None)
    plain, plain_h = fused.add_rms_norm(x, residual, weight, 1e-6, out_dtype)
    assert plain.dtype == got.dtype and torch.equal(plain_h, h)
    torch.testing.assert_close(plain.float(), got.float(), rtol=2 ** -7, atol=1e-6)


def norm_rotary_reference(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                          dtype: torch.dtype) -> torch.Tensor:
    """Qwen3's modules one after the other: the per-head RMSNorm, `x * cos + rotate_half(x) * sin`, the cast."""
    from wde.components.models.rotary import _rotate

    if weight is not None:
        x = rms_reference(x, None, weight, 1e-6)[0]
    return _rotate(x, cos, sin, False).to(dtype)


@needs_kernel
@pytest.mark.parametrize("dtypes", [
    (torch.bfloat16, torch.float32, torch.float32, torch.bfloat16),  # Qwen3 in mixed precision
    (torch.bfloat16, None, torch.float32, torch.bfloat16),  # Llama / Qwen2 in mixed precision: no q/k norm
    (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16),  # pure bfloat16
    (torch.bfloat16, None, torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32, torch.float32, torch.float32),
    (torch.float32, None, torch.float32, torch.float32),
], ids=["qwen3-mixed", "llama-mixed", "qwen3-bf16", "llama-bf16", "qwen3-fp32", "llama-fp32"])
@pytest.mark.parametrize("heads_dim", [(16, 128), (3, 40)])  # 40: a half (20) not a multiple of 16
def test_norm_rotary_equals_the_modules_in_turn(dtypes: tuple, heads_dim: tuple[int, int],
                                                kernel_calls: list[int]) -> None:
    """`norm_rotary` (one C++ pass) against the q/k norm, the rotary embedding and the cast to the attention's dtype
    computed one after the other, on a strided per-head slice of a fused q|k|v output with a NaN and an infinity in
    two rows: low-precision results the same values but for rare 1-ulp steps (float32's rsqrt against 1 / sqrt),
    float32 within float rounding; a non-finite input stays non-finite in its own head only."""
    from wde.components.models.rotary import RotaryEmbedding, norm_rotary

    x_dtype, w_dtype, table_dtype, out_dtype = dtypes
    heads, d = heads_dim
    g = torch.Generator().manual_seed(d)
    qkv = (torch.randn(53, heads * d * 2, generator=g) * 3).to(x_dtype)
    qkv[7, 5] = float("nan")
    qkv[11, d + 3] = float("inf")
    x = qkv[:, :heads * d].view(-1, heads, d)
    weight = None if w_dtype is None else (torch.rand(d, generator=g) + 0.5).to(w_dtype)
    cos, sin = RotaryEmbedding(d, 1e6)(torch.arange(53) * 17, table_dtype)
    got = norm_rotary(x, weight, 1e-6, cos, sin, out_dtype)
    want = norm_rotary_reference(x, weight, cos, sin, out_dtype)
    assert kernel_calls, "the kernel was not called"
    assert got.dtype == want.dtype == out_dtype and got.shape == x.shape and got.is_contiguous()
    bad = ~want.isfinite().all(-1)
    assert bad.sum() == 2 and torch.equal(~got.isfinite().all(-1), bad)
    if out_dtype == torch.bfloat16:
        # a normed value one bf16 step apart (the rsqrt) moves the rotated sum by that step of its larger term
        assert (got[~bad] != want[~bad]).float().mean() <= (2e-3 if weight is not None else 1e-3)
        torch.testing.assert_close(got[~bad].float(), want[~bad].float(), rtol=2 ** -7, atol=2 ** -5)
    else:
        torch.testing.assert_close(got[~bad], want[~bad], rtol=1e-5, atol=1e-5)


@needs_kernel
def test_norm_rotary_refuses_what_it_does_not_compute() -> None:
    """Partial rotary tables, a float32 result asked of bfloat16 inputs and grad-tracking inputs keep the modules'
    own path (the same values, slower)."""
    from wde.components.models.rotary import RotaryEmbedding, _cpu_norm_rotary_fits

    x = torch.randn(4, 2, 32).bfloat16()
    cos, sin = RotaryEmbedding(32, 1e4)(torch.arange(4), torch.float32)
    assert _cpu_norm_rotary_fits(x, None, cos, sin, torch.bfloat16)
    half_cos, half_sin = RotaryEmbedding(32, 1e4, rotary_dim=16)(torch.arange(4), torch.float32)
    assert not _cpu_norm_rotary_fits(x, None, half_cos, half_sin, torch.bfloat16)
    bf_cos, bf_sin = cos.bfloat16(), sin.bfloat16()
    assert not _cpu_norm_rotary_fits(x, None, bf_cos, bf_sin, torch.float32)  # a widening cast: not this kernel's
    assert not _cpu_norm_rotary_fits(x.half(), None, cos, sin, torch.bfloat16)
    with torch.enable_grad():
        assert not _cpu_norm_rotary_fits(x.float().requires_grad_(), None, cos, sin, torch.float32)


@needs_kernel
def test_silu_mul_leaves_rows_for_the_down_projection_padding() -> None:
    """SiLU * up writes into storage holding the rows the down projection's oneDNN GEMM pads its input to, so that
    layer reads it in place instead of copying it."""
    from wde.components.models.cpu_linear import _padded_in_place, padded_rows

    gate_up = torch.randn(1000, 2 * 96).bfloat16()
    out = fused.silu_mul(gate_up, nn.SiLU())
    assert out.shape == (1000, 96) and padded_rows(1000) > 1000
    assert _padded_in_place(out, padded_rows(1000), torch.bfloat16) is not None


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
    mish = fused.silu_mul(gate_up, nn.Mish())  # an activation the kernel does not have: the torch path, exactly
    gate, up = gate_up.split(200, dim=-1)
    assert torch.equal(mish.nan_to_num(), (nn.Mish()(gate) * up).nan_to_num())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["gelu_pytorch_tanh", "gelu_new"])
def test_gelu_mul_equals_act_times_up(dtype: torch.dtype, name: str, kernel_calls: list[int]) -> None:
    """GeGLU with the tanh GELU (Gemma's `gelu_pytorch_tanh`, BERT's `gelu_new` spelling) through the same one-pass
    kernel, as g / (1 + e^-2u): within one rounding of the exact function (float64, rounded to the dtype, times up,
    rounded), as close as PyTorch's own module in float32 and closer in bfloat16 (torch's `gelu_new` rounds each
    step to bf16: a quarter of its outputs are a step or more off). The erf GELU keeps the torch path (the kernel's
    erf loses relative accuracy in the negative tail)."""
    from wde.components.models.activations import activation

    act = activation(name)
    g = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(45, 2 * 200, generator=g) * 4).to(dtype)
    gate_up[0, :3] = torch.tensor([float("nan"), 100.0, -100.0])
    got = fused.silu_mul(gate_up, act)
    gate, up = gate_up.split(200, dim=-1)
    exact = (nn.functional.gelu(gate.double(), approximate="tanh").to(dtype).double() * up.double()).to(dtype)
    assert kernel_calls and got.dtype == dtype and got.shape == exact.shape and got[0, 0].isnan()
    erf = fused.silu_mul(gate_up, activation("gelu"))
    assert torch.equal(erf.nan_to_num(), (activation("gelu")(gate) * up).nan_to_num())
    ok = ~exact.isnan()
    if dtype == torch.bfloat16:
        assert (got[ok] != exact[ok]).float().mean() <= 0.05
        torch.testing.assert_close(got[ok].float(), exact[ok].float(), rtol=2 ** -7, atol=1e-6)  # 1 ulp
    else:
        torch.testing.assert_close(got[ok], exact[ok], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[ok], (act(gate) * up)[ok], rtol=1e-5, atol=1e-5)  # tails: torch 0, here ~1e-6


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_equals_the_reference(dtype: torch.dtype, kernel_calls: list[int]) -> None:
    """Gemma's RMSNorm (`x * rsqrt(mean(x^2) + eps) * (1 + w)` in float32, no rounding between, cast to x's dtype)
    through `add_rms_norm`'s kernel: the reference's values but for a rare 1-ulp step (float32's rsqrt)."""
    g = torch.Generator().manual_seed(5)
    qkv = (torch.randn(37, 3 * 256, generator=g) * 3).to(dtype)
    for x in (torch.randn(37, 768, generator=g).to(dtype) * 2, qkv[:, :512].view(37, 2, 256)):  # rows; q per head
        weight = torch.randn(x.shape[-1], generator=g) * 0.3
        kernel_calls.clear()
        got = fused.gemma_rms_norm(x, weight, 1e-6)
        xf = x.float()
        want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + weight.float())).to(dtype)
        assert kernel_calls and got.dtype == dtype and got.shape == x.shape
        if dtype == torch.bfloat16:
            assert (got != want).float().mean() <= 1e-3
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0)
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.float32)], ids=["mixed", "bf16", "bf16-to-fp32"])
def test_gemma_rms_norm_writes_the_linear_layers_dtype(dtypes: tuple, kernel_calls: list[int]) -> None:
    """The first input norm of a Gemma model in mixed precision (float32 x, bfloat16 linear layers) writes bfloat16
    in the kernel's pass, with storage for the rows a oneDNN layer pads to: what the norm then the cast gave. A
    bfloat16 x asked for float32 keeps its rounding to bfloat16 first, as the modules round."""
    from wde.components.models.cpu_linear import padded_rows

    x_dtype, out_dtype = dtypes
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(37, 768, generator=g) * 2).to(x_dtype)
    weight = torch.randn(768, generator=g) * 0.3
    got = fused.gemma_rms_norm(x, weight, 1e-6, out_dtype)
    assert kernel_calls and got.dtype == out_dtype and got.shape == x.shape
    want = fused.gemma_rms_norm(x, weight, 1e-6).to(out_dtype)
    assert torch.equal(got, want)
    if x_dtype == torch.float32:
        assert got.untyped_storage().nbytes() >= padded_rows(37) * 768 * got.element_size()


@needs_kernel
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32, None), (torch.bfloat16, torch.float32, torch.bfloat16),
                                    (torch.bfloat16, torch.bfloat16, None), (torch.float32, torch.float32, None)],
                         ids=["mixed", "mixed-bf16-out", "bf16", "fp32"])
def test_gemma_sandwich_equals_norm_add_norm(dtypes: tuple, monkeypatch: pytest.MonkeyPatch,
                                             kernel_calls: list[int]) -> None:
    """Gemma 3's sandwich in one kernel (`gemma_norm_add_norm`) against its modules in turn: the output norm, the
    residual add, the next block's input norm (and the cast a linear layer makes): the new residual the same values
    (float32: within float rounding), the normed output within one rounding, a NaN kept to its row."""
    x_dtype, residual_dtype, out_dtype = dtypes
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(300, 768, generator=g) * 3).to(x_dtype)
    x[17, 5] = float("nan")
    residual = (torch.randn(300, 768, generator=g) * 20).to(residual_dtype)
    post, pre = torch.randn(768, generator=g) * 0.3, torch.randn(768, generator=g) * 0.3
    got, h = fused.gemma_norm_add_norm(x, residual, post, 1e-6, pre, 1e-5, out_dtype)
    assert kernel_calls
    monkeypatch.setattr(cpp_build, "cpu_ops", lambda: None)  # the modules in turn
    want_h = residual + fused.gemma_rms_norm(x, post, 1e-6)
    want = fused.gemma_rms_norm(want_h, pre, 1e-5)
    want = want if out_dtype is None else want.to(out_dtype)
    assert h.dtype == want_h.dtype == residual_dtype and got.dtype == want.dtype
    bad = ~want.isfinite().all(-1)
    assert bad.sum() == 1 and torch.equal(~got.isfinite().all(-1), bad)
    if want.dtype == torch.bfloat16:
        torch.testing.assert_close(h[~bad].float(), want_h[~bad].float(), rtol=2 ** -7, atol=0)
        assert (got[~bad] != want[~bad]).float().mean() <= 2e-3
        torch.testing.assert_close(got[~bad].float(), want[~bad].float(), rtol=2 ** -7, atol=0)
    else:
        torch.testing.assert_close(h[~bad], want_h[~bad], rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(got[~bad], want[~bad], rtol=1e-5, atol=1e-5)
