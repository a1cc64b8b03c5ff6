"""Embed one shard of records with a `wde.Engine` and turn the result into an Arrow table.

Shared by the in-process pipeline, the data-parallel workers and the Ray actors, so all three write the same
columns: `id` (string), `embedding` (fixed-size list of float32) and, when asked, `sparse` (map token id →
weight) and `colbert` (list of fixed-size float32 vectors).

Requests are fed to the engine as it frees room, not all at once: the engine reads an image file when it admits
it (and decodes it only when it is scheduled), so at most `open_images` image files of a shard are held in memory
at a time, however large the shard; texts are admitted at once, as they cost little.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from wde.corpus.job import CorpusError, EmbedJob, takes_images
from wde.corpus.readers import Record, is_data_uri
from wde.errors import RequestError
from wde.request import PoolingParams, Request, RequestOutput

MIN_OPEN_IMAGES = 64
"""The fewest image requests a shard keeps in the engine, however small the scheduler's batches."""

COLUMN = {"dense": "embedding", "sparse": "sparse", "colbert": "colbert"}


def flag_hint(message: str) -> str:
    """Engine messages speak of request fields; on the command line the switches are `--truncate` and
    `--max-embed-len`."""
    return message.replace("set truncate=true", "pass --truncate").replace("(max_embed_len)", "(--max-embed-len)")


class ShardEmbedder:
    """Runs records through one engine; `on_batch(rows, tokens)` is called after each finished batch."""

    def __init__(self, engine: Any, job: EmbedJob, on_batch: Callable[[int, int], None] | None = None) -> None:
        missing = [o for o in job.outputs if o not in engine.supported_outputs]
        if missing:
            raise CorpusError(f"--outputs {','.join(job.outputs)}: workflow {engine.workflow.name!r} produces"
                              f" {list(engine.supported_outputs)}, not {missing}")
        self.images = takes_images(engine.input_processor)
        if job.image_field is not None and not self.images:
            raise CorpusError(f"--image-field {job.image_field}: workflow {engine.workflow.name!r} embeds texts only;"
                              " use an image-text workflow such as clip or siglip (docs/images.md)")
        if job.chunk and not (engine.chunkable and job.outputs == ("dense",)):
            raise CorpusError(f"--long-inputs chunk: chunked processing gives dense embeddings only, and workflow"
                              f" {engine.workflow.name!r} with --outputs {','.join(job.outputs)} cannot be chunked")
        if job.options:
            from wde.engine import check_options

            try:
                check_options(job.options, engine.request_options, engine.workflow.name)
            except RequestError as e:
                raise CorpusError(f"--option: {e}") from None
        self.engine = engine
        self.job = job
        self.params = PoolingParams(truncate=job.truncate, chunk=job.chunk, max_embed_len=job.max_embed_len,
                                    prompt_name=job.prompt_name, options=dict(job.options) or None,
                                    outputs=None if job.outputs == ("dense",) else job.outputs)
        self.open_images = open_images(engine)
        """Image requests admitted and not finished at most: room for the batches the executor keeps in flight
        plus the next one, so the model never waits for a file to be read."""
        if on_batch is not None:
            engine.on_batch = lambda stats: on_batch(stats.num_requests, stats.num_tokens)

    def request(self, r: Record) -> Request:
        """The engine request of one record; a `CorpusError` naming `file:line` when admission refuses it. A
        text goes as {"text": ...} to an engine that takes images, so a text that looks like a data: URI is never
        taken for an image; a path goes as a `pathlib.Path`, which the engine reads as a local file."""
        if r.image is None:
            value: Any = {"text": r.text} if self.images else r.text
            field = self.job.text_field or "text"
        else:
            value = r.image if isinstance(r.image, bytes) or is_data_uri(r.image) else Path(r.image)
            field = self.job.image_field or "image"
        try:
            return self.engine.make_request(value, self.params, field=field)
        except RequestError as e:
            raise CorpusError(self.refusal(r, e)) from None

    def refusal(self, r: Record, why: object) -> str:
        """`file:line: why`, plus the image file when the engine's message does not name it."""
        message = flag_hint(str(why))
        if isinstance(r.image, str) and not is_data_uri(r.image) and r.image not in message:
            message += f" (image file {r.image})"
        return f"{r.where}: {message}"

    def embed(self, records: Sequence[Record]) -> Any:
        """The shard's Arrow table, rows in record order; a `CorpusError` naming `file:line` on a bad record (the
        engine is then emptied, so it can take the next job)."""
        engine = self.engine
        ids: list[str] = []
        owner: dict[str, Record] = {}
        open_images: set[str] = set()
        done: dict[str, RequestOutput] = {}

        def step() -> bool:
            outs = engine.step()
            for out in outs:
                done[out.request_id] = out
                open_images.discard(out.request_id)
                if out.error is not None:
                    raise CorpusError(self.refusal(owner[out.request_id], out.error))
            return bool(outs) or engine.has_unfinished()

        try:
            for r in records:
                while r.image is not None and len(open_images) >= self.open_images and step():
                    pass
                request = self.request(r)
                engine.scheduler.add(request)
                ids.append(request.request_id)
                owner[request.request_id] = r
                if r.image is not None:
                    open_images.add(request.request_id)
            while len(done) < len(ids) and step():
                pass
            missing = next((i for i in ids if i not in done), None)
            if missing is not None:  # every request yields an output; guards against a plugin losing one
                raise CorpusError(f"{owner[missing].where}: the engine returned no output")
        except BaseException:
            engine.reset()
            raise
        return to_table([r.id for r in records], [done[i].outputs for i in ids], self.job.outputs)


def open_images(engine: Any) -> int:
    """How many image requests `ShardEmbedder` keeps admitted at once: (batches in flight + 1) x the scheduler's
    requests per batch, at least `MIN_OPEN_IMAGES`."""
    per_batch = engine.scheduler.max_num_requests or engine.scheduler.token_budget
    return max(MIN_OPEN_IMAGES, (int(engine.executor.max_inflight) + 1) * int(per_batch))


def id_column(ids: Sequence[str | int]) -> Any:
    """The `id` column: int64 for integer ids (an input's integer ids come back as integers), else strings; one
    run's ids are all of one type (`readers.typed_ids`), so every shard has the same schema."""
    import pyarrow as pa

    return pa.array(ids, pa.int64() if ids and isinstance(ids[0], int) else pa.string())


def to_table(ids: list[str | int], results: list[dict[str, Any]], outputs: Sequence[str]) -> Any:
    import pyarrow as pa

    columns: dict[str, Any] = {"id": id_column(ids)}
    for name in outputs:
        values = [res[name] for res in results]
        if name == "dense":
            columns[COLUMN[name]] = _vectors(np.stack(values) if values else np.zeros((0, 0), np.float32))
        elif name == "sparse":
            key = pa.string() if any(isinstance(k, str) for d in values for k in d) else pa.int32()
            columns[COLUMN[name]] = pa.array([list(d.items()) for d in values], pa.map_(key, pa.float32()))
        else:
            mats = [np.asarray(m, np.float32) for m in values]
            dim = mats[0].shape[1] if mats else 0
            offsets = np.concatenate([[0], np.cumsum([len(m) for m in mats])]).astype(np.int32)
            flat = np.concatenate(mats) if mats else np.zeros((0, dim), np.float32)
            columns[COLUMN[name]] = pa.ListArray.from_arrays(pa.array(offsets), _vectors(flat))
    return pa.table(columns)


def _vectors(matrix: np.ndarray) -> Any:
    import pyarrow as pa

    matrix = np.ascontiguousarray(matrix, dtype=np.float32)
    dim = matrix.shape[1] if matrix.ndim == 2 else 0
    return pa.FixedSizeListArray.from_arrays(pa.array(matrix.reshape(-1)), dim)
