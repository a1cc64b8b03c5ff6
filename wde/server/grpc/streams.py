"""TEI's bidirectional streams (EmbedStream, PredictStream, TokenizeStream...): each request of a stream is served as
its unary call is, several at once, and the responses go back in the order the requests came.

TEI runs up to 1,024 requests of a stream at once. Here a stream has at most `STREAM_WINDOW` requests in flight
(fewer when `--max-concurrent-requests` is lower, so one stream alone never overloads the server): enough for the
engine to batch them, while a client sending faster than the model embeds waits under gRPC's flow control instead
of piling requests up in the server. The requests are read while earlier answers are awaited, so a client that
sends its next request only after reading an answer is served too. The first request that fails ends the stream
with its status, after the answers of the requests before it, as a TEI stream ends at its first error.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable, TypeVar

Req = TypeVar("Req")
Res = TypeVar("Res")

STREAM_WINDOW = 32
"""Requests of one stream in flight at once, at most."""


async def in_order(requests: AsyncIterator[Req], serve: Callable[[Req], Awaitable[Res]],
                   window: int) -> AsyncIterator[Res]:
    """`serve(request)` of each of `requests`, at most `window` at once, yielded in request order."""
    slots = asyncio.Semaphore(window)
    started: asyncio.Queue[asyncio.Future[Res] | None] = asyncio.Queue()

    async def read() -> None:
        async for request in requests:
            await slots.acquire()
            task = asyncio.ensure_future(serve(request))
            task.add_done_callback(_retrieve)
            started.put_nowait(task)
        started.put_nowait(None)

    reader = asyncio.ensure_future(read())
    reader.add_done_callback(_retrieve)
    try:
        while True:
            taking = asyncio.ensure_future(started.get())
            await asyncio.wait({taking, reader}, return_when=asyncio.FIRST_COMPLETED)
            if not taking.done():  # the reader ended first: a broken request stream raises here
                taking.cancel()
                reader.result()
                taking = asyncio.ensure_future(started.get())  # it queued its end mark last
            task = await taking
            if task is None:
                return
            try:
                yield await task
            finally:
                slots.release()
    finally:
        reader.cancel()
        while not started.empty():
            pending = started.get_nowait()
            if pending is not None:
                pending.cancel()  # aborts its engine work


def _retrieve(task: asyncio.Future) -> None:
    """Mark a failure as seen: a request left unread after the stream ended (or a reader cut off) is no error."""
    if not task.cancelled():
        task.exception()
