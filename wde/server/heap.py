"""Keep Python's cyclic garbage collector off the serving path: serve inside `frozen_heap()` once start-up is done.

A served process holds a few hundred thousand long-lived container objects (torch, transformers, FastAPI,
pydantic, the model's modules), and every request allocates dicts and lists. Each time those allocations trigger
a full (generation 2) collection, the collector walks the whole heap on the thread that allocated, holding the
GIL: on the event loop that is a stall of 25-150 ms during which no request is read and no response is sent
(measured with all-MiniLM-L6-v2 under 64 closed-loop clients on a 2-vCPU Xeon: nine such pauses in 6 s, the
requests they caught made the p99 435 ms against a 246 ms median). `gc.freeze()` moves every object alive at
that point into a permanent generation the collector never scans again, so later collections walk only what
requests allocated: the same load then had no pause over 33 ms and a p99 of 279 ms (docs/benchmarks.md).
CPython's documentation recommends it for exactly this, and vLLM's server does the same after loading.

What it costs: a cycle of objects made before the freeze and dropped while frozen is not reclaimed until the
heap is unfrozen. Start-up objects live as long as the server, so it loses nothing; `frozen_heap()` unfreezes when
serving ends, so a server run inside another program (a test, a notebook) leaves its collector as it was. The
Python API (`Engine`) freezes nothing (the process is the caller's); it holds the collector off for the length of
each call instead (`wde.collector`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from typing import Iterator

log = logging.getLogger("wde.server")


@contextlib.contextmanager
def frozen_heap() -> Iterator[int]:
    """Collect once, freeze every object still alive for the block (yields how many are frozen), unfreeze after."""
    gc.collect()
    gc.freeze()
    count = gc.get_freeze_count()
    log.debug("froze %d start-up objects out of the garbage collector's reach", count)
    try:
        yield count
    finally:
        gc.unfreeze()
