"""fp16 on GPU vs fp32 on CPU, for every bundled family (issue check: cosine >= 0.999).

Each family runs on a tiny random model built like the tests build them (tests/tiny_*.py), once on CPU in fp32
and once on CUDA in fp16 with each attention backend; per-output cosine similarity is reported. Vector outputs
(dense, colbert, per-token) compare row by row; scalar outputs (score) and per-label outputs (probs) compare
the vector across inputs. Exits 1 if any family falls below the threshold.

    python benchmarks/gpu_parity.py [--device cuda] [--dtype float16]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tests import tiny_decoders, tiny_heads, tiny_models  # noqa: E402
from wde import Engine, PoolingParams  # noqa: E402

TEXTS = tiny_models.varied_texts(64, seed=3)
TRUNCATE = PoolingParams(truncate=True)
PAIRS = [(" ".join(TEXTS[i].split()[:16]), TEXTS[(i * 7 + 3) % len(TEXTS)]) for i in range(len(TEXTS))]


def _cos_rows(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(a.shape[0], -1).astype(np.float64), b.reshape(b.shape[0], -1).astype(np.float64)
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-30)).min())


def _cos_flat(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def _sparse_vec(d: dict, vocab: int) -> np.ndarray:
    v = np.zeros(vocab)
    for k, w in d.items():
        v[int(k)] = w
    return v


def families(root: Path) -> list[tuple[str, Callable[[], Path], dict[str, Any], list, PoolingParams]]:
    """(workflow, model builder, workflow overrides, inputs, params)."""
    mean = {"pooler": {"params": {"pooling": "mean"}}}
    cls_ = {"pooler": {"params": {"pooling": "cls"}}}
    bert = lambda: tiny_models.build_bert(root / "bert")  # noqa: E731
    xlmr = lambda: tiny_models.build_xlmr(root / "xlmr")  # noqa: E731
    qwen_tok = tiny_decoders.qwen2_tokenizer(real=False)
    qwen3_tok = tiny_decoders.qwen3_tokenizer(real=False)
    return [
        ("bert", bert, mean, TEXTS, TRUNCATE),
        ("bge_v1_5", bert, {}, TEXTS, TRUNCATE),
        ("snowflake_arctic_embed", bert, {}, TEXTS, TRUNCATE),
        ("xlm_roberta", xlmr, cls_, TEXTS, TRUNCATE),
        ("snowflake_arctic_embed_l_v2", xlmr, {}, TEXTS, TRUNCATE),
        ("bge_m3", lambda: tiny_heads.build_bge_m3(root / "m3"), {}, TEXTS, PoolingParams(truncate=True, outputs=("dense", "sparse", "colbert"))),
        ("cross_encoder", lambda: tiny_heads.build_minilm_classifier(bert(), root / "ce", 1), {}, PAIRS, TRUNCATE),
        ("bge_reranker_v2_m3", lambda: tiny_heads.build_xlmr_classifier(root / "rr", 1), {}, PAIRS, TRUNCATE),
        ("sequence_classification", lambda: tiny_heads.build_minilm_classifier(bert(), root / "cls", 3), {}, TEXTS, TRUNCATE),
        ("xlm_roberta_sequence_classification", lambda: tiny_heads.build_xlmr_classifier(root / "xcls", 5), {}, TEXTS, TRUNCATE),
        ("gte_qwen2", lambda: tiny_decoders.build_qwen2(root / "qwen", qwen_tok), {}, TEXTS, TRUNCATE),
        ("e5_mistral", lambda: tiny_decoders.build_mistral(root / "mistral"), {}, TEXTS, TRUNCATE),
        ("qwen3_embedding", lambda: tiny_decoders.build_qwen3(root / "qwen3", qwen3_tok, causal_lm=True), {}, TEXTS, TRUNCATE),
        ("qwen3_reranker", lambda: tiny_decoders.build_qwen3(root / "qwen3-rr", qwen3_tok, causal_lm=True, tie_word_embeddings=True), {}, PAIRS, TRUNCATE),
        ("llm2vec", lambda: tiny_decoders.build_mistral(root / "mistral-bi"), {}, TEXTS, TRUNCATE),
        ("decoder_features", lambda: tiny_decoders.build_llama(root / "llama"), {}, TEXTS, TRUNCATE),
    ]


def compare(ref: list, got: list, vocab: int) -> dict[str, float]:
    out = {}
    for name in ref[0].outputs:
        r = [o.outputs[name] for o in ref]
        g = [o.outputs[name] for o in got]
        if name == "sparse":
            out[name] = min(_cos_flat(_sparse_vec(a, vocab), _sparse_vec(b, vocab)) for a, b in zip(r, g))
        elif np.ndim(r[0]) == 0 or name == "probs":
            out[name] = _cos_flat(np.stack(r), np.stack(g))
        elif np.ndim(r[0]) == 2:
            out[name] = min(_cos_rows(a, b) for a, b in zip(r, g))
        else:
            out[name] = _cos_rows(np.stack(r), np.stack(g))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--backends", default="torch_sdpa,triton_varlen")
    ap.add_argument("--threshold", type=float, default=0.999)
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: nothing to compare")
        return
    root = Path(tempfile.mkdtemp(prefix="wde-gpu-parity-"))
    worst = 1.0
    print(f"{'workflow':38} {'backend':14} min cosine per output ({args.dtype} {args.device} vs float32 cpu)")
    for workflow, build, overrides, inputs, params in families(root):
        path = build()
        with Engine.from_workflow(workflow, path, device="cpu", dtype="float32", **overrides) as cpu:
            ref = cpu.encode(inputs, params)
            vocab = cpu.tokenizer.vocab_size
        for backend in args.backends.split(","):
            with Engine.from_workflow(workflow, path, device=args.device, dtype=args.dtype,
                                      attention={"name": backend}, **overrides) as gpu:
                got = gpu.encode(inputs, params)
            scores = compare(ref, got, vocab)
            worst = min([worst, *scores.values()])
            shown = "  ".join(f"{k}={v:.6f}" for k, v in scores.items())
            print(f"{workflow:38} {backend:14} {shown}")
    print(f"worst cosine {worst:.6f} (threshold {args.threshold}): {'PASS' if worst >= args.threshold else 'FAIL'}")
    sys.exit(0 if worst >= args.threshold else 1)


if __name__ == "__main__":
    main()
