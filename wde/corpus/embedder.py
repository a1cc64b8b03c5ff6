"""Embed one shard of records with a `wde.Engine` and turn the result into an Arrow table.

Shared by the in-process pipeline, the data-parallel workers and the Ray actors, so all three write the same
columns: `id` (string), `embedding` (fixed-size list of float32) and, when asked, `sparse` (map token id →
weight) and `colbert` (list of fixed-size float32 vectors).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from wde.corpus.job import CorpusError, EmbedJob
from wde.corpus.readers import Record
from wde.errors import RequestError
from wde.request import PoolingParams

COLUMN = {"dense": "embedding", "sparse": "sparse", "colbert": "colbert"}


def flag_hint(message: str) -> str:
    """Engine messages speak of request fields; on the command line the switch is `--truncate`."""
    return message.replace("set truncate=true", "pass --truncate")


class ShardEmbedder:
    """Runs records through one engine; `on_batch(rows, tokens)` is called after each finished batch."""

    def __init__(self, engine: Any, job: EmbedJob, on_batch: Callable[[int, int], None] | None = None) -> None:
        missing = [o for o in job.outputs if o not in engine.supported_outputs]
        if missing:
            raise CorpusError(f"--outputs {','.join(job.outputs)}: workflow {engine.workflow.name!r} produces"
                              f" {list(engine.supported_outputs)}, not {missing}")
        self.engine = engine
        self.job = job
        self.params = PoolingParams(truncate=job.truncate, prompt_name=job.prompt_name,
                                    outputs=None if job.outputs == ("dense",) else job.outputs)
        if on_batch is not None:
            engine.on_batch = lambda stats: on_batch(stats.num_requests, stats.num_tokens)

    def embed(self, records: Sequence[Record]) -> Any:
        """The shard's Arrow table, rows in record order; a `CorpusError` naming `file:line` on a bad record."""
        engine = self.engine
        requests = []
        for r in records:
            try:
                requests.append(engine.make_request(r.text, self.params, field=self.job.text_field))
            except RequestError as e:
                raise CorpusError(f"{r.where}: {flag_hint(str(e))}") from None
        done = engine.run(requests)
        results = []
        for r, q in zip(records, requests):
            out = done.get(q.request_id)
            if out is None or out.error is not None:
                engine.reset()
                why = out.error if out is not None else "the engine returned no output"
                raise CorpusError(f"{r.where}: {flag_hint(str(why))}")
            results.append(out.outputs)
        return to_table([r.id for r in records], results, self.job.outputs)


def to_table(ids: list[str], results: list[dict[str, Any]], outputs: Sequence[str]) -> Any:
    import pyarrow as pa

    columns: dict[str, Any] = {"id": pa.array(ids, pa.string())}
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
