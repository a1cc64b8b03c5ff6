"""Chunked processing of inputs longer than the model (vLLM's `enable_chunked_processing`, as `PoolingParams.chunk`).

An input over the model's limit is cut into chunks that fit: its tokens without the special ones, in pieces of
(limit - special tokens), each piece given the model's special tokens again (`split`). The chunks are queued as
sequences of their own, together and in order, so they pack into batches like any other input. Each is pooled the
model's own way before normalization (`SchedulableRequest.params`: no `dimensions`, no normalization); when the
last one is back, `ChunkMerger` averages the chunk vectors weighted by their token counts and hands the mean to the
pooler's `finish_chunks` (dimensions, then the model's normalization). `usage` counts every token of every chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from wde.errors import RequestError
from wde.request import RequestOutput, SchedulableRequest

if TYPE_CHECKING:
    import numpy as np

Tokens = tuple[list[int], list[int] | None]


def split(ids: list[int], types: list[int] | None, limit: int,
          affixes: tuple[list[int], list[int]]) -> list[Tokens]:
    """`ids` (a whole input, special tokens included) as chunks of at most `limit` tokens, each with the special
    tokens `affixes` (before, after). Ids that do not start and end with them (token ids given by a client) are
    cut as they are, and each piece still gets them."""
    before, after = affixes
    body = ids
    if ids[:len(before)] == before and (not after or ids[len(ids) - len(after):] == after):
        body = ids[len(before):len(ids) - len(after)]
    room = limit - len(before) - len(after)
    if room < 1:
        raise ValueError(f"the model's special tokens take {len(before) + len(after)} of its {limit}")
    chunks = []
    for start in range(0, len(body), room):
        chunk = before + body[start:start + room] + after
        chunks.append((chunk, None if types is None else [0] * len(chunk)))
    return chunks


@dataclass
class _Pending:
    count: int
    vectors: dict[int, tuple["np.ndarray", int]] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    error: RequestError | None = None
    first: RequestOutput | None = None
    inference_time: float = 0.0


class ChunkMerger:
    """Holds the outputs of a long input's chunks until the last arrives, then gives the request's one output.

    `finish(mean, params)` is the pooler's `finish_chunks`. A chunk that failed fails its request (one error
    output, once every chunk is accounted for, so no chunk's output arrives after its request was answered)."""

    def __init__(self, finish) -> None:  # noqa: ANN001 - ChunkedPooling.finish_chunks
        self._finish = finish
        self._pending: dict[str, _Pending] = {}

    def add(self, scheduled: SchedulableRequest, out: RequestOutput) -> RequestOutput | None:
        """`out`, unless it is a chunk's: then None until its request's last chunk, which gives the merged output."""
        if scheduled.chunk is None:
            return out
        index, count = scheduled.chunk
        rid = out.request_id
        p = self._pending.setdefault(rid, _Pending(count))
        if p.first is None:
            p.first = out
        p.inference_time += out.inference_time
        if out.error is not None:
            p.error = p.error or out.error
        p.token_ids[index] = scheduled.token_ids
        if out.error is None and p.error is None:
            p.vectors[index] = (out.outputs["dense"], scheduled.num_tokens)
        if len(p.token_ids) < count:
            return None
        del self._pending[rid]
        import numpy as np  # here, not at import: the request processor imports this module, `wde validate` it

        first = p.first
        if p.error is not None:
            return RequestOutput(rid, error=p.error, queue_time=first.queue_time,
                                 tokenization_time=first.tokenization_time, inference_time=p.inference_time)
        rows = np.stack([p.vectors[i][0] for i in range(count)]).astype(np.float64)
        weights = np.array([p.vectors[i][1] for i in range(count)], dtype=np.float64)
        mean = (weights @ rows / weights.sum()).astype(np.float32)
        dense = self._finish(mean, scheduled.request.params)
        ids = [t for i in range(count) for t in p.token_ids[i]]
        return RequestOutput(rid, {"dense": dense}, len(ids), None, ids, queue_time=first.queue_time,
                             tokenization_time=first.tokenization_time, inference_time=p.inference_time)

    def clear(self) -> list[str]:
        """Forget every request whose chunks are partly back (the engine resets); their ids."""
        ids = list(self._pending)
        self._pending.clear()
        return ids
