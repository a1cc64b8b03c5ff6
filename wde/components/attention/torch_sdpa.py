"""Varlen attention with `torch.nn.functional.scaled_dot_product_attention`, on any device.

SDPA has no varlen entry point, so sequences are gathered into padded [seqs, heads, len, dim] blocks. To keep
the padding small, sequences are sorted by length and split into groups whose padded size stays within
`_MAX_WASTE` of their real size; each group is one SDPA call. Padding slots gather a real (finite) token and are
masked out as keys, so no block needs zero-filling. Only attention pays for padding; every other layer works on
packed tokens. A group whose sequences all have one length needs no mask, and the fast kernels apply.

An additive bias (`AttentionMetadata.bias`) becomes each group's float mask, built once per batch: the bias
sliced to the group's length (gathered per sequence when it is per-sequence), with padded keys and, when
causal, future keys set to -inf. A local-attention window (`AttentionMetadata.window`) is a boolean mask of the
group's length, built once per batch and layer kind (SDPA takes no window; `cpu_varlen` computes only the keys in
the window). A key mask (`AttentionMetadata.key_mask`) is gathered into each group's slots and folded into the
same boolean mask (and so into the bias's float mask); the query rows it leaves with no key are zeroed after SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from wde.components.attention.base import AttentionBackend, AttentionMetadata, Window, window_keys
from wde.components.model_input_builder import ModelInput

_MAX_WASTE = 1.25


@dataclass
class _Group:
    """Sequences attended together: `gather` fills the [n, lmax] block from packed tokens, `valid` picks the
    real slots back out of it; `mask` is boolean (padding / causal / window / key mask) or, with a bias, the float
    mask; `dead` ([n, lmax or 1, 1, 1]), when set, marks the query rows a key mask leaves with no key (zeroed)."""

    n: int
    lmax: int
    gather: torch.Tensor
    valid: torch.Tensor | None
    mask: torch.Tensor | None
    dead: torch.Tensor | None = None


def plan_groups(seq_lens: list[int], max_waste: float = _MAX_WASTE) -> list[list[int]]:
    """Sequence indices in groups of about one length, longest first, each group's padded size ([members x
    longest]) within `max_waste` of its real tokens."""
    order = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for i in order:
        lmax = seq_lens[current[0]] if current else seq_lens[i]
        if current and (len(current) + 1) * lmax > max_waste * (real + seq_lens[i]):
            groups.append(current)
            current, real = [], 0
        current.append(i)
        real += seq_lens[i]
    if current:
        groups.append(current)
    return groups


def _bias_mask(bias: torch.Tensor, members: list[int], lmax: int, keep: torch.Tensor | None) -> torch.Tensor:
    """A group's float mask [n or 1, heads, lmax, lmax]: the bias, -inf where `keep` says a key is not attended."""
    if bias.dim() == 4:
        mask = bias.index_select(0, torch.tensor(members, device=bias.device))[:, :, :lmax, :lmax]
    else:
        mask = bias[None, :, :lmax, :lmax]
    if keep is not None:
        mask = mask.masked_fill(~keep, float("-inf"))
    return mask.contiguous()


def covering(window: Window | None, max_seqlen: int) -> Window | None:
    """`window`, or None when it spans every sequence of the batch (then it changes nothing)."""
    if window is None or min(window) >= max_seqlen - 1:
        return None
    return window


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"
    supports_bias = True
    supports_window = True
    supports_key_mask = True

    def build_metadata(self, batch: ModelInput, causal: bool, bias: torch.Tensor | None = None,
                       window: Window | None = None) -> AttentionMetadata:
        meta = super().build_metadata(batch, causal, bias, window)
        lens = batch.seq_lens
        window = covering(window, batch.max_seqlen)
        key_mask = batch.key_mask
        if bias is None and window is None and key_mask is None and all(length == batch.max_seqlen for length in lens):
            meta.extra = None
            return meta
        starts = batch.cu_seqlens.tolist()
        device = batch.input_ids.device
        groups: list[_Group] = []
        token_order: list[torch.Tensor] = []
        for members in plan_groups(lens):
            lmax = lens[members[0]]
            gather, valid = [], []
            for slot, i in enumerate(members):
                gather.extend(range(starts[i], starts[i] + lens[i]))
                gather.extend([starts[i]] * (lmax - lens[i]))
                valid.extend(range(slot * lmax, slot * lmax + lens[i]))
            gather_t = torch.tensor(gather, device=device)
            g_lens = torch.tensor([lens[i] for i in members], device=device)
            padded = any(lens[i] != lmax for i in members)
            keep = None  # [n or 1, 1, lmax (queries) or 1, lmax (keys)]: which keys each query attends
            if padded:
                keep = (torch.arange(lmax, device=device)[None, :] < g_lens[:, None])[:, None, None, :]
            if key_mask is not None:
                keys = key_mask.index_select(0, gather_t).view(len(members), 1, 1, lmax)
                keep = keys if keep is None else keep & keys
            if window is not None or (causal and (keep is not None or bias is not None)):
                local = window_keys(lmax, window, causal, device)[None, None]
                keep = local if keep is None else keep & local
                if padded:  # a padded query row keeps every real key: no all-masked row (its output is dropped)
                    pad_rows = (torch.arange(lmax, device=device)[None, :] >= g_lens[:, None])[:, None, :, None]
                    keep = keep | (pad_rows & (torch.arange(lmax, device=device) < g_lens[:, None])[:, None, None, :])
            dead = None
            if key_mask is not None:
                dead = ~keep.any(-1, keepdim=True).transpose(1, 2)  # type: ignore[union-attr]
                dead = dead if bool(dead.any()) else None
            mask = _bias_mask(bias, members, lmax, keep) if bias is not None else keep
            groups.append(_Group(len(members), lmax, gather_t, torch.tensor(valid, device=device) if padded else None,
                                 mask, dead))
            token_order.append(torch.tensor([t for i in members for t in range(starts[i], starts[i] + lens[i])]))
        inverse = torch.empty(batch.num_tokens, dtype=torch.long)
        inverse[torch.cat(token_order)] = torch.arange(batch.num_tokens)
        meta.extra = (groups, inverse.to(device))
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        hq, d = q.shape[1], q.shape[2]
        rep = hq // k.shape[1]
        if meta.bias is not None and meta.bias.shape[-3] != hq:
            raise ValueError(f"attention bias has {meta.bias.shape[-3]} heads, the queries have {hq}")
        if meta.extra is None:
            n, lmax = len(meta.seq_lens), meta.max_seqlen
            return self._sdpa(q.view(n, lmax, hq, d), k.view(n, lmax, -1, d), v.view(n, lmax, -1, d),
                              None, meta.causal, scale, rep).reshape(n * lmax, hq, d)
        groups, inverse = meta.extra
        outs = []
        for g in groups:
            qb, kb, vb = (x.index_select(0, g.gather).view(g.n, g.lmax, -1, d) for x in (q, k, v))
            mask = g.mask if g.mask is None or g.mask.dtype == torch.bool else g.mask.to(q.dtype)
            ob = self._sdpa(qb, kb, vb, mask, meta.causal, scale, rep)
            if g.dead is not None:
                ob = ob.masked_fill(g.dead, 0)
            ob = ob.reshape(g.n * g.lmax, hq, d)
            outs.append(ob if g.valid is None else ob.index_select(0, g.valid))
        return torch.cat(outs).index_select(0, inverse)

    @staticmethod
    def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
              scale: float, rep: int) -> torch.Tensor:
        """q/k/v as [n, len, heads, dim]; returns [n, len, heads, dim]."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return o.transpose(1, 2)
