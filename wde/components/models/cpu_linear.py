"""oneDNN linear layers with prepacked weights for CPU models (fp32 on AVX-512 hosts, bf16 on native-bf16 hosts).

PyTorch's CPU linear goes through MKL, which takes its AVX2 code path on some CPUs (AMD's among them) even where
AVX-512 is there; oneDNN with weights reordered once into its blocked layout runs the same fp32 GEMMs at over
twice the rate on such hosts (benchmarks/cpu_ceiling.py: 481 vs 206 GFLOP/s on a Zen 5; all-MiniLM-L6-v2
end to end 1.95x at a max abs diff of 3e-7). On AVX2-only hosts it measured no faster (0.98x), so `auto`
keeps PyTorch's path there. In bfloat16 (where the CPU has avx512_bf16 or AMX) the prepacked weights save
another ~1.2x over PyTorch's own bf16 linear.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from wde.device import cpu_flags, cpu_has_fast_bf16

CpuLinear = Literal["auto", "torch", "onednn"]


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def resolve_cpu_linear(choice: CpuLinear, device: torch.device, dtype: torch.dtype) -> Literal["torch", "onednn"]:
    """Which linear path a model uses. `onednn` only for float32 or bfloat16 on a CPU; `auto` picks it for
    float32 on AVX-512 hosts and for bfloat16 on hosts with native bfloat16."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or choice == "torch":
        return "torch"
    if choice == "onednn":
        if not onednn_available():
            raise ValueError("model.params.cpu_linear=onednn: this PyTorch build has no oneDNN (mkldnn)")
        return "onednn"
    pays = "avx512f" in cpu_flags() if dtype == torch.float32 else cpu_has_fast_bf16()
    return "onednn" if pays and onednn_available() else "torch"


class PackedLinear(nn.Module):
    """`nn.Linear`'s function with the weight reordered once for oneDNN (sized for `rows`-token batches; any
    number of rows works). Inference only: the packed weight is not a parameter."""

    def __init__(self, linear: nn.Linear, rows: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def pack_linears(model: nn.Module, rows: int) -> int:
    """Replace every `nn.Linear` under `model` with a `PackedLinear`; returns how many."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, PackedLinear(child, rows))
                count += 1
    return count
