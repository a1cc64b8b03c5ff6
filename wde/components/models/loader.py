"""A generic checkpoint loader driven by each model's `checkpoint_prefixes`, `checkpoint_name_mapping` and
`packed_modules_mapping` (all data on the model class, so the loader itself knows no family)."""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
from torch import nn

from wde.errors import ModelLoadError

_LEGACY = {".gamma": ".weight", ".beta": ".bias"}


def rename(name: str, renames: Mapping[str, str]) -> str:
    """Apply `renames` (dotted name parts → new dotted parts) in order, each at most once, matching whole parts
    only: `{"block": "encoder.layer"}` turns `block.0.wo.weight` into `encoder.layer.0.wo.weight` but leaves
    `blocks.0` alone."""
    dotted = f".{name}."
    for src, dst in renames.items():
        if f".{src}." in dotted:
            dotted = dotted.replace(f".{src}.", f".{dst}.", 1)
    return dotted[1:-1]


def _target_name(name: str, prefixes: tuple[str, ...], renames: Mapping[str, str]) -> str:
    for prefix in prefixes:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if renames:
        name = rename(name, renames)
    for old, new in _LEGACY.items():
        if name.endswith(old):
            name = name[: -len(old)] + new
    return name


def checkpoint_target(raw_name: str, prefixes: tuple[str, ...], packed: Mapping[str, tuple[str, int]],
                      renames: Mapping[str, str] | None = None) -> tuple[str, int | None]:
    """The parameter a checkpoint tensor `raw_name` loads into, and its shard of a fused parameter (None: the whole
    parameter), by `load_weights`' three steps. LoRA adapters map their module names through it too
    (wde/components/lora.py), so an adapter reaches exactly the layers its base weights load into."""
    name = _target_name(raw_name, prefixes, renames or {})
    for src, (dst, shard_id) in packed.items():
        if f".{src}." in f".{name}":
            return f".{name}".replace(f".{src}.", f".{dst}.", 1)[1:], shard_id
    return name, None


def load_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], prefixes: tuple[str, ...],
                 packed: dict[str, tuple[str, int]], renames: Mapping[str, str] | None = None) -> None:
    """Copy checkpoint tensors into `module`'s parameters; checkpoint tensors the module lacks are heads or
    buffers other components load (or nobody needs) and are skipped. Every parameter must be filled: the error
    names the unfilled parameters and the checkpoint tensors left unused (each with the name it was mapped to).

    A checkpoint name is mapped in three steps: the first matching prefix in `prefixes` is stripped, `renames`
    are applied (see `rename`), then `packed` maps a separate projection onto its shard of a fused parameter.

    A parameter fused from several checkpoint tensors has a `shard_offsets` attribute: shard id →
    (start, size) along dim 0.
    """
    params = dict(module.named_parameters())
    filled: dict[str, int] = {}
    unused: list[str] = []
    for raw_name, tensor in weights:
        name, shard = checkpoint_target(raw_name, prefixes, packed, renames)
        param = params.get(name)
        if param is None:
            unused.append(raw_name if name == raw_name else f"{raw_name} (as {name})")
            continue
        with torch.no_grad():
            if shard is None:
                if param.shape != tensor.shape:
                    raise ModelLoadError(f"{raw_name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
                param.copy_(tensor.to(param.dtype))
                filled[name] = len(getattr(param, "shard_offsets", {None: 0}))
            else:
                start, size = param.shard_offsets[shard]  # type: ignore[attr-defined]
                if tensor.shape[0] != size or tuple(tensor.shape[1:]) != tuple(param.shape[1:]):
                    raise ModelLoadError(f"{raw_name}: checkpoint shape {tuple(tensor.shape)} does not fit shard {shard} of {name}")
                param[start:start + size].copy_(tensor.to(param.dtype))
                filled[name] = filled.get(name, 0) + 1
    missing = [n for n, p in params.items() if filled.get(n, 0) < len(getattr(p, "shard_offsets", {None: 0}))]
    if missing:
        raise ModelLoadError(f"checkpoint lacks weights for {_shown(missing)}; checkpoint tensors left unused:"
                             f" {_shown(unused) if unused else 'none'} (a missing prefix or rename?)")


def _shown(names: list[str], at_most: int = 8) -> str:
    return ", ".join(names[:at_most]) + (f" and {len(names) - at_most} more" if len(names) > at_most else "")


def fused_linear(in_features: int, sizes: list[int], bias: bool) -> nn.Linear:
    """One Linear computing several projections at once (q|k|v or gate|up): one GEMM instead of several."""
    linear = nn.Linear(in_features, sum(sizes), bias=bias)
    offsets, start = {}, 0
    for i, size in enumerate(sizes):
        offsets[i] = (start, size)
        start += size
    linear.weight.shard_offsets = offsets  # type: ignore[attr-defined]
    if bias:
        linear.bias.shard_offsets = offsets  # type: ignore[attr-defined]
    return linear
