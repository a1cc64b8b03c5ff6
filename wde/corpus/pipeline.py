"""`wde embed` as a resumable pipeline: read records → cut them into shards → embed → write each shard.

Shard k always holds input records [k*shard_size, (k+1)*shard_size), so a re-run with `--resume` skips the
shards already on disk and writes the rest: no shard is redone and no row is written twice. Everything is written
under `<output>.partial` and renamed to `<output>` only when complete, so a reader never takes a partial run for
a finished one. A kept shard must still match its journal record (file size and sha256: else it is embedded
again) and the input rows it was embedded from (a sha256 of their ids and texts, recomputed while streaming: else
the run is refused, naming the shard and the changed line). Shards are embedded in this process, or by a
data-parallel pool of worker processes (`wde.corpus.data_parallel`). SIGINT / SIGTERM (under a
`signals.SignalGuard`) drop the shard in flight and end in `Interrupted`, saying how many shards are on disk.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from wde.corpus.embedder import ShardEmbedder
from wde.corpus.job import CorpusError, EmbedJob
from wde.corpus.progress import Progress
from wde.corpus.readers import Record, check_inputs, count_records, input_digests, read_records, shards
from wde.corpus.signals import Interrupted, deferred
from wde.corpus.writer import ShardRecord, ShardWriter, assemble_npy, job_differs, publish, read_manifest


@dataclass(frozen=True)
class EmbedSummary:
    rows: int
    dim: int
    shards_written: int
    shards_skipped: int
    tokens: int
    seconds: float
    output: str
    already_complete: bool = False
    """`--resume` found `output` complete: nothing was done."""


@dataclass
class Shard:
    """One shard to embed: its records and what they hash to (recorded with the shard, checked on resume)."""

    index: int
    records: list[Record]
    input_sha256: str
    row_digests: bytes


@dataclass
class Tally:
    """How far the input has been read: the number of shards once the reader has reached its end."""

    total_shards: int | None = None
    rows_read: int = 0
    kept: list[int] = field(default_factory=list)


Shards = Iterator[Shard]


def _notice(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def changed_input(writer: ShardWriter, rec: ShardRecord, records: list[Record]) -> CorpusError:
    """The refusal for a kept shard whose input rows no longer hash the same: names the shard and the first
    changed line (found with the per-row digests stored in the shard file), else the shard's range of lines."""
    from wde.corpus.readers import ROW_DIGEST_BYTES

    now = input_digests(records)[1]
    before = writer.row_digests(rec)
    where = None
    if before is not None and before != now:
        k = ROW_DIGEST_BYTES
        i = next((i for i in range(0, min(len(before), len(now)), k) if before[i:i + k] != now[i:i + k]),
                 min(len(before), len(now)))
        if i // k < len(records):
            where = f"{records[i // k].where} differs"
        else:
            where = f"the input has fewer records after {records[-1].where}"
    if where is None:
        first, last = records[0], records[-1]
        span = f"{first.where}-{last.line}" if first.file == last.file else f"{first.where} to {last.where}"
        where = f"a line of {span} differs"
    return CorpusError(f"--resume: the input changed since shard {rec.index} ({rec.file}) was embedded from it:"
                       f" {where}; its finished shards no longer match the input: restore the input, or pass"
                       " --overwrite to embed it all again")


def pending_shards(job: EmbedJob, writer: ShardWriter, recorded: dict[int, ShardRecord], progress: Progress,
                   tally: Tally, notice: Callable[[str], None] = _notice) -> Shards:
    """The shards still to embed, in order. A recorded shard is kept (read past, counted as skipped) when its input
    rows hash as recorded and its file is whole; a changed input is refused, a damaged file embedded again."""
    last = -1
    for index, records in shards(read_records(job.inputs, job.text_field, job.id_field, job.skip_blank,
                                              job.max_line_bytes, job.image_field), job.shard_size):
        last = index
        tally.rows_read += len(records)
        digest, rows = input_digests(records)
        rec = recorded.get(index)
        if rec is not None:
            if rec.input_sha256 != digest or rec.rows != len(records):
                raise changed_input(writer, rec, records)
            problem = writer.verify(rec)
            if problem is None:
                progress.skipped(len(records))
                tally.kept.append(index)
                continue
            notice(f"wde embed: {writer.directory / rec.file}: {problem}; embedding shard {index} again")
        yield Shard(index, records, digest, rows)
    tally.total_shards = last + 1
    beyond = sorted(i for i in recorded if i > last)
    if beyond:
        rec = recorded[beyond[0]]
        raise CorpusError(f"--resume: the input changed since shard {rec.index} ({rec.file}) was embedded from it:"
                          f" the input now ends before that shard ({tally.rows_read} records); restore the input, or"
                          " pass --overwrite to embed it all again")


def run_local(job: EmbedJob, todo: Shards, writer: ShardWriter, progress: Progress, device: str | None = None) -> int:
    """Embed every shard in this process with one engine; the number of shards written."""
    written = 0
    with job.build_engine(device) as engine:
        embedder = ShardEmbedder(engine, job, progress.batch)
        progress.start()
        for shard in todo:
            table = embedder.embed(shard.records)
            with deferred():  # a signal now waits until the shard is on disk and in the journal
                info = writer.write(shard.index, table, shard.row_digests)
                writer.record(ShardRecord(**info, input_sha256=shard.input_sha256))
                written += 1
    return written


def interrupted_message(job: EmbedJob, writer: ShardWriter, tally: Tally) -> str:
    """`interrupted after N of M shards; …`, or, while the input's length is unknown, `after N shards (R rows)`."""
    recorded = writer.recorded() if writer.directory.exists() else {}
    n = len(recorded)
    total = tally.total_shards
    if total is None and all(Path(p).suffix.lower() == ".parquet" for p in job.inputs):
        total = math.ceil(count_records(job.inputs) / job.shard_size)  # parquet row counts are exact
    if total is not None:
        done = f"{n} of {total} shards"
    else:
        rows = sum(r.rows for r in recorded.values())
        done = f"{n} shard{'s' if n != 1 else ''} ({rows:,} rows)"
    return f"interrupted after {done}; re-run with --resume"


def check_output(job: EmbedJob, *, resume: bool, overwrite: bool) -> EmbedSummary | None:
    """Refuse an existing `<output>` unless `--overwrite` (it is replaced only when the new run is complete) or
    `--resume`; for `--resume` with no `<output>.partial`, a complete `<output>` of the same job is the answer."""
    out = Path(job.output)
    if not os.path.lexists(out):
        return None
    npy = job.output_format == "npy"
    if not npy and out.is_dir() and not out.is_symlink():
        manifest = read_manifest(out)
        if manifest is None:
            if any(out.iterdir()):
                raise CorpusError(f"--output {out} is a non-empty directory that `wde embed` did not write"
                                  " (no _wde_manifest.json); remove it yourself or pick another --output")
            return None  # an empty directory: take its place
        if not manifest.get("complete"):
            if overwrite:
                return None
            raise CorpusError(f"--output {out} holds an unfinished run of an earlier `wde embed` (which wrote under"
                              " the final name); pass --overwrite to start over")
    if overwrite or (resume and job.partial.exists()):
        return None  # replaced when this run is complete
    if not resume:
        hint = (f"; an interrupted run also left {job.partial}: pass --resume to finish it (it replaces {out})"
                if job.partial.exists() else "")
        raise CorpusError(f"--output {out} already exists; pass --overwrite to replace it{hint}")
    if npy:  # a .npy holds no manifest: its shape is all there is to report
        import numpy as np

        shape = np.load(out, mmap_mode="r").shape
        return EmbedSummary(shape[0], shape[1] if len(shape) > 1 else 0, 0, 0, 0, 0.0, str(out), already_complete=True)
    if not out.is_dir():
        raise CorpusError(f"--output {out} exists and is a file; pass --overwrite to replace it")
    differ = job_differs(manifest, job.fingerprint())
    if differ:
        raise CorpusError(f"--resume: {out} was written by a different job ({', '.join(differ)} differ);"
                          " pass --overwrite to start over, or pick another --output")
    return EmbedSummary(manifest.get("rows", 0), manifest.get("dim", 0), 0, manifest.get("shards", 0), 0, 0.0,
                        str(out), already_complete=True)


def run_embed(job: EmbedJob, *, workers: int = 1, devices: list[str] | None = None, resume: bool = False,
              overwrite: bool = False, progress: bool = False,
              notice: Callable[[str], None] = _notice) -> EmbedSummary:
    """Run (or finish, with `resume`) a corpus embedding job; see `wde embed --help`. `notice` gets the one-line
    messages of a resumed run (a damaged shard embedded again). Under a `signals.SignalGuard`, SIGINT / SIGTERM
    end it in `Interrupted` with a message saying how many shards are on disk."""
    job.check()
    check_inputs(job.inputs, job.text_field, job.id_field, job.image_field)
    job.check_workflow()
    t0 = time.perf_counter()
    out = Path(job.output)
    complete = check_output(job, resume=resume, overwrite=overwrite)
    if complete is not None:
        return complete
    npy = job.output_format == "npy"
    writer = ShardWriter(job.partial)
    fresh, recorded = writer.open(job.fingerprint(), resume=resume, overwrite=overwrite)
    bar = Progress(progress)
    bar.count_in_background(lambda: count_records(job.inputs))
    tally = Tally()
    try:
        try:
            todo = pending_shards(job, writer, recorded, bar, tally, notice)
            if workers > 1 or (devices is not None and len(devices) > 1):
                from wde.corpus.data_parallel import run_data_parallel

                written = run_data_parallel(job, todo, writer, bar, workers=workers, devices=devices)
            else:
                written = run_local(job, todo, writer, bar, devices[0] if devices else None)
        finally:
            bar.close()
        rows, dim = writer.summary()
        writer.finish(rows, dim)
        if npy:
            assemble_npy(writer, out)
        with deferred(raise_after=False):  # complete: a signal from here on is too late to matter
            if npy:
                shutil.rmtree(writer.directory)
            else:
                publish(writer.directory, out)
    except BaseException as e:  # an error, a kill or Ctrl-C: the recorded shards stay for --resume
        with deferred(raise_after=False):
            if writer.directory.exists():
                writer.remove_temporaries()
                if fresh and not writer.recorded():  # a run that wrote nothing leaves nothing
                    shutil.rmtree(writer.directory, ignore_errors=True)
        if isinstance(e, Interrupted):
            raise Interrupted(e.signum, interrupted_message(job, writer, tally)) from None
        raise
    return EmbedSummary(rows, dim, written, len(tally.kept), bar.tokens, time.perf_counter() - t0, str(out))
