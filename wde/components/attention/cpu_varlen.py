"""`cpu_varlen`: varlen attention straight from the packed tensors, with no padding and no gather.

Sequence i's q/k/v are the rows `cu_seqlens[i]:cu_seqlens[i+1]` of the packed [tokens, heads, head_dim] tensors;
`narrow` + `view` + `transpose` turn them into the [1, heads, len, dim] shape SDPA takes without copying a byte
(SDPA's CPU kernel reads any strides). A run of adjacent sequences of one length is one call on an
[n, heads, len, dim] view. The only copy is the final `cat` of the outputs back into packed order.

With a local-attention window (`AttentionMetadata.window`), a sequence longer than the window is cut into query
blocks of `WINDOW_BLOCK` tokens, each attending only the keys its rows can reach (the block widened by the window
on each side) with a boolean mask of that size: O(length x window) work and memory, never length².

Each call costs a fixed overhead, so this beats `torch_sdpa`'s padded groups on long sequences (no gather, no
mask, no padded FLOPs) and loses on many very short ones (one call per sequence); `auto` picks per batch with
`prefer_varlen` (docs/benchmarks.md has the measurements).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wde.components.attention.base import AttentionBackend, AttentionMetadata, Window, window_keys
from wde.components.attention.torch_sdpa import covering
from wde.components.model_input_builder import ModelInput

WINDOW_BLOCK = 128
"""Query rows computed together under a window: each block reads `WINDOW_BLOCK + left + right` keys at most."""

MIN_MEAN_LEN = 32
"""`auto` uses this backend on CPU for batches whose mean sequence length is at least this (measured crossover
with `torch_sdpa` on all-MiniLM-L6-v2: docs/benchmarks.md)."""


def prefer_varlen(seq_lens: list[int]) -> bool:
    """Whether a CPU batch with these lengths runs faster here than in `torch_sdpa`'s padded groups."""
    return sum(seq_lens) >= MIN_MEAN_LEN * len(seq_lens)


def plan_runs(seq_lens: list[int]) -> list[tuple[int, int, int]]:
    """(first token, sequences, length) for each run of adjacent sequences of one length."""
    runs: list[list[int]] = []
    start = 0
    for length in seq_lens:
        if runs and runs[-1][2] == length:
            runs[-1][1] += 1
        else:
            runs.append([start, 1, length])
        start += length
    return [(s, n, length) for s, n, length in runs]


def _block_masks(length: int, window: Window, causal: bool) -> list[tuple[int, int, int, int, torch.Tensor]]:
    """(query start, query end, key start, key end, boolean mask [queries, keys]) for each query block."""
    blocks = []
    for q0 in range(0, length, WINDOW_BLOCK):
        q1 = min(length, q0 + WINDOW_BLOCK)
        k0, k1 = max(0, q0 - window[0]), min(length, q1 + window[1])
        i = torch.arange(q0, q1)[:, None]
        j = torch.arange(k0, k1)[None, :]
        keep = (j >= i - window[0]) & (j <= i + window[1])
        if causal:
            keep = keep & (j <= i)
        blocks.append((q0, q1, k0, k1, keep))
    return blocks


class CpuVarlenBackend(AttentionBackend):
    name = "cpu_varlen"
    supports_window = True

    def build_metadata(self, batch: ModelInput, causal: bool, bias: torch.Tensor | None = None,
                       window: Window | None = None) -> AttentionMetadata:
        if bias is not None:  # supports_bias is False: models that need one refuse this backend at build time
            raise ValueError("attention 'cpu_varlen' does not support an additive attention bias; use attention:"
                             " {name: torch_sdpa} (or auto) for this model")
        meta = super().build_metadata(batch, causal, window=window)
        window = covering(window, batch.max_seqlen)
        runs = plan_runs(batch.seq_lens)
        blocks: dict[int, list] = {}
        if window is not None:
            for _, _, length in runs:
                if length > 1 and min(window) < length - 1 and length not in blocks:
                    blocks[length] = _block_masks(length, window, causal)
        meta.extra = (runs, blocks)
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        if getattr(meta, "bias", None) is not None:
            raise ValueError("attention 'cpu_varlen' does not support an additive attention bias; use attention:"
                             " {name: torch_sdpa} (or auto) for this model")
        hq, hk, d = q.shape[1], k.shape[1], q.shape[2]
        gqa = hk != hq
        runs, blocks = meta.extra
        outs = []
        for start, n, length in runs:
            rows = n * length
            qs = q.narrow(0, start, rows).view(n, length, hq, d).transpose(1, 2)
            ks = k.narrow(0, start, rows).view(n, length, hk, d).transpose(1, 2)
            vs = v.narrow(0, start, rows).view(n, length, hk, d).transpose(1, 2)
            if length in blocks:
                o = torch.cat([
                    F.scaled_dot_product_attention(qs[:, :, q0:q1], ks[:, :, k0:k1], vs[:, :, k0:k1],
                                                   attn_mask=keep.to(q.device), scale=scale, enable_gqa=gqa)
                    for q0, q1, k0, k1, keep in blocks[length]], dim=2)
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=meta.causal and length > 1, scale=scale,
                                                   enable_gqa=gqa)
            outs.append(o.transpose(1, 2).reshape(rows, hq, d))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
