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

With gcc present it also measures the CPU's raw AVX2 FMA peak, to show how close the libraries get.

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

_FMA_C = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
int main(void) {
  const long iters = 100000000; double best = 0; float sink = 0;
  for (int rep = 0; rep < 3; rep++) {
    double t0 = omp_get_wtime();
    #pragma omp parallel reduction(+:sink)
    {
      __m256 b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
      __m256 a0 = _mm256_set1_ps(1.0f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
             a9 = a0;
      for (long i = 0; i < iters; i++) {
        a0 = _mm256_fmadd_ps(a0, b, c); a1 = _mm256_fmadd_ps(a1, b, c); a2 = _mm256_fmadd_ps(a2, b, c);
        a3 = _mm256_fmadd_ps(a3, b, c); a4 = _mm256_fmadd_ps(a4, b, c); a5 = _mm256_fmadd_ps(a5, b, c);
        a6 = _mm256_fmadd_ps(a6, b, c); a7 = _mm256_fmadd_ps(a7, b, c); a8 = _mm256_fmadd_ps(a8, b, c);
        a9 = _mm256_fmadd_ps(a9, b, c);
      }
      a0 = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                         _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)),
                                       _mm256_add_ps(a8, a9)));
      sink += _mm256_cvtss_f32(a0);
    }
    double flops = (double)iters * 10 * 16 * omp_get_max_threads();
    double rate = flops / (omp_get_wtime() - t0) / 1e9;
    if (rate > best) best = rate;
  }
  printf("%f %f\n", best, sink);
  return 0;
}
"""


def fma_peak_gflops(threads: int) -> float | None:
    """The CPU's fp32 FMA throughput on 256-bit registers (10 independent chains per thread), or None."""
    gcc = shutil.which("gcc")
    if gcc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "fma.c", Path(tmp) / "fma"
        src.write_text(_FMA_C)
        built = subprocess.run([gcc, "-O2", "-mavx2", "-mfma", "-fopenmp", str(src), "-o", str(exe)],
                               capture_output=True)
        if built.returncode != 0:
            return None
        out = subprocess.run([str(exe)], capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        return float(out.stdout.split()[0]) if out.returncode == 0 else None


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

    from wde.model_source import resolve_model_path

    path = resolve_model_path(args.model)
    cfg = AutoConfig.from_pretrained(path)
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    threads = torch.get_num_threads()
    print(f"machine: {os.cpu_count()} cpus, torch {torch.__version__} ({threads} threads), numpy {np.__version__}")
    peak = fma_peak_gflops(threads)
    print(f"AVX2 FMA peak: {peak:.0f} GFLOP/s" if peak else "AVX2 FMA peak: not measured (no gcc)")

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
    mkl_seconds = best_seconds = 0.0
    for k, n in ((h, 3 * h), (h, h), (h, inter), (inter, h)):
        rates = gemm_rates(args.tokens, k, n, args.rounds)
        print(f"{args.tokens:>8} x {k:>4} x {n:>4} " + " ".join(f"{rates.get(lib, 0):9.1f}" for lib in libs))
        mkl_seconds += 2 * k * n / rates["mkl"]
        best_seconds += 2 * k * n / max(rates.values())
    flops_per_token = layers * 2 * (4 * h * h + 2 * h * inter)
    best_rate = flops_per_token / layers / best_seconds  # one layer's FLOPs over its time at GFLOP/s rates
    library_gain = mkl_seconds / best_seconds
    print(f"linear layers: {flops_per_token / 1e6:.1f} MFLOP/token; fastest library per shape:"
          f" {best_rate:.0f} GFLOP/s" + (f" ({best_rate / peak:.0%} of the FMA peak)" if peak else "")
          + f", {library_gain:.2f}x MKL's time")
    print(f"largest possible offline ratio vs sentence-transformers: {same_gemm_bound:.2f}x with its GEMMs,"
          f" {same_gemm_bound * library_gain:.2f}x with the fastest isolated library per shape (issue goal 1.5x)")

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
