"""`wde embed` as a resumable pipeline: read records → cut them into shards → embed → write each shard.

Shard k always holds input records [k*shard_size, (k+1)*shard_size), so a re-run with `--resume` skips the
shards already on disk and writes the rest: no shard is redone and no row is written twice. Shards are embedded
in this process, or by a data-parallel pool of worker processes (`wde.corpus.data_parallel`).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from wde.corpus.embedder import ShardEmbedder
from wde.corpus.job import CorpusError, EmbedJob
from wde.corpus.progress import Progress
from wde.corpus.readers import Record, check_inputs, count_records, read_records, shards
from wde.corpus.writer import ShardWriter, assemble_npy

Shards = Iterator[tuple[int, list[Record]]]


@dataclass(frozen=True)
class EmbedSummary:
    rows: int
    dim: int
    shards_written: int
    shards_skipped: int
    tokens: int
    seconds: float
    output: str


def work_dir(job: EmbedJob) -> Path:
    """Where the shards go: the output itself for .parquet; a sibling folder, removed at the end, for .npy."""
    out = Path(job.output)
    return out if job.output_format == "parquet" else out.with_name(out.name + ".wde-parts")


def pending_shards(job: EmbedJob, done: set[int], progress: Progress) -> Shards:
    """The shards still to embed, in order; finished ones are read past (cheap) and counted as skipped."""
    for index, records in shards(read_records(job.inputs, job.text_field, job.id_field, job.skip_blank),
                                 job.shard_size):
        if index in done:
            progress.skipped(len(records))
            continue
        yield index, records


def run_local(job: EmbedJob, todo: Shards, writer: ShardWriter, progress: Progress, device: str | None = None) -> int:
    """Embed every shard in this process with one engine; the number of shards written."""
    written = 0
    with job.build_engine(device) as engine:
        embedder = ShardEmbedder(engine, job, progress.batch)
        progress.start()
        for index, records in todo:
            writer.write(index, embedder.embed(records))
            written += 1
    return written


def run_embed(job: EmbedJob, *, workers: int = 1, devices: list[str] | None = None, resume: bool = False,
              overwrite: bool = False, progress: bool = False) -> EmbedSummary:
    """Run (or finish, with `resume`) a corpus embedding job; see `wde embed --help`."""
    job.check()
    check_inputs(job.inputs, job.text_field, job.id_field)
    t0 = time.perf_counter()
    out = Path(job.output)
    if job.output_format == "npy" and out.exists() and not overwrite:
        raise CorpusError(f"--output {out} already exists; pass --overwrite to replace it")
    npy = job.output_format == "npy"
    writer = ShardWriter(work_dir(job))
    fresh = overwrite or not writer.directory.exists()
    # .npy shards are scratch: a plain re-run replaces them, --resume (after a kill) reuses them
    done = writer.open(job.fingerprint(), resume=resume, overwrite=overwrite or (npy and not resume))
    bar = Progress(progress)
    bar.count_in_background(lambda: count_records(job.inputs))
    try:
        todo = pending_shards(job, done, bar)
        if workers > 1 or (devices is not None and len(devices) > 1):
            from wde.corpus.data_parallel import run_data_parallel

            written = run_data_parallel(job, todo, writer, bar, workers=workers, devices=devices)
        else:
            written = run_local(job, todo, writer, bar, devices[0] if devices else None)
    except Exception:  # a kill or Ctrl-C leaves the shards for --resume; a run that wrote nothing leaves nothing
        if npy or (fresh and not writer.parts()):
            shutil.rmtree(writer.directory, ignore_errors=True)
        raise
    finally:
        bar.close()
    rows, dim = writer.summary()
    writer.finish(rows, dim)
    if npy:
        assemble_npy(writer, out)
        shutil.rmtree(writer.directory)
    return EmbedSummary(rows, dim, written, len(done), bar.tokens, time.perf_counter() - t0, str(out))
