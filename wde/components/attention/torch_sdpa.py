"""Varlen attention with `torch.nn.functional.scaled_dot_product_attention`, on any device.

SDPA has no varlen entry point, so the packed tokens are scattered into a [seqs, heads, max_len, dim] block
once per layer and masked. Only attention pays for the padding; every other layer works on packed tokens.
When all sequences have the same length no mask is needed and the fast kernels apply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wde.components.attention.base import AttentionBackend, AttentionMetadata
from wde.components.model_input_builder import ModelInput


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"

    def build_metadata(self, batch: ModelInput, causal: bool) -> AttentionMetadata:
        meta = super().build_metadata(batch, causal)
        n, lmax = batch.num_seqs, batch.max_seqlen
        device = batch.input_ids.device
        if all(length == lmax for length in batch.seq_lens):
            meta.extra = (None, None)
            return meta
        lens = torch.tensor(batch.seq_lens, device=device)
        seq_idx = torch.repeat_interleave(torch.arange(n, device=device), lens)
        flat_index = seq_idx * lmax + batch.positions
        valid = torch.arange(lmax, device=device)[None, :] < lens[:, None]
        mask = valid[:, None, None, :]
        if causal:
            mask = mask & torch.ones(lmax, lmax, dtype=torch.bool, device=device).tril()[None, None]
        meta.extra = (flat_index, mask)
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        t, hq, d = q.shape
        hkv = k.shape[1]
        n, lmax = len(meta.seq_lens), meta.max_seqlen
        flat_index, mask = meta.extra
        gqa = hq != hkv

        def block(x: torch.Tensor) -> torch.Tensor:
            h = x.shape[1]
            if flat_index is None:
                return x.view(n, lmax, h, d).transpose(1, 2)
            out = x.new_zeros(n * lmax, h, d)
            out.index_copy_(0, flat_index, x)
            return out.view(n, lmax, h, d).transpose(1, 2)

        qb, kb, vb = block(q), block(k), block(v)
        if gqa:
            kb = kb.repeat_interleave(hq // hkv, dim=1)
            vb = vb.repeat_interleave(hq // hkv, dim=1)
        if mask is None:
            ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=meta.causal, scale=scale)
        else:
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
        ob = ob.transpose(1, 2).reshape(n * lmax, hq, d)
        return ob if flat_index is None else ob.index_select(0, flat_index)
