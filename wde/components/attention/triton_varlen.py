"""Varlen attention with the Triton kernel in `wde.kernels.varlen_attention`: no padding, no mask tensors.

The kernel reads `cu_seqlens` (and an additive bias, when the model gives one, and the batch's key mask, when it
has one) directly, so metadata is what the base class builds. The kernel module is
imported when the backend is built, not when wde is imported: whether triton compiles a kernel for the GPU or runs it in its CPU interpreter is fixed when the kernel is defined, and a test that sets
`TRITON_INTERPRET=1` must get to do so first.

Without CUDA and without the interpreter the backend refuses to build rather than silently falling back to
torch: a workflow that names `triton_varlen` should run the Triton kernel or say why it cannot. A model placed
on CPU while CUDA exists is caught by the kernel wrapper on the first forward, with the same advice.
"""

from __future__ import annotations

from types import ModuleType

import torch

from wde.components.attention.base import AttentionBackend, AttentionMetadata, AttentionParams
from wde.components.base import BuildContext
from wde.errors import ModelLoadError

HOW_TO_FIX = ("use attention: {name: torch_sdpa}, or set TRITON_INTERPRET=1 in the environment before the process "
              "starts to run the kernel in triton's CPU interpreter (very slow; for tests)")


class TritonVarlenBackend(AttentionBackend):
    name = "triton_varlen"
    supports_bias = True
    supports_window = True
    supports_key_mask = True

    def __init__(self, params: AttentionParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        from wde.kernels import varlen_attention

        self._kernels: ModuleType = varlen_attention
        if not varlen_attention.INTERPRETED and not torch.cuda.is_available():
            raise ModelLoadError(f"attention 'triton_varlen' needs a CUDA device; {HOW_TO_FIX}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        return self._kernels.varlen_attention(q, k, v, meta.cu_seqlens, meta.max_seqlen, meta.causal, scale,
                                              bias=meta.bias, window=meta.window, key_mask=meta.key_mask)
