"""`wde embed` with 1 vs N workers on the same corpus: wall time, rows/s, tokens/s and the speed-up.

Each run is the whole job as a user runs it (workers spawned, engines built, corpus read, parquet written),
so worker start-up is included; use a corpus large enough that it does not dominate.

    python benchmarks/embed_workers.py                               # CPU, bundled MiniLM, 1 vs 2 workers
    python benchmarks/embed_workers.py --n 20000 --workers 1,2,4
    python benchmarks/embed_workers.py --devices cuda:0 --devices cuda:0,cuda:1   # one worker per GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import sentences  # noqa: E402

from wde.corpus import EmbedJob, run_embed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4000, help="passages in the corpus")
    ap.add_argument("--mean-words", type=int, default=30)
    ap.add_argument("--model", default=None, help="model folder (default: the bundled all-MiniLM-L6-v2)")
    ap.add_argument("--workflow", default=None)
    ap.add_argument("--shard-size", type=int, default=256)
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts to compare (CPU)")
    ap.add_argument("--devices", action="append", default=None,
                    help="a device list per run instead of --workers, e.g. --devices cuda:0 --devices cuda:0,cuda:1")
    args = ap.parse_args()

    import torch

    runs = ([d.split(",") for d in args.devices] if args.devices
            else [["cpu"] * int(w) for w in args.workers.split(",")])
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "corpus.jsonl"
        with src.open("w", encoding="utf-8") as f:
            for i, t in enumerate(sentences(args.n, args.mean_words)):
                f.write(json.dumps({"id": i, "text": t}) + "\n")
        print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__};"
              f" {args.n} passages of ~{args.mean_words} words, shard {args.shard_size}")
        base = None
        for i, devices in enumerate(runs):
            job = EmbedJob(inputs=(str(src),), output=str(Path(tmp) / f"out{i}.parquet"), id_field="id",
                           model=args.model, workflow=args.workflow, shard_size=args.shard_size)
            t0 = time.perf_counter()
            s = run_embed(job, devices=devices)
            wall = time.perf_counter() - t0
            base = base or wall
            print(f"{len(devices)} worker(s) on {','.join(devices)}: {wall:6.1f} s  {s.rows / wall:8.1f} rows/s"
                  f"  {s.tokens / wall:9.0f} tok/s  speed-up x{base / wall:.2f}")


if __name__ == "__main__":
    main()
