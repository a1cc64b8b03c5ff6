"""Python's cyclic garbage collector, held off while `Engine.run` (the Python API's `embed`, `encode`, corpus jobs)
works through a list of inputs.

Every input makes a handful of container objects that live until the call returns (its request, its token ids,
its output and the dict holding its vectors), so the collector, which runs every few hundred allocations and from
time to time walks the whole heap (a process with torch and transformers imported holds ~400,000 objects), finds
almost nothing to free while it spends ~12% of the engine's host time (`benchmarks/host_path.py`: one full
collection of ~0.3 s and ~200 young ones per 20,000 short inputs). On a GPU the host is the bound, so that is 12% of
the throughput.

`paused()` disables the collector for the call and enables it again after, so the objects made during the call
are looked at once, at the next collection after it, and no cycle is lost: it is only collected later. A call that
finds the collector already disabled (the caller's choice, or another thread's call inside its own pause) leaves it
as it is; calls in several threads at once keep it off until the first one ends, then it runs as usual. The
server does not use this: it serves from a frozen heap (`wde.server.heap`), for as long as it runs.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Disable the cyclic garbage collector inside the block, where it was enabled."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
