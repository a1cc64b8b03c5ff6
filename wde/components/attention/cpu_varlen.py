"""`cpu_varlen`: varlen attention straight from the packed tensors, with no padding and no gather.

Sequence i's q/k/v are the rows `cu_seqlens[i]:cu_seqlens[i+1]` of the packed [tokens, heads, head_dim] tensors;
`narrow` + `view` + `transpose` turn them into the [1, heads, len, dim] shape SDPA takes without copying a byte
(SDPA's CPU kernel reads any strides). A run of adjacent sequences of one length is one call on an
[n, heads, len, dim] view. The only copy is the final `cat` of the outputs back into packed order.

With a local-attention window (`AttentionMetadata.window`), a sequence longer than the window is cut into query
blocks of `WINDOW_BLOCK` tokens, each attending only the keys its rows can reach (the block widened by the window
on each side) with a boolean mask of that size: O(length x window) work and memory, never length².

A key mask (`AttentionMetadata.key_mask`) stays a view too: a run's slice of it, viewed as [n, 1, 1, len], is the
boolean mask that broadcasts over the queries (combined with the causal mask or each window block's mask when
those are on, as SDPA takes no mask together with `is_causal`). Query rows it leaves with no key are zeroed.

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


def _key_masked_calls(key_mask: torch.Tensor, runs: list[tuple[int, int, int]], blocks: dict[int, list],
                      causal: bool) -> list[list[tuple]]:
    """For each run, its SDPA calls under a key mask: (query start, query end, key start, key end, boolean mask
    [n, 1, queries or 1, keys], the rows left with no key [n, 1, queries or 1, 1] or None when there are none)."""
    plans = []
    for start, n, length in runs:
        keys = key_mask.narrow(0, start, n * length).view(n, 1, 1, length)
        if length in blocks:
            spans = [(q0, q1, k0, k1, keys[..., k0:k1] & keep.to(keys.device))
                     for q0, q1, k0, k1, keep in blocks[length]]
        elif causal and length > 1:
            spans = [(0, length, 0, length, keys & window_keys(length, None, True, keys.device))]
        else:
            spans = [(0, length, 0, length, keys)]
        plan = []
        for q0, q1, k0, k1, mask in spans:
            dead = ~mask.any(-1, keepdim=True)
            plan.append((q0, q1, k0, k1, mask, dead if bool(dead.any()) else None))
        plans.append(plan)
    return plans


class CpuVarlenBackend(AttentionBackend):
    name = "cpu_varlen"
    supports_window = True
    supports_key_mask = True

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
        masks = None if batch.key_mask is None else _key_masked_calls(batch.key_mask, runs, blocks, causal)
        meta.extra = (runs, blocks, masks)
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        if getattr(meta, "bias", None) is not None:
            raise ValueError("attention 'cpu_varlen' does not support an additive attention bias; use attention:"
                             " {name: torch_sdpa} (or auto) for this model")
        hq, hk, d = q.shape[1], k.shape[1], q.shape[2]
        gqa = hk != hq
        runs, blocks, masks = meta.extra
        outs = []
        for r, (start, n, length) in enumerate(runs):
            rows = n * length
            qs = q.narrow(0, start, rows).view(n, length, hq, d).transpose(1, 2)
            ks = k.narrow(0, start, rows).view(n, length, hk, d).transpose(1, 2)
            vs = v.narrow(0, start, rows).view(n, length, hk, d).transpose(1, 2)
            if masks is not None:
                parts = []
                for q0, q1, k0, k1, mask, dead in masks[r]:
                    o = F.scaled_dot_product_attention(qs[:, :, q0:q1], ks[:, :, k0:k1], vs[:, :, k0:k1],
                                                       attn_mask=mask, scale=scale, enable_gqa=gqa)
                    parts.append(o if dead is None else o.masked_fill(dead, 0))
                o = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
            elif length in blocks:
                o = torch.cat([
                    F.scaled_dot_product_attention(qs[:, :, q0:q1], ks[:, :, k0:k1], vs[:, :, k0:k1],
                                                   attn_mask=keep.to(q.device), scale=scale, enable_gqa=gqa)
                    for q0, q1, k0, k1, keep in blocks[length]], dim=2)
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=meta.causal and length > 1, scale=scale,
                                                   enable_gqa=gqa)
            outs.append(o.transpose(1, 2).reshape(rows, hq, d))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
