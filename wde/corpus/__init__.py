"""Corpus embedding: `wde embed` as a streaming, sharded, resumable pipeline (local, data-parallel, or Ray).

    readers.py        jsonl / parquet / txt records (texts or images) with their file:line, in bounded pieces
    writer.py         sharded parquet output under <output>.partial: atomic shards, journal, manifest, .npy assembly
    embedder.py       one shard through a `wde.Engine` into an Arrow table
    pipeline.py       read → shard → check / skip finished shards → embed → write → publish under <output>
    signals.py        SIGINT / SIGTERM → `Interrupted` (the shard in flight dropped, exit 130 / 143)
    data_parallel.py  N worker processes, one engine (and device) each
    ray_job.py        the same job as a Ray Data pipeline
"""

from wde.corpus.job import CorpusError, EmbedJob
from wde.corpus.pipeline import EmbedSummary, run_embed
from wde.corpus.signals import Interrupted

__all__ = ["CorpusError", "EmbedJob", "EmbedSummary", "Interrupted", "run_embed"]
