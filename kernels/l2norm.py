"""Row-wise L2 normalisation, `x / max(||x||, eps)` like `torch.nn.functional.normalize(x, dim=-1)`.

One program per row, fp32 accumulation. Rows wider than one block are summed in chunks, then scaled in a
second pass, so any width works without a huge register tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from wde.kernels import check_device

MAX_BLOCK = 4096
INTERPRETED = bool(triton.knobs.runtime.interpret)
"""Whether the kernel below was defined for triton's CPU interpreter (fixed when this module is imported)."""


@triton.jit
def _l2norm_kernel(x_ptr, o_ptr, stride_x, stride_o, ncols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    sq = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, ncols, BLOCK):
        cols = start + offs
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < ncols, other=0.0).to(tl.float32)
        sq += x * x
    inv = 1.0 / tl.maximum(tl.sqrt(tl.sum(sq, 0)), eps)
    for start in range(0, ncols, BLOCK):
        cols = start + offs
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < ncols, other=0.0).to(tl.float32)
        tl.store(o_ptr + row * stride_o + cols, (x * inv).to(o_ptr.dtype.element_ty), mask=cols < ncols)


def l2_normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """L2-normalise the last dim of `x` (any leading shape); returns a new tensor in x's dtype."""
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"l2_normalize takes float32/float16/bfloat16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("l2_normalize needs at least one dimension")
    check_device(INTERPRETED, x)
    if x.numel() == 0:
        return torch.empty_like(x)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    n, c = rows.shape
    block = min(MAX_BLOCK, triton.next_power_of_2(c))
    _l2norm_kernel[(n,)](rows, out, rows.stride(0), out.stride(0), c, eps, BLOCK=block,
                         num_warps=4 if block <= 1024 else 8)
    return out.view(x.shape)
