"""`auto`: the fastest attention backend that runs where the batch is.

CUDA batches go to the Triton varlen kernel (no padding at all; 2–12x faster than padded SDPA in
docs/benchmarks.md). CPU batches go to `cpu_flash_varlen` (the whole packed batch in one C++ kernel call; faster
than `cpu_varlen` and `torch_sdpa` at every mean length measured, 16-512 tokens, in docs/benchmarks.md) where its
kernel is built for AVX-512 or AVX2 (`cpu_flash.prefer_cpu_flash`); elsewhere to `cpu_varlen` (per-sequence SDPA
on views of the packed tensors) when their sequences are long enough for it to win (`cpu_varlen.prefer_varlen`),
else to `torch_sdpa`. A batch with an additive bias stays on `torch_sdpa`. The choice is made per batch from the
tensors' device and lengths, so a model placed on CPU on a machine with a GPU still works.
"""

from __future__ import annotations

import torch

from wde.components.attention.base import AttentionBackend, AttentionMetadata, AttentionParams, Window
from wde.components.attention.cpu_flash import CpuFlashVarlenBackend, prefer_cpu_flash
from wde.components.attention.cpu_varlen import CpuVarlenBackend, prefer_varlen
from wde.components.attention.torch_sdpa import TorchSDPABackend, covering
from wde.components.base import BuildContext, Params
from wde.components.model_input_builder import ModelInput


class AutoBackend(AttentionBackend):
    name = "auto"
    supports_bias = True  # a biased batch goes to torch_sdpa (CPU) or triton_varlen (CUDA), which take one
    supports_window = True  # every backend it picks from takes a window
    supports_key_mask = True  # and a key mask

    @classmethod
    def cpu_kernels(cls, params: Params) -> tuple[str, ...]:
        return ("cpu_flash",)  # cpu_flash_varlen, its pick for CPU batches without a bias

    def __init__(self, params: AttentionParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self._cpu: AttentionBackend = TorchSDPABackend(params, ctx)
        self._cpu_varlen: AttentionBackend = CpuVarlenBackend(params, ctx)
        self._cpu_flash: AttentionBackend = CpuFlashVarlenBackend(params, ctx)
        self._cuda: AttentionBackend = self._cpu
        if torch.cuda.is_available():
            from wde.components.attention.triton_varlen import TritonVarlenBackend

            self._cuda = TritonVarlenBackend(params, ctx)

    def use_bf16_products(self) -> bool:
        self.bf16_products = self._cpu_flash.use_bf16_products()
        return self.bf16_products

    def build_metadata(self, batch: ModelInput, causal: bool, bias: torch.Tensor | None = None,
                       window: Window | None = None) -> AttentionMetadata:
        if batch.input_ids.is_cuda:
            backend = self._cuda
        elif bias is not None:  # neither varlen backend takes a bias
            backend = self._cpu
        elif prefer_cpu_flash(batch.seq_lens):
            backend = self._cpu_flash
        else:  # a window costs cpu_varlen no mask
            varlen = prefer_varlen(batch.seq_lens) or (window is not None and covering(window, batch.max_seqlen))
            backend = self._cpu_varlen if varlen else self._cpu
        meta = backend.build_metadata(batch, causal, bias, window)
        return AttentionMetadata(meta.cu_seqlens, meta.seq_lens, meta.max_seqlen, meta.causal, (backend, meta),
                                 bias=bias, window=window, positions=batch.positions, key_mask=meta.key_mask)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        backend, inner = meta.extra
        return backend.forward(q, k, v, inner, scale)
