"""Corpus embedding: `wde embed` as a streaming, sharded, resumable pipeline (local, data-parallel, or Ray).

    readers.py        jsonl / parquet / txt records with (file, line) provenance, streamed
    writer.py         sharded parquet output written atomically; manifest; .npy assembly
    embedder.py       one shard through a `wde.Engine` into an Arrow table
    pipeline.py       read → shard → skip finished shards → embed → write
    data_parallel.py  N worker processes, one engine (and device) each
    ray_job.py        the same job as a Ray Data pipeline
"""

from wde.corpus.job import CorpusError, EmbedJob
from wde.corpus.pipeline import EmbedSummary, run_embed

__all__ = ["CorpusError", "EmbedJob", "EmbedSummary", "run_embed"]
