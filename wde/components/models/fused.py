"""Residual-add + norm steps that use the Triton kernels (`wde.kernels.fused_norm`) for CUDA tensors.

One kernel reads x and the residual once and writes the normalized result (and, for pre-norm blocks, the new
residual) instead of torch's add, reduce, scale and cast passes. Other devices take the plain torch path, and
the kernel module is imported only at the first CUDA call, so importing wde never defines a Triton kernel.
"""

from __future__ import annotations

import torch
from torch import nn


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """`norm(x + residual)` (BERT's post-norm)."""
    if x.is_cuda:
        from wde.kernels.fused_norm import add_layer_norm as fused

        return fused(x, residual, norm.weight, norm.bias, norm.eps)
    return norm(x + residual)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(`rms_norm(x + residual) * weight`, `x + residual`): a pre-norm block's normed input and new residual.

    The torch path normalizes in float32 and scales in the input dtype, as the reference models do.
    """
    if x.is_cuda:
        from wde.kernels.fused_norm import add_rms_norm as fused

        return fused(x, residual, weight, eps)
    h = x if residual is None else x + residual
    hf = h.float()
    return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype), h


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """Row-wise L2 normalization (`F.normalize(x, dim=-1)`)."""
    if x.is_cuda:
        from wde.kernels.l2norm import l2_normalize as fused

        return fused(x)
    return nn.functional.normalize(x, dim=-1)
