"""Residual-add + norm steps that use the Triton kernels (`wde.kernels.fused_norm`) for CUDA tensors, and on CPU
(post-norm `add_layer_norm`) the C++ kernel of `kernels/cpu_ops.cpp`.

One kernel reads x and the residual once and writes the normalized result (and, for pre-norm blocks, the new
residual) instead of torch's add, reduce, scale and cast passes. On CPU it covers what float32, int8 and bf16
mixed-precision models pass it (x float32 or bfloat16, the residual and the norm's parameters float32: the result is
float32, as PyTorch's type promotion makes it); anything else, or a host where the kernel is not built, takes the
plain torch path. The Triton module is imported only at the first CUDA call, so importing wde never defines a
Triton kernel.
"""

from __future__ import annotations

import torch
from torch import nn


class AddNormLinear(nn.Module):
    """The contract of a linear layer with a path of its own for `norm(layer(x) + residual)` (BERT's post-norm after
    a projection, `linear_add_layer_norm`): `add_layer_norm(x, residual, norm)` returns what
    `add_layer_norm(layer(x), residual, norm)` would, to float32 rounding. `Int8Linear` implements it: its
    dequantizing pass is the norm's first pass."""

    def add_layer_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
        raise NotImplementedError


def linear_add_layer_norm(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor,
                          norm: nn.LayerNorm) -> torch.Tensor:
    """`norm(linear(x) + residual)`, through the layer's own path where it has one (`AddNormLinear`)."""
    if isinstance(linear, AddNormLinear):
        return linear.add_layer_norm(x, residual, norm)
    return add_layer_norm(linear(x), residual, norm)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """`norm(x + residual)` (BERT's post-norm)."""
    if x.is_cuda:
        from wde.kernels.fused_norm import add_layer_norm as fused

        return fused(x, residual, norm.weight, norm.bias, norm.eps)
    if cpu_fusable(x, residual, norm):
        from wde.kernels.cpp_build import cpu_ops

        kernel = cpu_ops()
        if kernel is not None:
            n = x.shape[-1]
            out = kernel.add_layer_norm(x.reshape(-1, n).contiguous(), residual.reshape(-1, n).contiguous(),
                                        norm.weight, norm.bias, norm.eps)
            return out.view(x.shape)
    return norm(x + residual)


def cpu_fusable(x: torch.Tensor, residual: torch.Tensor, norm: nn.LayerNorm) -> bool:
    """Whether `add_layer_norm`'s CPU kernel computes exactly what `norm(x + residual)` would here (inference)."""
    params = [p for p in (norm.weight, norm.bias) if p is not None]
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and residual.dtype == torch.float32
            and x.shape == residual.shape and x.dim() >= 1 and tuple(norm.normalized_shape) == (x.shape[-1],)
            and type(norm) is nn.LayerNorm and all(p.dtype == torch.float32 for p in params)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, residual, *params))))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(`rms_norm(x + residual) * weight`, `x + residual`): a pre-norm block's normed input and new residual.

    The torch path normalizes in float32 and scales in the input dtype, as the reference models do. `out_dtype`:
    the dtype the linear layer that takes the normed output casts it to (bfloat16 in a mixed-precision model, whose
    norms compute in float32); the output comes in it, the values that cast gives, and on CPU with storage for the
    rows a oneDNN layer pads it to (`padded_rows`), so that layer copies nothing.
    """
    if x.is_cuda:
        from wde.kernels.fused_norm import add_rms_norm as fused

        normed, h = fused(x, residual, weight, eps)
        return (normed if out_dtype is None else normed.to(out_dtype)), h
    if cpu_rms_fusable(x, residual, weight, out_dtype):
        from wde.kernels.cpp_build import cpu_ops

        kernel = cpu_ops()
        if kernel is not None:
            view = x.unsqueeze(1) if x.dim() == 2 else x
            rest = None if residual is None else residual.unsqueeze(1) if residual.dim() == 2 else residual
            capacity = 0 if out_dtype is None else _linear_rows(x.numel() // x.shape[-1])
            got = kernel.add_rms_norm(view, rest, weight, eps, out_dtype, capacity)
            return got[0].view(x.shape), (x if residual is None else got[1].view(x.shape))
    h = x if residual is None else x + residual
    hf = h.float()
    normed = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return (normed if out_dtype is None else normed.to(out_dtype)), h


def cpu_rms_fusable(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    out_dtype: torch.dtype | None = None) -> bool:
    """Whether `add_rms_norm`'s CPU kernel computes what its torch path would here: x 2-d or 3-d with its last
    dimension contiguous, float32 or bfloat16, the residual of x's shape and of x's dtype or float32, the weight
    float32 or bfloat16, the output in the promoted dtype or bfloat16 (inference)."""
    lowp = (torch.float32, torch.bfloat16)
    return (x.device.type == "cpu" and x.dtype in lowp and x.dim() in (2, 3) and x.stride(-1) == 1
            and weight.dtype in lowp and weight.dim() == 1 and weight.shape[0] == x.shape[-1]
            and out_dtype in (None, torch.bfloat16)
            and (residual is None or (residual.dtype in (x.dtype, torch.float32) and residual.shape == x.shape
                                      and residual.stride(-1) == 1))
            and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, residual, weight))))


def _linear_rows(rows: int) -> int:
    """How many rows a oneDNN linear layer pads an input of `rows` rows to (its one rule, in cpu_linear)."""
    from wde.components.models.cpu_linear import padded_rows

    return padded_rows(rows)


def silu_mul(gate_up: torch.Tensor, act: nn.Module) -> torch.Tensor:
    """`act(gate) * up` of a fused gate|up projection's output [rows, 2m] (SwiGLU, GeGLU): one pass in the C++ kernel
    on CPU where `act` is SiLU or the tanh GELU (Gemma's GeGLU), else the torch ops (an erf GELU among them: the
    kernel's erf loses the negative tail's relative accuracy). The kernel's output has storage for the
    rows the down projection pads it to (`padded_rows`), so a oneDNN layer takes it without a copy."""
    m = gate_up.shape[-1] // 2
    code = _gate_code(act)
    if (gate_up.device.type == "cpu" and code is not None and gate_up.dtype in (torch.float32, torch.bfloat16)
            and gate_up.stride(-1) == 1 and not (torch.is_grad_enabled() and gate_up.requires_grad)):
        from wde.kernels.cpp_build import cpu_ops

        kernel = cpu_ops()
        if kernel is not None:
            flat = gate_up.reshape(-1, 2 * m)
            return kernel.silu_mul(flat, _linear_rows(flat.shape[0]), code).view(*gate_up.shape[:-1], m)
    gate, up = gate_up.split(m, dim=-1)
    return act(gate) * up


def _gate_code(act: nn.Module) -> int | None:
    """The kernel's code for `act`: 0 SiLU, 2 tanh GELU; None for any other activation (torch runs it)."""
    if _is_silu(act):
        return 0
    from wde.components.models.cpu_linear import post_op_for

    op = post_op_for(act)
    return 2 if op == ("gelu", "tanh") else None


def _is_silu(act: nn.Module) -> bool:
    """torch's SiLU module, WDE's `activation("silu")`, or transformers' (`ACT2FN["silu"]`); all three call
    `nn.functional.silu`. Matched by name: importing either activations module here would be a cycle or slow."""
    kind = type(act)
    return kind is nn.SiLU or (kind.__name__ == "SiLUActivation"
                               and kind.__module__ in ("transformers.activations", "wde.components.models.activations"))


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Gemma's RMSNorm: `x * rsqrt(mean(x^2) + eps) * (1 + weight)` in float32, cast back to x's dtype (no rounding
    between the norm and the scale, unlike Llama's). `out_dtype` (bfloat16 or None): the dtype the linear layers
    taking the result cast it to, written in the norm's own pass (with storage for the rows a oneDNN layer pads
    to), which equals the cast after it: x's dtype is float32 or that dtype. One pass of `add_rms_norm`'s C++
    kernel on CPU."""
    target = x.dtype if out_dtype is None else out_dtype
    if target != x.dtype and x.dtype != torch.float32:  # rounded to x's dtype first, then cast
        return gemma_rms_norm(x, weight, eps).to(target)
    scale = 1.0 + weight.float()
    kernel_dtype = None if target == torch.float32 else target
    if cpu_rms_fusable(x, None, scale, kernel_dtype):
        from wde.kernels.cpp_build import cpu_ops

        kernel = cpu_ops()
        if kernel is not None:
            view = x.unsqueeze(1) if x.dim() == 2 else x
            capacity = 0 if out_dtype is None else _linear_rows(view.shape[0] * view.shape[1])
            return kernel.add_rms_norm(view, None, scale, eps, kernel_dtype, capacity, False)[0].view(x.shape)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(target)


def gemma_norm_add_norm(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, post_eps: float,
                        pre: torch.Tensor, pre_eps: float,
                        out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma 3's sandwich between blocks: `h = residual + gemma_rms_norm(x, post)`, then `gemma_rms_norm(h, pre)`
    (the next block's input norm, or the final one); returns (that, h). `out_dtype` as `add_rms_norm`'s: the dtype
    the linear layers taking the result cast it to. One pass of a C++ kernel over each row on CPU."""
    lowp = (torch.float32, torch.bfloat16)
    if (x.device.type == "cpu" and x.dtype in lowp and residual.dtype in (x.dtype, torch.float32)
            and x.shape == residual.shape and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous()
            and out_dtype in (None, torch.bfloat16) and post.shape == pre.shape == (x.shape[-1],)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, residual, post, pre)))):
        from wde.kernels.cpp_build import cpu_ops

        kernel = cpu_ops()
        if kernel is not None:
            capacity = 0 if out_dtype is None else _linear_rows(x.shape[0])
            out, h = kernel.norm_add_norm(x, residual, 1.0 + post.float(), 1.0 + pre.float(), post_eps, pre_eps,
                                          out_dtype, capacity)
            return out, h
    h = residual + gemma_rms_norm(x, post, post_eps)
    out = gemma_rms_norm(h, pre, pre_eps)
    return (out if out_dtype is None else out.to(out_dtype)), h


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """Row-wise L2 normalization (`F.normalize(x, dim=-1)`)."""
    if x.is_cuda:
        from wde.kernels.l2norm import l2_normalize as fused

        return fused(x)
    return nn.functional.normalize(x, dim=-1)
