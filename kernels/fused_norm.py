"""Residual add fused with LayerNorm or RMSNorm: one read of x and residual, one write of each result.

Post-norm encoders (BERT) want `norm(x + residual)`; pre-norm decoders (Llama, Qwen2) also need the sum
itself as the next residual, so it can be stored too. The sum is rounded to the input dtype before the
statistics are taken, as an unfused model in that dtype would; statistics and the affine step are fp32.
One program per row; rows up to MAX_COLS wide fit one block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from wde.kernels import check_device

MAX_COLS = 16384
INTERPRETED = bool(triton.knobs.runtime.interpret)
"""Whether the kernel below was defined for triton's CPU interpreter (fixed when this module is imported)."""


@triton.jit
def _add_norm_kernel(x_ptr, r_ptr, w_ptr, b_ptr, o_ptr, s_ptr, stride_x, stride_r, stride_o, stride_s, ncols, eps,
                     RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                     STORE_SUM: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < ncols
    x = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(r_ptr + row * stride_r + cols, mask=valid, other=0.0).to(tl.float32))
        x = x.to(s_ptr.dtype.element_ty)
        if STORE_SUM:
            tl.store(s_ptr + row * stride_s + cols, x, mask=valid)
    x = x.to(tl.float32)
    if RMS:
        centered = x
    else:
        centered = tl.where(valid, x - tl.sum(x, 0) / ncols, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, 0) / ncols + eps)
    y = centered * rstd * tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * stride_o + cols, y.to(o_ptr.dtype.element_ty), mask=valid)


def _add_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
              eps: float, rms: bool, store_sum: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    c = x.shape[-1]
    if c > MAX_COLS:
        raise ValueError(f"fused norm supports rows up to {MAX_COLS} wide, got {c}")
    if weight.shape != (c,) or (bias is not None and bias.shape != (c,)):
        raise ValueError(f"weight/bias must have shape ({c},)")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from x {tuple(x.shape)}")
    tensors = [t for t in (x, residual, weight, bias) if t is not None]
    check_device(INTERPRETED, *tensors)
    rows = x.reshape(-1, c).contiguous()
    res = residual.reshape(-1, c).contiguous() if residual is not None else rows
    out = torch.empty_like(rows)
    summed = torch.empty_like(rows) if store_sum and residual is not None else out
    if rows.shape[0] and c:
        block = triton.next_power_of_2(c)
        _add_norm_kernel[(rows.shape[0],)](
            rows, res, weight, bias if bias is not None else weight, out, summed,
            rows.stride(0), res.stride(0), out.stride(0), summed.stride(0), c, eps,
            RMS=rms, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
            STORE_SUM=store_sum and residual is not None, BLOCK=block,
            num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16)
    return out.view(x.shape), (summed.view(x.shape) if store_sum and residual is not None else None)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                   eps: float = 1e-5) -> torch.Tensor:
    """`layer_norm(x + residual)` over the last dim (residual None: plain LayerNorm)."""
    return _add_norm(x, residual, weight, bias, eps, rms=False, store_sum=False)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-norm step: returns (`rms_norm(x + residual) * weight`, `x + residual`) for the next residual."""
    out, summed = _add_norm(x, residual, weight, None, eps, rms=True, store_sum=True)
    return out, summed if summed is not None else x
