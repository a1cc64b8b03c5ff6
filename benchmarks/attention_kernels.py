"""Attention micro-benchmark on packed variable-length batches: triton_varlen vs torch_sdpa (GPU only).

Both backends run exactly as the engine calls them (metadata built once, then `forward` timed), on shapes of
real encoder / decoder embedders. torch's own flash varlen kernel (`torch.nn.attention.varlen`) is shown as a
reference where this torch build has it. `pad%` is the share of the padded [seqs, max_len] block that
torch_sdpa computes on padding.

    python benchmarks/attention_kernels.py                       # fp16
    python benchmarks/attention_kernels.py --dtype bfloat16 --iters 50
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass(frozen=True)
class Case:
    name: str
    num_seqs: int
    min_len: int
    max_len: int
    hq: int
    hkv: int
    head_dim: int
    causal: bool


CASES = (
    Case("bert-base short", 256, 8, 64, 12, 12, 64, False),
    Case("bert-base mixed", 64, 16, 512, 12, 12, 64, False),
    Case("xlmr-large mixed", 64, 16, 512, 16, 16, 64, False),
    Case("qwen2-1.5b gqa", 16, 64, 2048, 12, 2, 128, True),
    Case("mistral-7b gqa", 8, 128, 4096, 32, 8, 128, True),
    Case("equal lengths", 32, 512, 512, 16, 16, 64, False),
)


def make_batch(case: Case, dtype: torch.dtype, seed: int):
    from wde.components.model_input_builder import ModelInput

    rng = random.Random(seed)
    lens = [rng.randint(case.min_len, case.max_len) for _ in range(case.num_seqs)]
    t = sum(lens)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(lens), 0, out=cu[1:])
    positions = torch.cat([torch.arange(n) for n in lens])
    batch = ModelInput(torch.zeros(t, dtype=torch.long), positions, cu, lens, max(lens)).to("cuda")
    q = torch.randn(t, case.hq, case.head_dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(t, case.hkv, case.head_dim, device="cuda", dtype=dtype) for _ in range(2))
    return batch, q, k, v


def backend(name: str, causal: bool):
    from wde.components.base import BuildContext
    from wde.registry import get_registry

    cls = get_registry().component("attention", name)
    ctx = BuildContext(SimpleNamespace(hf_config=None), "benchmark")
    return cls(cls.Params(causal=causal), ctx)


def torch_varlen(case: Case, batch, q, k, v) -> Callable[[], torch.Tensor] | None:
    """torch's flash varlen kernel, when this torch build and dtype support it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    window = (-1, 0) if case.causal else (-1, -1)

    def run() -> torch.Tensor:
        return varlen_attn(q, k, v, batch.cu_seqlens, batch.cu_seqlens, batch.max_seqlen, batch.max_seqlen,
                           window_size=window, enable_gqa=case.hq != case.hkv)
    try:
        run()
    except (RuntimeError, TypeError, ValueError):
        return None
    return run


def time_ms(fn: Callable[[], torch.Tensor], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("attention_kernels: no CUDA device; this benchmark times GPU kernels only. Nothing to do.")
        return 0
    dtype = getattr(torch, args.dtype)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  dtype {args.dtype}  iters {args.iters}")
    head = (f"{'case':<18} {'seqs':>4} {'tokens':>7} {'pad%':>5} {'Hq/Hkv':>6} {'D':>4} {'mask':>6} "
            f"{'triton ms':>9} {'sdpa ms':>9} {'speedup':>7} {'flash ms':>9} {'max|diff|':>9}")
    print(head)
    print("-" * len(head))
    for case in CASES:
        batch, q, k, v = make_batch(case, dtype, args.seed)
        scale = case.head_dim ** -0.5
        timings, outs = {}, {}
        for name in ("triton_varlen", "torch_sdpa"):
            impl = backend(name, case.causal)
            meta = impl.build_metadata(batch, case.causal)
            fn = lambda impl=impl, meta=meta: impl.forward(q, k, v, meta, scale)  # noqa: E731
            outs[name] = fn()
            timings[name] = time_ms(fn, args.warmup, args.iters)
        flash = torch_varlen(case, batch, q, k, v)
        flash_ms = f"{time_ms(flash, args.warmup, args.iters):9.3f}" if flash else f"{'n/a':>9}"
        diff = (outs["triton_varlen"].float() - outs["torch_sdpa"].float()).abs().max().item()
        tokens = batch.num_tokens
        pad = 100 * (1 - tokens / (batch.num_seqs * batch.max_seqlen))
        print(f"{case.name:<18} {case.num_seqs:>4} {tokens:>7} {pad:>5.1f} {f'{case.hq}/{case.hkv}':>6} "
              f"{case.head_dim:>4} {'causal' if case.causal else 'bidir':>6} {timings['triton_varlen']:>9.3f} "
              f"{timings['torch_sdpa']:>9.3f} {timings['torch_sdpa'] / timings['triton_varlen']:>6.2f}x "
              f"{flash_ms} {diff:>9.2e}")
        del batch, q, k, v, outs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
