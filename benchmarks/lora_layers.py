"""What per-request LoRA adapters cost one linear layer (docs/adapters.md "What it costs"): CPU time of a
`LoraLinear` over a packed batch with no adapter, one adapter on every token, and two adapters and the base model
mixed by sequence; and oneDNN's fused linear+GELU against the unfused layer that adapters need.

    python benchmarks/lora_layers.py [--tokens 2000] [--seq 40] [--in 384] [--out 1536] [--threads 1] [--repeats 30]

CPU time (`time.process_time`), so other jobs on a shared host disturb it less than wall time; still compare
lines of one run only.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
from torch import nn
from transformers.activations import GELUActivation

from wde.components.lora import _GROUPS, LoraGroups, LoraLinear
from wde.components.models.cpu_linear import PackedLinear, onednn_available, onednn_error


def cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    with torch.inference_mode():
        for _ in range(3):
            fn()
        start = time.process_time()
        for _ in range(repeats):
            fn()
    return (time.process_time() - start) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--seq", type=int, default=40, help="tokens per sequence (adapters alternate by sequence)")
    ap.add_argument("--in", dest="in_features", type=int, default=384)
    ap.add_argument("--out", dest="out_features", type=int, default=1536)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = nn.Linear(args.in_features, args.out_features)
    layer = LoraLinear(base)
    for slot, rank in ((1, 4), (2, 8)):
        layer.adapters[slot] = (torch.randn(rank, args.in_features), torch.randn(args.out_features, rank))
    x = torch.randn(args.tokens, args.in_features)
    sequence = torch.arange(args.tokens) // args.seq
    for label, ids in (("no adapter", None), ("one adapter, every token", torch.ones(args.tokens, dtype=torch.long)),
                       ("two adapters + base, by sequence", sequence % 3)):
        _GROUPS.set(LoraGroups.of(ids))
        print(f"LoraLinear, {label:34s} {cpu_ms(lambda: layer(x), args.repeats):8.2f} ms")
    _GROUPS.set(None)
    if onednn_available() and onednn_error(torch.float32) is None:
        act = GELUActivation()
        fused = PackedLinear(base, args.tokens, ("gelu", "none"))
        plain = PackedLinear(base, args.tokens)
        print(f"oneDNN linear with fused GELU                 {cpu_ms(lambda: fused(x), args.repeats):8.2f} ms")
        print(f"oneDNN linear, then GELU (with adapters)      {cpu_ms(lambda: act(plain(x)), args.repeats):8.2f} ms")


if __name__ == "__main__":
    main()
