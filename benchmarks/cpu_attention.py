"""CPU attention on packed batches: torch_sdpa, cpu_varlen, auto and cpu_flash_varlen, as the engine calls them.

Each backend builds its metadata once per batch and its `forward` is timed, on batches of about `--tokens` tokens of
random lengths around a mean (short texts ~20-40 tokens, long ~200-500), with the shapes of all-MiniLM-L6-v2
(12 heads x 32) and BERT base (12 x 64), or with `--model`, also head sizes the C++ kernel runs zero-padded
(SigLIP so400m's 16 x 72, CLIP ViT-H's 16 x 80). Repeats are interleaved across backends and the median is reported, so a
neighbour on a shared CPU slows every backend alike; the table says how fast each is against `torch_sdpa`.

    python benchmarks/cpu_attention.py                       # float32 and bfloat16
    python benchmarks/cpu_attention.py --dtype bfloat16 --repeats 15
    python benchmarks/cpu_attention.py --threads 1 --mean 16 --mean 128 --mean 512 --backend cpu_varlen \
        --backend cpu_flash_varlen                           # a sweep of mean lengths (each 0.6-1.4x the mean)
    python benchmarks/cpu_attention.py --model siglip-so400m --model clip-vit-h --mean 257 --mean 729 \
        --backend torch_sdpa --backend cpu_flash_varlen      # image towers' sequences

With `--threads 1` each call is timed in CPU time (`time.process_time`), which a neighbour on a shared CPU does not
inflate; with more threads, in wall time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wde.components.attention.auto import AutoBackend  # noqa: E402
from wde.components.attention.base import AttentionBackend, AttentionParams  # noqa: E402
from wde.components.attention.cpu_flash import CpuFlashVarlenBackend, load_kernel  # noqa: E402
from wde.components.attention.cpu_varlen import CpuVarlenBackend  # noqa: E402
from wde.components.attention.torch_sdpa import TorchSDPABackend  # noqa: E402
from wde.components.model_input_builder import ModelInput  # noqa: E402

MODELS = {"minilm": (12, 32), "bert-base": (12, 64),
          # head sizes the kernel runs zero-padded (to 96): google/siglip-so400m-patch14-384's towers (1152 / 16;
          # its 27 x 27 patches: --mean 729) and laion/CLIP-ViT-H-14's vision tower (1280 / 16; 257 tokens)
          "siglip-so400m": (16, 72), "clip-vit-h": (16, 80)}
DEFAULT_MODELS = ("minilm", "bert-base")
TEXTS = {"short": (20, 40), "long": (200, 500)}
BACKENDS = {"torch_sdpa": TorchSDPABackend, "cpu_varlen": CpuVarlenBackend, "auto": AutoBackend,
            "cpu_flash_varlen": CpuFlashVarlenBackend}


def backend(cls: type[AttentionBackend]) -> AttentionBackend:
    """A backend with default params, built without a model folder (`__init__` reads the model's config)."""
    b = cls.__new__(cls)
    b.params = AttentionParams()
    if cls is AutoBackend:  # auto's own members, as its __init__ makes them
        b._cpu, b._cpu_varlen = backend(TorchSDPABackend), backend(CpuVarlenBackend)
        b._cpu_flash = backend(CpuFlashVarlenBackend)
        b._cuda = b._cpu
    return b


def packed(lens: list[int]) -> ModelInput:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    positions = torch.cat([torch.arange(n) for n in lens])
    return ModelInput(torch.zeros(sum(lens), dtype=torch.long), positions, cu, lens, max(lens), None, [])


def lengths(lo: int, hi: int, tokens: int, rng: random.Random) -> list[int]:
    lens: list[int] = []
    while sum(lens) < tokens:
        lens.append(rng.randint(lo, hi))
    return lens


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", action="append", choices=["float32", "bfloat16"], help="default: both")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per packed batch")
    ap.add_argument("--repeats", type=int, default=9, help="interleaved timed calls of each backend")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--backend", action="append", choices=sorted(BACKENDS), help="default: all")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--model", action="append", choices=sorted(MODELS),
                    help=f"head shapes (default: {', '.join(DEFAULT_MODELS)})")
    ap.add_argument("--mean", type=int, action="append",
                    help="mean sequence lengths to sweep instead of short / long texts (lengths 0.6-1.4x the mean)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    texts_by_name = {f"~{m}": (max(1, m * 3 // 5), m * 7 // 5) for m in args.mean} if args.mean else TEXTS
    if load_kernel() is None:
        sys.exit("cpu_flash_varlen's kernel could not be built here (see the warning above)")
    names = args.backend or list(BACKENDS)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}, causal={args.causal}; "
          f"median of {args.repeats} interleaved calls ({'CPU' if clock is time.process_time else 'wall'} time)")
    print(f"{'dtype':9} {'model':13} {'texts':6} {'seqs':>5} " + " ".join(f"{n:>17}" for n in names))
    rng = random.Random(0)
    for dtype_name in args.dtype or ["float32", "bfloat16"]:
        dtype = getattr(torch, dtype_name)
        for model in args.model or DEFAULT_MODELS:
            heads, dim = MODELS[model]
            for texts, (lo, hi) in texts_by_name.items():
                lens = lengths(lo, hi, args.tokens, rng)
                batch = packed(lens)
                qkv = torch.randn(batch.num_tokens, 3 * heads, dim).to(dtype)
                q, k, v = qkv.split(heads, dim=1)  # strided views of one projection, as the models make them
                metas = {n: (b := backend(BACKENDS[n]), b.build_metadata(batch, args.causal)) for n in names}
                times: dict[str, list[float]] = {n: [] for n in names}
                for n, (b, meta) in metas.items():  # warm-up
                    b.forward(q, k, v, meta, dim ** -0.5)
                for _ in range(args.repeats):
                    for n, (b, meta) in metas.items():
                        t0 = clock()
                        b.forward(q, k, v, meta, dim ** -0.5)
                        times[n].append(clock() - t0)
                med = {n: statistics.median(t) for n, t in times.items()}
                base = med.get("torch_sdpa", next(iter(med.values())))
                cells = " ".join(f"{med[n] * 1e3:8.2f}ms {base / med[n]:5.2f}x" for n in names)
                print(f"{dtype_name:9} {model:13} {texts:6} {len(lens):5d} {cells}", flush=True)


if __name__ == "__main__":
    main()
