"""Flash-attention-style forward over packed variable-length sequences.

Sequence i owns rows `cu_seqlens[i]:cu_seqlens[i+1]` of q/k/v, so no padding is ever materialised: each
program handles one (query block, sequence, query head) and streams the key/value blocks of its own sequence
with an online softmax, accumulating in fp32. GQA maps query head h to key/value head h // (Hq // Hkv).
Programs whose query block starts past the end of their sequence exit at once; that waste is bounded by the
grid being sized by the longest sequence.

An optional additive bias (e.g. T5's relative position bias) is read per tile from a `[heads, L, L]` tensor
shared by all sequences or a `[num_seqs, heads, L, L]` one (positions counted within each sequence) and added
to the scaled scores before the online softmax.

An optional local-attention window (left, right) limits each query to the keys within `left` before and `right`
after it: a program streams only the key blocks its rows can reach, so the work is O(length x window).

An optional key mask (boolean [T], True where a token may be attended to) is read per key block alongside the
keys: masked keys get -inf before the softmax, as out-of-range keys do. A query left with no key outputs zeros.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from wde.kernels import check_device

LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E)
MAX_HEAD_DIM = 128
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPRETED = bool(triton.knobs.runtime.interpret)
"""Whether the kernels below were defined for triton's CPU interpreter (fixed when this module is imported)."""


@triton.jit
def _varlen_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, bias_ptr, key_mask_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_bs, stride_bh, stride_bm, stride_bn,
    qk_scale, head_dim, group, win_left, win_right,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    start_m = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // group
    seq_start = tl.load(cu_ptr + seq).to(tl.int64)
    seq_len = (tl.load(cu_ptr + seq + 1).to(tl.int64) - seq_start).to(tl.int32)
    if start_m * BLOCK_M >= seq_len:
        return

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < seq_len
    d_valid = offs_d < head_dim

    q_rows = (seq_start + offs_m)[:, None]
    q = tl.load(q_ptr + q_rows * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_valid[:, None] & d_valid[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = k_ptr + seq_start * stride_kt + kv_head * stride_kh
    v_base = v_ptr + seq_start * stride_vt + kv_head * stride_vh
    b_base = bias_ptr + seq.to(tl.int64) * stride_bs + head * stride_bh + offs_m[:, None] * stride_bm

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    end_n = seq_len
    if CAUSAL:
        end_n = tl.minimum(seq_len, (start_m + 1) * BLOCK_M)
    begin_n = 0
    if HAS_WINDOW:
        end_n = tl.minimum(end_n, (start_m + 1) * BLOCK_M + win_right)
        begin_n = tl.maximum(start_m * BLOCK_M - win_left, 0) // BLOCK_N * BLOCK_N
    for start_n in range(begin_n, end_n, BLOCK_N):
        cols = start_n + offs_n
        n_valid = cols < seq_len
        k = tl.load(k_base + cols[None, :] * stride_kt + offs_d[:, None],
                    mask=n_valid[None, :] & d_valid[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        if HAS_BIAS:
            # Scores are in log2 units (qk_scale includes log2(e)), so the bias is too.
            b = tl.load(b_base + cols[None, :] * stride_bn, mask=m_valid[:, None] & n_valid[None, :], other=0.0)
            s += b.to(tl.float32) * LOG2E_C
        keep = n_valid[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None])
        if HAS_WINDOW:
            keep = keep & (cols[None, :] >= offs_m[:, None] - win_left) & (cols[None, :] <= offs_m[:, None] + win_right)
        if HAS_KEY_MASK:
            keep = keep & (tl.load(key_mask_ptr + seq_start + cols, mask=n_valid, other=0) != 0)[None, :]
        s = tl.where(keep, s, float("-inf"))
        # Rows past seq_len see no valid key; a finite floor keeps their exp2 at 0 instead of NaN.
        m_new = tl.maximum(tl.maximum(m_i, tl.max(s, 1)), -1e30)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :],
                    mask=n_valid[:, None] & d_valid[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if HAS_KEY_MASK:  # a row whose every key is masked has acc 0 and l_i 0: divide by 1 to output zeros, not NaN
        l_i = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(o_ptr + q_rows * stride_ot + head * stride_oh + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=m_valid[:, None] & d_valid[None, :])


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q/k/v must be [tokens, heads, head_dim], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    t, hq, d = q.shape
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k and v must be [{t}, Hkv, {d}], got {tuple(k.shape)} and {tuple(v.shape)}")
    if hq % k.shape[1]:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({k.shape[1]})")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {d} exceeds the supported maximum of {MAX_HEAD_DIM}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q/k/v must share one dtype among {DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError("cu_seqlens must be a 1-D int32/int64 tensor of num_seqs + 1 offsets")
    check_device(INTERPRETED, q, k, v, cu_seqlens)


def _check_bias(bias: torch.Tensor, q: torch.Tensor, num_seqs: int, max_seqlen: int) -> None:
    hq = q.shape[1]
    if bias.dim() not in (3, 4) or bias.shape[-3] != hq:
        raise ValueError(f"bias must be [{hq}, L, L] or [num_seqs, {hq}, L, L], got {tuple(bias.shape)}")
    if bias.dim() == 4 and bias.shape[0] != num_seqs:
        raise ValueError(f"per-sequence bias has {bias.shape[0]} rows for {num_seqs} sequences")
    if min(bias.shape[-2:]) < max_seqlen:
        raise ValueError(f"bias covers {tuple(bias.shape[-2:])} positions, max_seqlen is {max_seqlen}")
    if bias.dtype not in DTYPES:
        raise ValueError(f"bias dtype must be one of {DTYPES}, got {bias.dtype}")
    check_device(INTERPRETED, q, bias)


def _check_key_mask(key_mask: torch.Tensor, q: torch.Tensor) -> None:
    if key_mask.dtype != torch.bool or key_mask.dim() != 1 or key_mask.shape[0] != q.shape[0]:
        raise ValueError(f"key_mask must be a boolean [{q.shape[0]}] tensor, got {key_mask.dtype}"
                         f" {tuple(key_mask.shape)}")
    check_device(INTERPRETED, q, key_mask)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, causal: bool, scale: float | None = None,
                     bias: torch.Tensor | None = None, window: tuple[int, int] | None = None,
                     key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of packed q [T, Hq, D] over k/v [T, Hkv, D]; returns [T, Hq, D] in q's dtype.

    `bias`, if given, is added to the scaled scores: `[Hq, L, L]` shared by every sequence or
    `[num_seqs, Hq, L, L]`, with L >= max_seqlen and positions counted within each sequence. `window`, if given,
    is (left, right): the query at position i attends only the keys at i - left .. i + right. `key_mask`, if given,
    is boolean [T]: False marks a key no query attends; a query left with no key outputs zeros.

    Inputs may be strided views (e.g. slices of a fused qkv projection) as long as the last dim is contiguous.
    fp32 inputs use IEEE-precision dots (no TF32) so results match a float32 reference. Triton's interpreter
    multiplies bf16 dot operands wrongly (triton 3.9), so interpreted bf16 runs its dots in fp32.
    """
    _check(q, k, v, cu_seqlens)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    t, hq, d = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    num_seqs = cu_seqlens.shape[0] - 1
    if t == 0 or num_seqs == 0:
        return out
    if bias is not None:
        _check_bias(bias, q, num_seqs, max_seqlen)
        strides = (bias.stride(0) if bias.dim() == 4 else 0, *bias.stride()[-3:])
    else:
        strides = (0, 0, 0, 0)
    if key_mask is not None:
        _check_key_mask(key_mask, q)
        key_mask = key_mask.contiguous().view(torch.uint8)  # no copy: bool and uint8 share a layout
    if window is not None and (len(window) != 2 or min(window) < 0):
        raise ValueError(f"window must be (left, right) with both >= 0, got {window!r}")
    scale = d ** -0.5 if scale is None else scale
    block = max(16, min(64, triton.next_power_of_2(max_seqlen)))
    upcast = INTERPRETED and q.dtype == torch.bfloat16
    block_d = max(16, triton.next_power_of_2(d))
    # fp32 tiles at D=128 would need ~180 KB of shared memory with 64-wide key blocks (more than an A100 has).
    block_n = 32 if q.dtype == torch.float32 and block_d > 64 else block
    grid = (math.ceil(max_seqlen / block), num_seqs, hq)
    _varlen_fwd_kernel[grid](
        q, k, v, out, cu_seqlens, q if bias is None else bias, q if key_mask is None else key_mask,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        *strides,
        scale * LOG2E, d, hq // k.shape[1], *(window or (0, 0)),
        CAUSAL=bool(causal), HAS_BIAS=bias is not None, HAS_WINDOW=window is not None,
        HAS_KEY_MASK=key_mask is not None, PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast,
        BLOCK_M=block, BLOCK_N=min(block, block_n), BLOCK_D=block_d,
        num_warps=4 if block_d <= 64 else 8,
    )
    return out
