"""`wde embed --ray`: the same job as a Ray Data pipeline, for corpora that outgrow one machine.

    input files ─► read tasks (our readers: same formats, same errors) ─► map_batches(EmbedActor) ─► parquet
                                                                          one WDE engine per actor,
                                                                          one actor per GPU

The output is a directory of parquet files with the same columns as the local pipeline (`id`, `embedding`, …)
plus the same `_wde_manifest.json`, written under `<output>.partial` and renamed to `<output>` when complete.
Ray retries failed tasks itself, so there is no `--resume` here.
Needs `pip install "wde[ray]"`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from wde.corpus.job import CorpusError, EmbedJob
from wde.corpus.readers import check_inputs, first_id_type
from wde.corpus.writer import ShardWriter, publish

def _read_file(batch: Any, job_data: dict, id_type: str = "str") -> Iterator[Any]:
    """A read task: stream one input file's records as Arrow blocks of `shard_size` rows (id, text, file, line),
    so the blocks spread over the embedding actors. `id_type` ("int" or "str", from the first record of the whole
    input) keeps the ids of every file of one type, as the local pipeline does."""
    import pyarrow as pa

    from wde.corpus.readers import read_records

    job = EmbedJob(**job_data)
    for path in batch["path"]:
        block: list = []
        for r in read_records([str(path)], job.text_field, job.id_field, job.skip_blank, job.max_line_bytes,
                              job.image_field, id_type=int if id_type == "int" else str):
            block.append(r)
            if len(block) == job.shard_size:
                yield _block(pa, block)
                block = []
        if block:
            yield _block(pa, block)


def _block(pa: Any, records: list) -> Any:
    """Records as Arrow columns; an image record's path or data: URI goes in `image_ref`, its bytes in
    `image_bytes` (an Arrow column holds one type)."""
    from wde.corpus.embedder import id_column

    return pa.table({"id": id_column([r.id for r in records]), "text": [r.text for r in records],
                     "file": [r.file for r in records], "line": pa.array([r.line for r in records], pa.int64()),
                     "image_ref": pa.array([r.image if isinstance(r.image, str) else None for r in records],
                                           pa.string()),
                     "image_bytes": pa.array([r.image if isinstance(r.image, bytes) else None for r in records],
                                             pa.large_binary())})


class EmbedActor:
    """One engine per actor; each call embeds one batch of records into the output columns."""

    def __init__(self, job_data: dict, device: str | None) -> None:
        from wde.corpus.embedder import ShardEmbedder

        self.job = EmbedJob(**job_data)
        self.engine = self.job.build_engine(device)
        self.embedder = ShardEmbedder(self.engine, self.job)

    def __call__(self, batch: Any) -> Any:
        from wde.corpus.readers import Record

        cols = [batch.column(c).to_pylist() for c in ("id", "text", "file", "line", "image_ref", "image_bytes")]
        return self.embedder.embed([Record(*row[:4], row[4] if row[4] is not None else row[5]) for row in zip(*cols)])


def _corpus_error(error: BaseException) -> CorpusError | None:
    """The `CorpusError` a Ray task raised, found in the exception chain Ray wraps it in."""
    seen = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, CorpusError):
            return e
        stack.extend([e.__cause__, e.__context__, getattr(e, "cause", None)])
    return None


def run_ray_embed(job: EmbedJob, address: str | None = None, *, workers: int = 1, overwrite: bool = False,
                  resume: bool = False) -> tuple[int, int]:
    """Run the job on a Ray cluster (the one already initialised, else `ray.init(address)`); (rows, dim)."""
    job.check()
    check_inputs(job.inputs, job.text_field, job.id_field, job.image_field)
    job.check_workflow()
    if job.output_format != "parquet":
        raise CorpusError(f"--ray writes .parquet output; got --output {job.output}")
    if resume:
        raise CorpusError("--resume does not apply to --ray: Ray retries failed tasks itself; re-run with --overwrite")
    try:
        import ray
        import ray.data
    except ImportError:
        raise CorpusError('--ray needs Ray Data: pip install "wde[ray]" (or "ray[data]>=2.9")') from None
    if not ray.is_initialized():
        ray.init(address=None if address in (None, "", "local") else address, include_dashboard=False)
    from wde.corpus.pipeline import check_output

    check_output(job, resume=False, overwrite=overwrite)
    if job.partial.exists() and not overwrite:
        raise CorpusError(f"--output: an interrupted run left {job.partial}; --ray cannot resume it: pass"
                          " --overwrite to start over")
    writer = ShardWriter(job.partial)
    writer.open(job.fingerprint(), resume=False, overwrite=overwrite)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    actors, per_actor = (gpus, {"num_gpus": 1}) if gpus else (max(1, workers), {"num_cpus": 1})
    device = "cuda" if gpus else "cpu"
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    data = job.model_dump()
    id_type = first_id_type(job.inputs, job.text_field, job.id_field, job.skip_blank, job.max_line_bytes,
                            job.image_field)
    ds = ray.data.from_items([{"path": str(Path(p).resolve())} for p in job.inputs])
    # num_cpus=0: reading is light, and differing resources keep Ray from fusing the read into one actor
    ds = ds.map_batches(_read_file, batch_size=1, batch_format="pyarrow",
                        fn_kwargs={"job_data": data, "id_type": id_type.__name__}, num_cpus=0)
    ds = ds.map_batches(EmbedActor, batch_size=job.shard_size, batch_format="pyarrow", concurrency=actors,
                        fn_constructor_kwargs={"job_data": data, "device": device}, **per_actor)
    try:
        ds.write_parquet(str(writer.directory.resolve()))
    except Exception as e:  # noqa: BLE001 - Ray wraps the task's error; show ours, not Ray's traceback
        found = _corpus_error(e)
        if found is not None:
            raise CorpusError(str(found)) from None
        raise
    rows, dim = writer.summary()
    writer.finish(rows, dim)
    publish(writer.directory, Path(job.output))
    return rows, dim
