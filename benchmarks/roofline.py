"""How close a run comes to what the device can do: model FLOPs per token and the measured GEMM peak.

An encoder layer costs, per token, 2 FLOPs per weight of its linear layers (q, k, v, o, and the MLP) plus the
attention products (QK^T and PV: 4 x hidden x the sequence length the token attends over). The peak is the best
of a few large square matmuls in the run's dtype on the run's device, so "fraction of roofline" is achieved
FLOP/s over what this device's GEMM reaches, not over a datasheet number.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def flops_per_token(config: Any, mean_len: float) -> float:
    """Forward FLOPs per token of a BERT-style encoder or a decoder (GQA and gated MLPs counted as such)."""
    h = config.hidden_size
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    inter = config.intermediate_size
    gated = getattr(config, "model_type", "") in ("qwen2", "qwen3", "llama", "mistral")
    attn_weights = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2  # q, o + k, v
    mlp_weights = h * inter * (3 if gated else 2)
    attention = 4 * heads * head_dim * mean_len
    return layers * (2 * (attn_weights + mlp_weights) + attention)


def gemm_peak(device: str, dtype: torch.dtype, size: int | None = None, repeats: int = 5) -> float:
    """Best FLOP/s of a square matmul on `device` in `dtype` (4096 on a GPU, 1024 on a CPU)."""
    n = size or (4096 if device.startswith("cuda") else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        _sync(device)
        best = min(best, (time.perf_counter() - start) / 4)
    return 2 * n ** 3 / best


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
