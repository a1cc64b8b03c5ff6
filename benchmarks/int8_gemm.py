"""int8 GEMM candidates against WDE's float linear paths on CPU, at MiniLM- and BERT-base-sized shapes.

Each candidate computes `x @ W.T + b` for a float32 `x` of ROWS tokens, quantization of the activations included
(what a model pays per linear layer), and its error against the float32 result is printed beside its rate:

- fp32 / bf16: oneDNN prepacked linear (`torch.ops.mkldnn._linear_pointwise`, what `cpu_linear: onednn` runs);
- qlinear/token: WDE's `Int8Linear` (wde/components/models/int8_linear.py): `torch.ops.onednn.qlinear_pointwise`
  (inductor's x86 int8 kernel) on activations quantized per token (symmetric, x_scale 1, shifted to u8 with zero
  point 128: s8 activations took a reference path at 0.1 GOP/s on the Zen 5), its fp32 output scaled per row
  afterwards; weights s8 per output channel;
- qlinear/tensor: the same kernel on u8 activations quantized per tensor (asymmetric, inductor's dynamic recipe);
- int_mm/token: `torch._int_mm` (s8 x s8 -> s32) then both scales;
- ao dynamic: `torch.ops.quantized.linear_dynamic` (the `torch.ao.nn.quantized.dynamic.Linear` kernel), x86 engine,
  per-channel weights, per-tensor activations with reduce_range.

The rates are GOP/s (2*rows*in*out per call), the median of REPEATS alternated rounds, one thread (a CPU stream's
share). The host is shared with other work: read ratios, not absolutes. Run:
    python benchmarks/int8_gemm.py [--rows 1024] [--threads 1] [--repeats 7]

`--end-to-end MODEL` instead embeds `--texts` generated texts with WDE engines in float32, bfloat16 (mixed
precision, as the CPU default for bf16 runs) and int8 in one process, rounds alternated, and prints each one's
median tokens/s and the int8 vectors' min / mean cosine to float32.
"""

from __future__ import annotations

import argparse
import statistics
import time

import warnings

import torch

from wde.components.models.int8_linear import Int8Linear

SHAPES = {
    "MiniLM": [(384, 1152), (384, 384), (384, 1536), (1536, 384)],
    "BERT-base": [(768, 2304), (768, 768), (768, 3072), (3072, 768)],
}


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale.float()


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127
    return torch.round(x / scale).to(torch.int8), scale


def candidates(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> dict[str, object]:
    rows, (out_f, in_f) = x.shape[0], w.shape
    fns: dict[str, object] = {}
    packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    fns["fp32 onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
    wb, bb = w.bfloat16(), b.bfloat16()
    packed_bf = torch.ops.mkldnn._reorder_linear_weight(wb, rows)
    fns["bf16 onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(x.bfloat16(), packed_bf, bb, "none", [], "")
    qw, w_scale = quantize_weight(w)
    zero = torch.zeros(out_f, dtype=torch.int64)
    qpacked = torch.ops.onednn.qlinear_prepack(qw, [rows, in_f])

    linear = torch.nn.Linear(in_f, out_f)
    with torch.no_grad():
        linear.weight.copy_(w)
        linear.bias.copy_(b)
    int8 = Int8Linear(linear, rows)  # what quantization: int8 runs (without SmoothQuant's scales)
    fns["qlinear/token"] = lambda: int8(x)

    def qlinear_tensor():
        lo, hi = x.min().clamp(max=0), x.max().clamp(min=0)
        scale = float((hi - lo) / 255) or 1.0
        zp = int(torch.round(-lo / scale))
        qx = torch.clamp(torch.round(x / scale) + zp, 0, 255).to(torch.uint8)
        return torch.ops.onednn.qlinear_pointwise(qx, scale, zp, qpacked, w_scale, zero, b, 1.0, 0, torch.float32,
                                                  "none", [], "")

    fns["qlinear/tensor"] = qlinear_tensor
    qw_t = qw.t()  # _int_mm wants mat2 [in, out]: a transposed view of the row-major weight

    def int_mm_token():
        qx, s = quantize_tokens(x)
        return torch._int_mm(qx, qw_t).float().mul_(s).mul_(w_scale).add_(b)

    fns["int_mm/token"] = int_mm_token
    torch.backends.quantized.engine = "x86"
    ao_w = torch.quantize_per_channel(w, w_scale.double(), zero, 0, torch.qint8)
    ao_packed = torch.ops.quantized.linear_prepack(ao_w, b)
    fns["ao dynamic x86"] = lambda: torch.ops.quantized.linear_dynamic(x, ao_packed, True)
    return fns


def end_to_end(model: str, n_texts: int, repeats: int) -> None:
    import sys
    from pathlib import Path

    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.tiny_models import varied_texts
    from wde import Engine

    texts = varied_texts(n_texts, seed=11)
    engines = {"fp32": Engine.from_workflow(model=model),
               "bf16": Engine.from_workflow(model=model, dtype="bfloat16"),
               "int8": Engine.from_workflow(model=model, quantization="int8")}
    tokenizer = engines["fp32"].components["tokenizer"]
    tokens = sum(len(ids) for ids, _ in tokenizer.encode([__import__("wde.request").request.TextPrompt(t)
                                                           for t in texts], max_length=512))
    vectors = {n: np.asarray(e.embed(texts, truncate=True)) for n, e in engines.items()}  # warm-up, and fidelity
    rates: dict[str, list[float]] = {n: [] for n in engines}
    for _ in range(repeats):
        for n, e in engines.items():
            t = time.perf_counter()
            e.embed(texts, truncate=True)
            rates[n].append(tokens / (time.perf_counter() - t))
    ref = vectors["fp32"] / np.linalg.norm(vectors["fp32"], axis=1, keepdims=True)
    print(f"{model}: {n_texts} texts, {tokens} tokens, {torch.get_num_threads()} threads, median of {repeats}")
    for n in engines:
        v = vectors[n] / np.linalg.norm(vectors[n], axis=1, keepdims=True)
        cos = (v * ref).sum(1)
        med = statistics.median(rates[n])
        print(f"  {n}: {med:8.0f} tokens/s ({med / statistics.median(rates['fp32']):.2f}x fp32), min / mean cosine"
              f" to fp32 {cos.min():.5f} / {cos.mean():.5f}")
    for e in engines.values():
        e.close()


def main() -> None:
    warnings.filterwarnings("ignore", message=".*quantize_per_")
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=5, help="calls per timed sample")
    ap.add_argument("--end-to-end", metavar="MODEL", default=None, help="a model folder: time WDE engines instead")
    ap.add_argument("--texts", type=int, default=1000)
    args = ap.parse_args()
    if args.end_to_end:
        return end_to_end(args.end_to_end, args.texts, args.repeats)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, threads {args.threads},"
          f" rows {args.rows}; GOP/s median of {args.repeats} (max abs err vs fp32 / fp32 output max abs)")
    g = torch.Generator().manual_seed(0)
    for model, shapes in SHAPES.items():
        totals: dict[str, float] = {}
        ops_total = 0
        for in_f, out_f in shapes:
            x = torch.randn(args.rows, in_f, generator=g)
            w = torch.randn(out_f, in_f, generator=g) / in_f ** 0.5
            b = torch.randn(out_f, generator=g) * 0.1
            fns = candidates(x, w, b)
            ref = torch.nn.functional.linear(x.double(), w.double(), b.double()).float()
            errs = {n: float((f().float() - ref).abs().max() / ref.abs().max()) for n, f in fns.items()}
            samples: dict[str, list[float]] = {n: [] for n in fns}
            for _ in range(args.repeats):
                for n, f in fns.items():  # alternated: a busy neighbour slows every candidate alike
                    t = time.perf_counter()
                    for _ in range(args.calls):
                        f()
                    samples[n].append((time.perf_counter() - t) / args.calls)
            ops = 2 * args.rows * in_f * out_f
            ops_total += ops
            cells = []
            for n in fns:
                med = statistics.median(samples[n])
                totals[n] = totals.get(n, 0.0) + med
                cells.append(f"{n} {ops / med / 1e9:6.1f} ({errs[n]:.1e})")
            print(f"{model} {in_f}x{out_f}: " + " | ".join(cells))
        base = totals["fp32 onednn"]
        print(f"{model} all shapes: " + " | ".join(f"{n} {ops_total / t / 1e9:6.1f} GOP/s {base / t:4.2f}x fp32"
                                                   for n, t in totals.items()))


if __name__ == "__main__":
    main()
