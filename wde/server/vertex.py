"""TEI's `POST /vertex`: the request and answer shape of a Vertex AI custom container's predict route.

Vertex AI wraps what a client sends in `{"instances": [...]}` and expects `{"predictions": [...]}`, one prediction
per instance in order. TEI reads each instance as one request body of its own routes: an instance with `query` and
`texts` is a /rerank body; any other is the model's task (/predict for a classifier or reranker, /embed for an
embedder, /embed_sparse for a sparse-only one), and its prediction is that route's JSON answer, unchanged. WDE
does the same, running the instances concurrently as TEI does; one failing instance fails the request, in TEI's
error shape, its message and field prefixed with the instance (`instances[2].inputs`).
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from fastapi import Request
from starlette.responses import Response

from wde.server.errors import ApiError
from wde.server.protocol import VertexRequest, parse

Handler = Callable[[Request, Any], Awaitable[Response]]


async def predictions(request: Request, raw: Any, task: Callable[[dict[str, Any]], Handler],
                      check_batch_size: Callable[..., None]) -> Response:
    """Answer a /vertex body: `task(instance)` picks the route handler each instance goes to; `check_batch_size`
    is the service's (`Service.check_batch_size`), counting instances."""
    body = parse(VertexRequest, raw)
    if not body.instances:
        raise ApiError("empty", "instances is empty: send at least one instance (a TEI request body)", "instances")
    check_batch_size(len(body.instances), "instances", unit="instances")

    async def one(i: int, instance: dict[str, Any]) -> bytes:
        try:
            response = await task(instance)(request, instance)
        except ApiError as e:
            where = f"instances[{i}]"
            param = f"{where}.{e.param}" if e.param else where
            raise ApiError(e.kind, f"{where}: {e.message}", param, e.headers) from None
        return bytes(response.body)

    tasks = [asyncio.ensure_future(one(i, x)) for i, x in enumerate(body.instances)]
    try:
        answers = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:  # one failed: the others' inputs leave the engine instead of running for nothing
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # and their own errors are not left unread
        raise
    # Each answer is already JSON (orjson's float32 text): spliced, not parsed and written again.
    return Response(b'{"predictions":[' + b",".join(answers) + b"]}", media_type="application/json")


def is_rerank(instance: dict[str, Any]) -> bool:
    """TEI tries each instance as a /rerank body first: one with both `query` and `texts`."""
    return "query" in instance and "texts" in instance
