"""Triton kernels against torch references; on CPU they run in triton's interpreter, so shapes stay tiny.

TRITON_INTERPRET must be set before triton is first imported (it fixes compiled vs interpreted then); conftest.py
sets it at the very start of the session when no CUDA device is present.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from wde.kernels import fused_norm, l2norm, varlen_attention  # noqa: E402
from wde.kernels.fused_norm import add_layer_norm, add_rms_norm  # noqa: E402
from wde.kernels.l2norm import l2_normalize  # noqa: E402
from wde.kernels.varlen_attention import varlen_attention as attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MEAN = {"params": {"pooling": "mean"}}
"""tiny_bert has no sentence-transformers pooling config."""
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], causal: bool,
                        scale: float) -> torch.Tensor:
    """Per-sequence SDPA in fp32 with k/v heads repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in lens:
        qs, ks, vs = (x[start:start + n].float().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(outs)


def packed(lens: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=g).to(DEVICE, dtype) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32, device=DEVICE)
    return q, k, v, cu


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_varlen_attention_matches_per_sequence_sdpa(causal: bool, hq: int, hkv: int, dtype: torch.dtype) -> None:
    lens = [1, 5, 17]
    q, k, v, cu = packed(lens, hq, hkv, 16, dtype)
    out = attention(q, k, v, cu, max(lens), causal, scale=0.3)
    assert out.shape == q.shape and out.dtype == dtype
    ref = reference_attention(q, k, v, lens, causal, 0.3)
    assert (out.float() - ref).abs().max().item() < TOL[dtype]


def test_strided_qkv_and_unpadded_head_dim() -> None:
    """Slices of a fused qkv projection go in without copies; head_dim 24 is padded to 32 inside the kernel."""
    lens, heads, d = [3, 1, 9], 2, 24
    qkv = torch.randn(sum(lens), 3, heads, d, device=DEVICE)
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0, 3, 4, 13], dtype=torch.int32, device=DEVICE)
    out = attention(q, k, v, cu, 9, causal=False)
    ref = reference_attention(q, k, v, lens, False, d ** -0.5)
    assert (out - ref).abs().max().item() < 1e-5


def test_single_token_sequences_attend_to_themselves() -> None:
    q, k, v, cu = packed([1, 1, 1], 2, 1, 16, torch.float32)
    for causal in (False, True):
        out = attention(q, k, v, cu, 1, causal)
        assert torch.allclose(out, v.expand_as(q), atol=1e-6)


@pytest.mark.parametrize("shapes,message", [
    (((4, 3, 16), (4, 2, 16)), "multiple"),
    (((4, 2, 256), (4, 2, 256)), "head_dim"),
    (((4, 2, 16), (5, 2, 16)), "k and v"),
])
def test_varlen_attention_rejects_bad_shapes(shapes, message: str) -> None:
    qs, ks = shapes
    q, k = torch.zeros(qs, device=DEVICE), torch.zeros(ks, device=DEVICE)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        attention(q, k, k, cu, 4, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(3, 5), (2, 3, 17), (1, 64)])
def test_l2_normalize_matches_torch(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = torch.randn(shape, device=DEVICE).to(dtype)
    out = l2_normalize(x)
    assert out.shape == x.shape and out.dtype == dtype
    assert (out.float() - F.normalize(x.float(), dim=-1)).abs().max().item() < TOL[dtype] * 4


def test_l2_normalize_wide_rows_and_zero_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows wider than one block take the chunked path; an all-zero row stays zero (eps, not NaN)."""
    monkeypatch.setattr(l2norm, "MAX_BLOCK", 16)
    x = torch.randn(3, 37, device=DEVICE)
    x[1] = 0
    out = l2_normalize(x)
    assert torch.allclose(out, F.normalize(x, dim=-1), atol=1e-6)
    assert not out.isnan().any()


def rms_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cols", [24, 64])
def test_fused_add_norms_match_torch(cols: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(cols)
    x, r = (torch.randn(2, 3, cols, generator=g).to(DEVICE, dtype) for _ in range(2))
    w, b = (torch.randn(cols, generator=g).to(DEVICE, dtype) for _ in range(2))
    summed = (x.float() + r.float()).to(dtype)
    ln = add_layer_norm(x, r, w, b, eps=1e-5)
    ref_ln = F.layer_norm(summed.float(), (cols,), w.float(), b.float(), eps=1e-5)
    assert ln.dtype == dtype and (ln.float() - ref_ln).abs().max().item() < TOL[dtype] * 8
    plain = add_layer_norm(x, None, w, None, eps=1e-5)
    assert (plain.float() - F.layer_norm(x.float(), (cols,), w.float(), eps=1e-5)).abs().max().item() < TOL[dtype] * 8
    rms, new_residual = add_rms_norm(x, r, w, eps=1e-6)
    # Triton's interpreter truncates fp32 -> bf16 instead of rounding to nearest: allow one bf16 ulp there.
    ulp = 2 ** -7 if dtype == torch.bfloat16 and fused_norm.INTERPRETED else 0.0
    torch.testing.assert_close(new_residual, summed, rtol=ulp, atol=0.0)
    assert (rms.float() - rms_reference(summed, w, 1e-6)).abs().max().item() < TOL[dtype] * 8


def test_wde_import_does_not_define_kernels() -> None:
    """wde registers triton_varlen without importing the kernels, so TRITON_INTERPRET can still be set later."""
    code = "import sys, wde.plugins.builtin_components; assert 'kernels.varlen_attention' not in sys.modules"
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=60)


def test_backend_refuses_to_build_without_cuda_or_interpreter(monkeypatch: pytest.MonkeyPatch, tiny_bert: Path) -> None:
    from wde import Engine
    from wde.errors import ModelLoadError

    monkeypatch.setattr(varlen_attention, "INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelLoadError, match="torch_sdpa.*TRITON_INTERPRET=1"):
        Engine.from_workflow("bert", tiny_bert, attention={"name": "triton_varlen"}, device="cpu")


@pytest.mark.parametrize("causal", [None, True], ids=["model-default", "causal"])
def test_triton_engine_matches_torch_sdpa_engine(tiny_bert: Path, causal: bool | None) -> None:
    from wde import Engine

    texts = ["hello", "a slightly longer sentence here", "x y"]
    outs = {}
    for name in ("torch_sdpa", "triton_varlen"):
        attn = {"name": name, "params": {"causal": causal}}
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with Engine.from_workflow("bert", tiny_bert, attention=attn, pooler=MEAN, dtype="float32",
                                  device=device) as engine:
            assert type(engine.components["attention"]).name == name
            outs[name] = engine.embed(texts, normalize=False)
    assert np.abs(outs["triton_varlen"] - outs["torch_sdpa"]).max() < 1e-4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [64, 80, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("hq,hkv", [(12, 12), (16, 4)], ids=["mha", "gqa"])
@pytest.mark.gpu
@needs_cuda
def test_varlen_attention_large_shapes_on_gpu(hq: int, hkv: int, causal: bool, d: int, dtype: torch.dtype) -> None:
    lens = [1, 7, 64, 65, 200, 511, 33]
    q, k, v, cu = packed(lens, hq, hkv, d, dtype, seed=d)
    out = attention(q, k, v, cu, max(lens), causal)
    ref = reference_attention(q, k, v, lens, causal, d ** -0.5)
    assert (out.float() - ref).abs().max().item() < 2e-2


@pytest.mark.gpu
@needs_cuda
def test_triton_engine_matches_torch_sdpa_engine_fp16_on_gpu(tiny_bert: Path) -> None:
    from wde import Engine

    texts = [f"sentence number {i} " * (1 + i % 7) for i in range(40)]
    outs = {}
    for name in ("torch_sdpa", "triton_varlen"):
        with Engine.from_workflow("bert", tiny_bert, attention={"name": name}, pooler=MEAN, dtype="float16",
                                  device="cuda") as engine:
            outs[name] = engine.embed(texts, normalize=False)
    assert np.abs(outs["triton_varlen"] - outs["torch_sdpa"]).max() < 1e-2
