"""Mixed precision on CPU: linear layers in bfloat16 (or float16), the rest of the model in float32.

A model in pure bfloat16 rounds its residual stream and its norms to 8 bits of mantissa at every layer; on
all-MiniLM-L6-v2 that costs a min cosine of 0.99984 to the float32 vectors (sentence-transformers cast to bf16:
the same). Keeping the embeddings, the norms and the residual stream in float32, and running only the linear
layers (and what works on their outputs: the activation, attention) in the low dtype, is what `torch.autocast`
does; it gives 0.99992 on the same texts (docs/benchmarks.md). The GEMMs, where the time goes, stay in bf16.

How: the model is built in the low dtype, every module but `nn.Linear` is then moved to float32, and the
checkpoint loads into that (embeddings and norms straight from the file's values, never rounded to bf16 on the
way; the weights are never all float32 at once, so a 7B model loads in the memory of its bf16 linear layers plus
its float32 embeddings). Every `nn.Linear` then becomes a `CastLinear`, which casts its input to its weight's
dtype. The first elementwise op that meets the float32 residual (the add before each norm) promotes back to
float32, so model code needs no change beyond feeding attention one dtype. The model's output is cast to the low
dtype at the end, so poolers and heads see what a pure-dtype model gives them (`PrefillModel.dtype` stays the
user's dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CastLinear(nn.Linear):
    """`nn.Linear` whose input is cast to the weight's dtype first; the output is in that dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


def resolve_mixed_precision(choice: bool | str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on `device` in `dtype` runs mixed. auto: on for float16/bfloat16 on a CPU. Refused on other
    devices: their fused residual+norm kernels take one dtype, and fp16 there meets its cosine bound pure."""
    if choice == "auto":
        return device.type == "cpu" and dtype != torch.float32
    if choice and device.type != "cpu":
        raise ValueError(f"model.params.mixed_precision=true is supported on CPU only, the model is on {device}; "
                         "use mixed_precision: auto or false there")
    return bool(choice) and dtype != torch.float32


def float32_outside_linears(model: nn.Module) -> None:
    """Move the floating-point parameters and buffers of every module but `nn.Linear` to float32, in place."""
    for module in model.modules():
        if type(module) is nn.Linear:
            continue
        for tensors in (module._parameters, module._buffers):
            for name, t in tensors.items():
                if t is not None and t.is_floating_point() and t.dtype != torch.float32:
                    t.data = t.data.float()


def cast_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace every `nn.Linear` under `model` by a `CastLinear` with its parameters in `dtype` (the same tensors
    when they are in `dtype` already); returns how many."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                cast = CastLinear(child.in_features, child.out_features, bias=child.bias is not None,
                                  device="meta")
                cast.weight = nn.Parameter(child.weight.detach().to(dtype), child.weight.requires_grad)
                if child.bias is not None:
                    cast.bias = nn.Parameter(child.bias.detach().to(dtype), child.bias.requires_grad)
                for old, new in ((child.weight, cast.weight), (child.bias, cast.bias)):
                    if hasattr(old, "shard_offsets"):  # a fused projection's shards (LoRA adapters need them)
                        new.shard_offsets = old.shard_offsets  # type: ignore[union-attr]
                setattr(module, name, cast)
                count += 1
    return count
