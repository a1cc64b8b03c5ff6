"""Offline embedding throughput: WDE vs sentence-transformers, side by side in one process.

Both embed the same generated workload with the same weights; tokens/s counts the real (unpadded) tokens of
the workload, so the figure is comparable. CPU default: the bundled all-MiniLM-L6-v2. GPU: a random-weight
model at real size (e.g. `--size xlmr-large`), since speed does not depend on weight values.

    python benchmarks/throughput.py                          # CPU, MiniLM, fp32
    python benchmarks/throughput.py --dtype bfloat16         # WDE in bf16 vs sentence-transformers in fp32
    python benchmarks/throughput.py --size xlmr-large --device cuda --dtype float16 --n 20000
    python benchmarks/throughput.py --size modernbert-base --n 300 --mean-words 200   # windows exercised on CPU
    python benchmarks/throughput.py --variant runner.params.cpu_streams=1   # also WDE with this setting, alternated
    python benchmarks/throughput.py --dtype bfloat16 --variant model.params.mixed_precision=false  # mixed vs pure bf16
    python benchmarks/throughput.py --images 500 --size clip-b32   # images/s: WDE vs transformers' CLIP pipeline
    python benchmarks/throughput.py --images 500 --model path/to/clip-vit-base-patch32

`--dtype` is WDE's dtype. sentence-transformers runs in `--st-dtype`: `auto` keeps it in float32 on CPU (the
baseline users run there) and in WDE's dtype on CUDA (same-precision speed comparison). The agreement lines (one
per WDE configuration) are always against float32 sentence-transformers vectors: when it ran in another dtype, an
extra float32 pass on the first `--agreement-n` sentences (not timed) gives them. The roofline line is WDE's
achieved FLOP/s (model FLOPs per token x tokens/s) over the best square-GEMM FLOP/s measured on the same device in
the same dtype (`roofline.py`).

`--images N` times images instead of sentences: N generated pictures (300-800 px a side, half JPEG, half PNG:
`image_workload.py`) as encoded bytes through `Engine.embed` against transformers' own pipeline on the same bytes,
decoded with Pillow, `CLIPImageProcessor` (PIL backend) and `CLIPModel.get_image_features` in batches of
`--st-batch-size`, and sentence-transformers' CLIP (its multimodal module) where it loads the folder. Images/s
counts decoding, preprocessing and the vision tower on every side; vectors are compared unnormalized.
`--size clip-b32` builds random weights at openai/clip-vit-base-patch32's shape (with a tiny tokenizer: only the
vision tower is timed).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from image_workload import images  # noqa: E402
from roofline import flops_per_token, gemm_peak  # noqa: E402
from workload import sentences  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

SIZES = {
    "bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "bert-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    "xlmr-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    # answerdotai/ModernBERT-base's shape: local attention (128) in two layers of three, GeGLU, rotary
    "modernbert-base": dict(hidden_size=768, num_hidden_layers=22, num_attention_heads=12, intermediate_size=1152,
                            global_attn_every_n_layers=3, local_attention=128, global_rope_theta=160000.0,
                            local_rope_theta=10000.0, norm_bias=False, attention_bias=False, mlp_bias=False),
    "qwen2-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       intermediate_size=8960),
}


CLIP_SIZES = {
    # openai/clip-vit-base-patch32's shape
    "clip-b32": dict(text=dict(vocab_size=49408, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                               num_attention_heads=8, max_position_embeddings=77),
                     vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                                 image_size=224, patch_size=32),
                     projection_dim=512),
}


def random_clip(size: str, out: Path) -> Path:
    """A random CLIPModel of real dimensions with openai's image processor settings and the tiny byte-level BPE
    tokenizer of tests/tiny_clip.py (no hub: the text tower only has to run the engine's load probe)."""
    from transformers import CLIPConfig, CLIPModel

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.tiny_clip import clip_tokenizer

    shape = CLIP_SIZES[size]
    tok = clip_tokenizer()
    cfg = CLIPConfig(text_config=dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.pad_token_id, **shape["text"]),
                     vision_config=shape["vision"], projection_dim=shape["projection_dim"])
    cfg.architectures = ["CLIPModel"]
    torch.manual_seed(0)
    CLIPModel(cfg).half().save_pretrained(out)
    tok.save_pretrained(out)
    edge = shape["vision"]["image_size"]
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": edge},
        "resample": 3, "do_center_crop": True, "crop_size": {"height": edge, "width": edge}, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True}))
    return out


def random_model(size: str, tokenizer_src: Path, out: Path) -> Path:
    """A random model of real dimensions, saved with a real tokenizer and a mean-pooling ST config."""
    from transformers import (AutoTokenizer, BertConfig, BertModel, Qwen2Config, Qwen2Model, XLMRobertaConfig,
                              XLMRobertaModel)

    tok = AutoTokenizer.from_pretrained(tokenizer_src)
    if size.startswith("qwen2"):
        cfg = Qwen2Config(vocab_size=len(tok), max_position_embeddings=32768, **SIZES[size])
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = Qwen2Model(cfg).half()
    elif size.startswith("modernbert"):
        from transformers import ModernBertConfig, ModernBertModel

        cfg = ModernBertConfig(vocab_size=len(tok), max_position_embeddings=8192, pad_token_id=tok.pad_token_id,
                               cls_token_id=tok.cls_token_id, sep_token_id=tok.sep_token_id, **SIZES[size])
        model = ModernBertModel(cfg)
    elif size.startswith("xlmr"):
        cfg = XLMRobertaConfig(vocab_size=len(tok), max_position_embeddings=514, pad_token_id=1, **SIZES[size])
        model = XLMRobertaModel(cfg)
    else:
        cfg = BertConfig(vocab_size=len(tok), max_position_embeddings=512, **SIZES[size])
        model = BertModel(cfg)
    model.half().save_pretrained(out)
    tok.save_pretrained(out)
    (out / "modules.json").write_text('[{"idx":0,"name":"0","path":"","type":"sentence_transformers.models.Transformer"},'
                                      '{"idx":1,"name":"1","path":"1_Pooling","type":"sentence_transformers.models.Pooling"}]')
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(f'{{"word_embedding_dimension": {cfg.hidden_size}, "pooling_mode_mean_tokens": true}}')
    (out / "sentence_bert_config.json").write_text('{"max_seq_length": 512}')
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: bundled all-MiniLM-L6-v2)")
    ap.add_argument("--size", choices=sorted(SIZES) + sorted(CLIP_SIZES), default=None,
                    help="random weights at this real size instead (clip-*: with --images)")
    ap.add_argument("--images", type=int, default=None, metavar="N",
                    help="time N generated images (300-800 px, JPEG and PNG) through a CLIP model instead of sentences")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="WDE's dtype")
    ap.add_argument("--st-dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                    help="sentence-transformers' dtype (auto: float32 on CPU, --dtype on CUDA)")
    ap.add_argument("--agreement-n", type=int, default=2000,
                    help="sentences for the float32 reference when sentence-transformers ran in another dtype")
    ap.add_argument("--n", type=int, default=2000, help="number of sentences")
    ap.add_argument("--mean-words", type=int, default=30)
    ap.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers encode batch size")
    ap.add_argument("--max-batched-tokens", default="auto", help="scheduler token budget (auto: 16384 GPU, 2048 CPU)")
    ap.add_argument("--executor", default="sync", choices=["sync", "thread"])
    ap.add_argument("--attention", default="auto", help="attention backend (auto: the workflows' default)")
    ap.add_argument("--workflow", default=None, help="workflow (default: chosen from the model's architecture)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each side (best is reported)")
    ap.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[;KEY=VALUE]",
                    help="also time WDE with these settings added (same process, runs alternated with the others)")
    args = ap.parse_args(argv)
    if args.images is not None or (args.size or "") in CLIP_SIZES:
        if args.images is None or args.images < 1 or not (args.model or args.size in CLIP_SIZES):
            ap.error("--images N (N >= 1) goes with --model CLIP_FOLDER or --size clip-b32")
        return images_main(args)

    from sentence_transformers import SentenceTransformer

    from wde import Engine
    from wde.model_source import resolve_model_path

    base = resolve_model_path(args.model)
    path = base
    if args.size:
        path = random_model(args.size, base, Path(tempfile.mkdtemp(prefix="wde-bench-")))
    texts = sentences(args.n, args.mean_words)
    st_dtype_name = args.st_dtype if args.st_dtype != "auto" else \
        (args.dtype if args.device.startswith("cuda") else "float32")

    def build(extra: list[str]) -> Engine:
        # The script's own settings go first, as strings, so `--set` and `--variant` override them.
        budget = args.max_batched_tokens
        own = [f"attention.name={args.attention}", f"scheduler.params.max_num_batched_tokens={budget}",
               "scheduler.params.max_num_requests=1024", f"executor.name={args.executor}"]
        return Engine.from_workflow(args.workflow, path, dtype=args.dtype, device=args.device,
                                    overrides=[*own, *args.overrides, *extra])

    engine = build([])
    variants = {f"wde[{v}]": build(v.split(";")) for v in args.variant}
    st = SentenceTransformer(str(path), device=args.device, model_kwargs={"dtype": getattr(torch, st_dtype_name)})
    max_len = min(engine.max_length, st.max_seq_length)
    n_tokens = sum(len(ids) for ids in st.tokenizer(texts, truncation=True, max_length=max_len)["input_ids"])

    def run_wde(e: Engine = engine) -> np.ndarray:
        return e.embed(texts, truncate=True)

    def run_st() -> np.ndarray:
        return st.encode(texts, batch_size=args.st_batch_size, convert_to_numpy=True)

    warm = texts[: min(256, len(texts))]
    for e in (engine, *variants.values()):
        e.embed(warm, truncate=True)
    st.encode(warm, batch_size=args.st_batch_size)
    sides = [("sentence-transformers", run_st), ("wde", run_wde),
             *((name, lambda e=e: run_wde(e)) for name, e in variants.items())]
    best = {name: float("inf") for name, _ in sides}
    outs = {}
    for _ in range(args.repeats):
        for name, fn in sides:
            sync(args.device)
            t0 = time.perf_counter()
            outs[name] = fn()
            sync(args.device)
            best[name] = min(best[name], time.perf_counter() - t0)

    ref = outs["sentence-transformers"].astype(np.float32)
    if st_dtype_name != "float32":  # the agreement is always against float32 vectors
        del st
        m = min(args.agreement_n, len(texts))
        st32 = SentenceTransformer(str(path), device=args.device, model_kwargs={"dtype": torch.float32})
        ref = st32.encode(texts[:m], batch_size=args.st_batch_size, convert_to_numpy=True).astype(np.float32)
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or platform.machine()
    print(f"machine: {gpu}, {os.cpu_count()} cpus, torch {torch.__version__}")
    print(f"model: {args.size or path.name} ({args.device}; wde {args.dtype}, sentence-transformers {st_dtype_name});"
          f" workload: {args.n} sentences, {n_tokens} tokens")
    for name, dt in (("sentence-transformers", st_dtype_name), ("wde", args.dtype)):
        print(f"{name:>22}: {best[name]:8.3f} s  {n_tokens / best[name]:10.0f} tokens/s  {args.n / best[name]:8.1f} sentences/s  ({dt})")
    for name in variants:
        print(f"{name:>22}: {best[name]:8.3f} s  {n_tokens / best[name]:10.0f} tokens/s  (max abs diff to wde"
              f" {np.abs(outs[name] - outs['wde']).max():.1e})")
    print(f"ratio wde / sentence-transformers: {best['sentence-transformers'] / best['wde']:.2f}x")
    for name in variants:
        print(f"ratio {name} / sentence-transformers: {best['sentence-transformers'] / best[name]:.2f}x")
    per_token = flops_per_token(engine.source.hf_config, n_tokens / args.n)
    peak = gemm_peak(args.device, getattr(torch, args.dtype))
    achieved = n_tokens / best["wde"] * per_token
    print(f"roofline: {per_token / 1e6:.1f} MFLOP/token, {args.dtype} GEMM peak {peak / 1e12:.3f} TFLOP/s measured here"
          f" ({peak / per_token:,.0f} tokens/s at best); wde reaches {achieved / 1e12:.3f} TFLOP/s ="
          f" {achieved / peak:.0%} of roofline")
    for name in ("wde", *variants):
        a = outs[name][: len(ref)].astype(np.float32)
        cos = (a * ref).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(ref, axis=1))
        print(f"agreement of {name} ({args.dtype}) with float32 sentence-transformers over {len(ref)} sentences:"
              f" min cosine {cos.min():.6f}, mean {cos.mean():.6f}, max abs diff {np.abs(a - ref).max():.2e}")
    for e in (engine, *variants.values()):
        e.close()


def image_features(output: object) -> torch.Tensor:
    """`get_image_features`' result: a tensor (transformers 4) or an output whose `pooler_output` it is (5)."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output  # type: ignore[attr-defined]


def images_main(args: argparse.Namespace) -> None:
    """The `--images` mode on `--model`, or on random weights of `--size` saved in a folder removed afterwards."""
    if args.model:
        return time_images(args, Path(args.model))
    with tempfile.TemporaryDirectory(prefix="wde-bench-") as tmp:
        time_images(args, random_clip(args.size, Path(tmp)))


def time_images(args: argparse.Namespace, path: Path) -> None:
    """Images/s of WDE, transformers' CLIP pipeline and sentence-transformers, side by side, and their agreement."""
    import transformers
    from PIL import Image
    from transformers import AutoImageProcessor, CLIPModel

    from wde import Engine

    blobs = images(args.images)
    ref_dtype_name = args.st_dtype if args.st_dtype != "auto" else \
        (args.dtype if args.device.startswith("cuda") else "float32")
    ref_dtype = getattr(torch, ref_dtype_name)
    own = [f"attention.name={args.attention}", f"scheduler.params.max_num_batched_tokens={args.max_batched_tokens}",
           "scheduler.params.max_num_requests=1024", f"executor.name={args.executor}"]
    engine = Engine.from_workflow(args.workflow, path, dtype=args.dtype, device=args.device,
                                  overrides=[*own, *args.overrides])
    pil = {"backend": "pil"} if int(transformers.__version__.split(".")[0]) >= 5 else {"use_fast": False}
    processor = AutoImageProcessor.from_pretrained(path, **pil)
    model = CLIPModel.from_pretrained(path, dtype=ref_dtype).eval().to(args.device)
    batch = args.st_batch_size

    def decode(chunk: list[bytes]) -> list[Image.Image]:
        return [Image.open(io.BytesIO(b)) for b in chunk]

    def run_wde(chunk: list[bytes]) -> np.ndarray:
        return engine.embed(chunk, normalize=False)

    @torch.inference_mode()
    def run_transformers(chunk: list[bytes]) -> np.ndarray:
        out = []
        for i in range(0, len(chunk), batch):
            pixels = processor(images=decode(chunk[i:i + batch]), return_tensors="pt").pixel_values
            feats = image_features(model.get_image_features(pixel_values=pixels.to(args.device, ref_dtype)))
            out.append(feats.float().cpu().numpy())
        return np.concatenate(out)

    sides: list[tuple[str, Callable[[list[bytes]], np.ndarray]]] = [("transformers", run_transformers),
                                                                    ("wde", run_wde)]
    try:
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(path), device=args.device, model_kwargs={"dtype": ref_dtype})
        st.encode(decode(blobs[:1]))  # a folder it cannot read as a CLIP fails here, not in the timed runs
        sides.insert(1, ("sentence-transformers",
                         lambda chunk: st.encode(decode(chunk), batch_size=batch, convert_to_numpy=True)))
    except Exception as e:  # noqa: BLE001 - reported, the other sides still run
        print(f"sentence-transformers: skipped ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")

    for _, fn in sides:  # warm-up: first calls allocate, pick kernels, spin up threads
        fn(blobs[: min(8, len(blobs))])
    best = {name: float("inf") for name, _ in sides}
    outs: dict[str, np.ndarray] = {}
    for _ in range(args.repeats):
        for name, fn in sides:
            sync(args.device)
            t0 = time.perf_counter()
            outs[name] = np.asarray(fn(blobs), dtype=np.float32)
            sync(args.device)
            best[name] = min(best[name], time.perf_counter() - t0)

    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or platform.machine()
    print(f"machine: {gpu}, {os.cpu_count()} cpus, torch {torch.__version__}")
    megabytes = sum(len(b) for b in blobs) / 1e6
    print(f"model: {args.size or path.name} ({args.device}; wde {args.dtype}, transformers {ref_dtype_name});"
          f" workload: {len(blobs)} images, 300-800 px, JPEG and PNG, {megabytes:.1f} MB encoded")
    for name, _ in sides:
        dtype = args.dtype if name == "wde" else ref_dtype_name
        print(f"{name:>22}: {best[name]:8.3f} s  {len(blobs) / best[name]:9.1f} images/s  ({dtype})")
    for name, _ in sides:
        if name != "wde":
            print(f"ratio wde / {name}: {best[name] / best['wde']:.2f}x")
    ref = outs["transformers"]
    for name, _ in sides:
        if name == "transformers":
            continue
        a = outs[name]
        cos = (a * ref).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(ref, axis=1))
        print(f"agreement of {name} with transformers over {len(ref)} images: min cosine {cos.min():.6f},"
              f" max abs diff {np.abs(a - ref).max():.2e}")
    engine.close()


if __name__ == "__main__":
    main()
