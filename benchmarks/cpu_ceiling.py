"""How much faster than sentence-transformers can any engine embed with this model on this CPU? Measured.

An encoder's linear layers are a fixed amount of fp32 arithmetic per token: packing removes only the padding
the reference computes, batching cannot remove any of it. This script measures, in one process:

1. sentence-transformers on the workload under the profiler: wall time, the time its GEMMs (`aten::addmm`)
   take, and how much padding its length-sorted batches of 32 carry. An engine using the same GEMMs on the
   unpadded tokens still spends `gemm / padding` seconds, so `wall / (gemm / padding)` bounds its speedup even
   if attention, norms, activations, tokenization and Python cost nothing.
2. The GEMM shapes of the model with every fp32 library this Python reaches (MKL through `F.linear`, oneDNN
   with prepacked weights, OpenBLAS through numpy), timed alternately so machine noise hits all alike: how
   much a different library could add to that bound if its isolated speed carried over to a whole model
   (in the engine it did not; docs/benchmarks.md).
3. sentence-transformers one text at a time (a naive server's per-request work) against the GEMM-only cost of
   the same request, which bounds the serving ratio the same way.

It prints the CPU's SIMD extensions (AVX2, AVX-512, AMX) from its flags and, with gcc present, measures the raw
fp32 FMA peak of each one it has (AVX2, and AVX-512 where `avx512f` is set) and the bf16 dot-product peak where
`avx512_bf16` is set, to show how close the libraries get. On a CPU with native bf16 it also times the GEMMs
in bf16 (`--dtype bfloat16` is the fast path there; docs/benchmarks.md).

    python benchmarks/cpu_ceiling.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from workload import sentences  # noqa: E402

# One FMA loop for every ISA: CHAINS independent accumulators per thread (enough to cover the FMA latency on
# every pipe, few enough to stay in registers), FLOPS_PER_OP floating-point operations per instruction; the
# macros pick the registers. Each chain starts from a different value: identical chains are one computation to
# the compiler, and gcc -O2 merged the 10 identical chains of this script's first version into one dependent
# chain (one FMA per iteration counted as 10), so its "peak" measured FMA latency, not throughput.
_FMA_C = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
int main(void) {
  const long iters = ITERS; double best = 0; float sink = 0;
  for (int rep = 0; rep < 3; rep++) {
    double t0 = omp_get_wtime();
    #pragma omp parallel reduction(+:sink)
    {
      VEC b = SET_B, c = SET_C, a[CHAINS];
      for (int j = 0; j < CHAINS; j++) a[j] = SET_A(1.0f + 0.001f * j);
      for (long i = 0; i < iters; i++) {
        #pragma GCC unroll 32
        for (int j = 0; j < CHAINS; j++) a[j] = FMA(a[j], b, c);
      }
      for (int j = 1; j < CHAINS; j++) a[0] = ADD(a[0], a[j]);
      sink += FIRST(a[0]);
    }
    double flops = (double)iters * CHAINS * FLOPS_PER_OP * omp_get_max_threads();
    double rate = flops / (omp_get_wtime() - t0) / 1e9;
    if (rate > best) best = rate;
  }
  printf("%f %f\n", best, sink);
  return 0;
}
"""

# name -> (cpu flags it needs, gcc flags, macros). `avx512_bf16` counts vdpbf16ps: 16 lanes x 2 bf16 products
# x (multiply + add) = 64 FLOP per instruction, the rate a bf16 GEMM could reach. Chains: 12 of the 16 ymm
# registers for AVX2; AVX-512 has 32 zmm, and vdpbf16ps has a longer latency than vfmadd (20 chains measured
# 9% above 12 on Zen 5).
FMA_VARIANTS: dict[str, tuple[tuple[str, ...], tuple[str, ...], dict[str, str]]] = {
    "avx2": (("avx2", "fma"), ("-mavx2", "-mfma"), {
        "VEC": "__m256", "CHAINS": "12", "SET_A(x)": "_mm256_set1_ps(x)", "SET_B": "_mm256_set1_ps(0.999999f)",
        "SET_C": "_mm256_set1_ps(1e-7f)", "FMA(x,y,z)": "_mm256_fmadd_ps(x,y,z)", "ADD(x,y)": "_mm256_add_ps(x,y)",
        "FIRST(x)": "_mm256_cvtss_f32(x)", "FLOPS_PER_OP": "16"}),
    "avx512": (("avx512f",), ("-mavx512f",), {
        "VEC": "__m512", "CHAINS": "16", "SET_A(x)": "_mm512_set1_ps(x)", "SET_B": "_mm512_set1_ps(0.999999f)",
        "SET_C": "_mm512_set1_ps(1e-7f)", "FMA(x,y,z)": "_mm512_fmadd_ps(x,y,z)", "ADD(x,y)": "_mm512_add_ps(x,y)",
        "FIRST(x)": "_mm512_cvtss_f32(x)", "FLOPS_PER_OP": "32"}),
    "avx512_bf16": (("avx512f", "avx512_bf16"), ("-mavx512f", "-mavx512bf16"), {
        "VEC": "__m512", "CHAINS": "20", "SET_A(x)": "_mm512_set1_ps(x)",
        "SET_B": "(__m512)_mm512_set1_epi16((short)0x3f80)", "SET_C": "(__m512)_mm512_set1_epi16((short)0x3380)",
        "FMA(x,y,z)": "_mm512_dpbf16_ps(x,(__m512bh)(y),(__m512bh)(z))", "ADD(x,y)": "_mm512_add_ps(x,y)",
        "FIRST(x)": "_mm512_cvtss_f32(x)", "FLOPS_PER_OP": "64"}),
}


def isa_summary(flags: frozenset[str]) -> str:
    """The SIMD extensions that matter for GEMMs, from the cpu flags: AVX2/FMA, AVX-512 (and which parts), AMX."""
    parts = ["AVX2+FMA" if {"avx2", "fma"} <= flags else "AVX2: no" if "avx2" not in flags else "AVX2 (no FMA)"]
    avx512 = sorted(f for f in flags if f.startswith("avx512"))
    parts.append("AVX-512: " + (" ".join(avx512) if avx512 else "no"))
    amx = sorted(f for f in flags if f.startswith("amx"))
    parts.append("AMX: " + (" ".join(amx) if amx else "no"))
    return "; ".join(parts)


def compile_fma(variant: str, out_dir: Path, iters: int = 100_000_000) -> Path | None:
    """Build the FMA loop for one ISA with gcc (whatever this CPU runs); None when gcc is missing or fails."""
    gcc = shutil.which("gcc")
    if gcc is None:
        return None
    _, gcc_flags, macros = FMA_VARIANTS[variant]
    src, exe = out_dir / f"fma_{variant}.c", out_dir / f"fma_{variant}"
    src.write_text(_FMA_C)
    defines = [f"-D{k}={v}" for k, v in {**macros, "ITERS": str(iters)}.items()]
    built = subprocess.run([gcc, "-O2", *gcc_flags, "-fopenmp", *defines, str(src), "-o", str(exe)],
                           capture_output=True, text=True)
    return exe if built.returncode == 0 else None


def fma_peaks(threads: int, flags: frozenset[str]) -> dict[str, float | None]:
    """GFLOP/s of each FMA variant this CPU's flags allow (None: gcc missing or the build failed)."""
    peaks: dict[str, float | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant, (needs, _, _) in FMA_VARIANTS.items():
            if not set(needs) <= flags:
                continue
            exe = compile_fma(variant, Path(tmp))
            out = None if exe is None else subprocess.run(
                [str(exe)], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
            peaks[variant] = float(out.stdout.split()[0]) if out is not None and out.returncode == 0 else None
    return peaks


def best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_rates(m: int, k: int, n: int, rounds: int) -> dict[str, float]:
    """GFLOP/s of `x[m,k] @ w[n,k]^T + b` with each library: the best of `rounds` alternating rounds."""
    x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    fns: dict[str, Callable[[], object]] = {"mkl": lambda: F.linear(x, w, b)}
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
        fns["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
    xn, wt, bn, out = x.numpy(), np.ascontiguousarray(w.numpy().T), b.numpy(), np.empty((m, n), np.float32)
    fns["openblas"] = lambda: np.add(np.matmul(xn, wt, out=out), bn, out=out)
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], best_time(fn, 3))
    return {name: 2 * m * k * n / t / 1e9 for name, t in best.items()}


def bf16_gemm_rate(m: int, k: int, n: int, rounds: int) -> float:
    """GFLOP/s of the same linear layer with bf16 inputs and weights (`F.linear`, oneDNN on native-bf16 CPUs)."""
    x, w, b = (t.to(torch.bfloat16) for t in (torch.randn(m, k), torch.randn(n, k), torch.randn(n)))
    return 2 * m * k * n / min(best_time(lambda: F.linear(x, w, b), 3) for _ in range(rounds)) / 1e9


def profiled_encode(st: object, texts: list[str]) -> tuple[float, float]:
    """Wall seconds of `st.encode(texts)` and the seconds of it spent in GEMMs (`aten::addmm`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        st.encode(texts, batch_size=32)  # type: ignore[attr-defined]
        wall = time.perf_counter() - t0
    gemm = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key == "aten::addmm") / 1e6
    return wall, gemm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: bundled all-MiniLM-L6-v2)")
    ap.add_argument("--n", type=int, default=2000, help="sentences in the offline workload")
    ap.add_argument("--single", type=int, default=200, help="sentences embedded one at a time")
    ap.add_argument("--tokens", type=int, default=2048, help="GEMM rows (tokens in a batch)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from sentence_transformers import SentenceTransformer
    from transformers import AutoConfig

    from wde.device import cpu_flags, cpu_has_fast_bf16
    from wde.model_source import resolve_model_path

    path = resolve_model_path(args.model)
    cfg = AutoConfig.from_pretrained(path)
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    threads = torch.get_num_threads()
    print(f"machine: {os.cpu_count()} cpus, torch {torch.__version__} ({threads} threads), numpy {np.__version__}")
    flags = cpu_flags()
    print(f"ISA: {isa_summary(flags)}")
    peaks = fma_peaks(threads, flags)
    names = {"avx2": "AVX2 FMA fp32", "avx512": "AVX-512 FMA fp32", "avx512_bf16": "AVX512-BF16 dot product"}
    for variant, rate in peaks.items():
        print(f"{names[variant]} peak: " + (f"{rate:.0f} GFLOP/s" if rate else "not measured (gcc missing or failed)"))
    if not peaks:
        print("FMA peak: not measured (no AVX2/FMA in the cpu flags)")
    # the fp32 peak of the widest ISA present: what an fp32 GEMM library could use
    peak = peaks.get("avx512") or peaks.get("avx2")

    st = SentenceTransformer(str(path), device="cpu")
    texts = sentences(args.n)
    lens = [len(ids) for ids in st.tokenizer(texts, truncation=True, max_length=st.max_seq_length)["input_ids"]]
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    batches = [order[s:s + 32] for s in range(0, len(order), 32)]
    padding = sum(len(b) * max(lens[i] for i in b) for b in batches) / sum(lens)
    st.encode(texts[:256], batch_size=32)
    wall, gemm = profiled_encode(st, texts)
    same_gemm_bound = wall / (gemm / padding)
    print(f"sentence-transformers: {sum(lens) / wall:,.0f} tokens/s; GEMMs {gemm / wall:.0%} of its wall time;"
          f" its batches compute {padding:.3f}x the real tokens")
    print(f"  -> with the same GEMMs on unpadded tokens and everything else free: at most {same_gemm_bound:.2f}x")

    libs = ("mkl", "onednn", "openblas")
    print(f"{'GEMM (m x k x n)':>22} " + " ".join(f"{lib:>9}" for lib in libs) + "  GFLOP/s")
    mkl_seconds = best_seconds = bf16_seconds = 0.0
    bf16 = cpu_has_fast_bf16()
    for k, n in ((h, 3 * h), (h, h), (h, inter), (inter, h)):
        rates = gemm_rates(args.tokens, k, n, args.rounds)
        line = f"{args.tokens:>8} x {k:>4} x {n:>4} " + " ".join(f"{rates.get(lib, 0):9.1f}" for lib in libs)
        if bf16:
            rate16 = bf16_gemm_rate(args.tokens, k, n, args.rounds)
            bf16_seconds += 2 * k * n / rate16
            line += f"   bf16 {rate16:7.1f}"
        print(line)
        mkl_seconds += 2 * k * n / rates["mkl"]
        best_seconds += 2 * k * n / max(rates.values())
    flops_per_token = layers * 2 * (4 * h * h + 2 * h * inter)
    best_rate = flops_per_token / layers / best_seconds  # one layer's FLOPs over its time at GFLOP/s rates
    library_gain = mkl_seconds / best_seconds
    print(f"linear layers: {flops_per_token / 1e6:.1f} MFLOP/token; fastest library per shape:"
          f" {best_rate:.0f} GFLOP/s" + (f" ({best_rate / peak:.0%} of the fp32 FMA peak)" if peak else "")
          + f", {library_gain:.2f}x MKL's time")
    if bf16:
        bf16_rate = flops_per_token / layers / bf16_seconds
        bf16_peak = peaks.get("avx512_bf16")
        print(f"bf16 linear layers (native bf16 on this CPU): {bf16_rate:.0f} GFLOP/s"
              + (f" ({bf16_rate / bf16_peak:.0%} of the bf16 dot-product peak)" if bf16_peak else "")
              + f", {best_seconds / bf16_seconds:.2f}x the fastest fp32 library (bounds hold for fp32 only)")
    print(f"largest possible offline ratio vs sentence-transformers at its GEMM speed: {same_gemm_bound:.2f}x with"
          f" its GEMMs, {same_gemm_bound * library_gain:.2f}x with the fastest isolated library per shape (GEMMs"
          f" timed on all threads; WDE's CPU streams run smaller single-threaded GEMMs nearer the peak, so they can pass"
          f" this)")

    single_texts = texts[: args.single]
    single = best_time(lambda: [st.encode([t]) for t in single_texts], 2) / len(single_texts)
    gemm_per_token = gemm / padding / sum(lens) / library_gain
    floor = gemm_per_token * sum(lens[: args.single]) / args.single
    print(f"sentence-transformers one text at a time: {single * 1e3:.2f} ms/request; GEMM-only cost of the same"
          f" mean request: {floor * 1e3:.2f} ms")
    print(f"largest possible serving ratio vs a one-at-a-time server, before any HTTP cost and with the fastest"
          f" library: {single / floor:.2f}x (issue goal 5x)")


if __name__ == "__main__":
    main()
