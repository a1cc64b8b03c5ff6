"""`auto`: the fastest attention backend that runs where the batch is.

CUDA batches go to the Triton varlen kernel (no padding at all; 2–12x faster than padded SDPA in
docs/benchmarks.md), everything else to `torch_sdpa`. The choice is made per batch from the tensors' device,
so a model placed on CPU on a machine with a GPU still works.
"""

from __future__ import annotations

import torch

from wde.components.attention.base import AttentionBackend, AttentionMetadata, AttentionParams
from wde.components.attention.torch_sdpa import TorchSDPABackend
from wde.components.base import BuildContext
from wde.components.model_input_builder import ModelInput


class AutoBackend(AttentionBackend):
    name = "auto"

    def __init__(self, params: AttentionParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self._cpu: AttentionBackend = TorchSDPABackend(params, ctx)
        self._cuda: AttentionBackend = self._cpu
        if torch.cuda.is_available():
            from wde.components.attention.triton_varlen import TritonVarlenBackend

            self._cuda = TritonVarlenBackend(params, ctx)

    def build_metadata(self, batch: ModelInput, causal: bool) -> AttentionMetadata:
        backend = self._cuda if batch.input_ids.is_cuda else self._cpu
        meta = backend.build_metadata(batch, causal)
        return AttentionMetadata(meta.cu_seqlens, meta.seq_lens, meta.max_seqlen, meta.causal, (backend, meta))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        backend, inner = meta.extra
        return backend.forward(q, k, v, inner, scale)
