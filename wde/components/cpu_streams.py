"""CPU streams: the pieces of one batch computed at once, each on its own share of the cores.

On a CPU, a batch of short sequences run with all intra-op threads spends part of its time at thread barriers
(every GEMM and elementwise op splits a small amount of work across the cores, then waits for the slowest).
Splitting the batch into `count` pieces of whole sequences (`ModelInput.split`) and running each piece on its
own thread with `threads // count` intra-op threads keeps every core on independent work, as OpenVINO's
throughput streams do (measured in docs/benchmarks.md). A batch of one sequence cannot be split and runs on the
caller's thread with every thread.

torch's intra-op thread count is process-wide, so it is lowered to the per-stream count only while a split batch
runs, and restored right after: outside `map`, the process sees the count it had.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Sequence, TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")

MAX_AUTO_STREAMS = 4
"""`auto` uses one stream per intra-op thread up to this many (measured on 2 vCPUs only: docs/benchmarks.md)."""


_THREAD_COUNT = threading.Lock()
"""Held while a split batch runs with the process's thread count lowered: one at a time per process, so two engines
in one process never restore each other's count."""


@contextlib.contextmanager
def thread_count(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to `count` for the block and restored after it: the calling thread's own
    OpenMP count, and the count threads that start meanwhile take first."""
    before = torch.get_num_threads()
    if before == count:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """`thread_count(count)` under `_THREAD_COUNT`: one such block at a time in the process."""
    with _THREAD_COUNT, thread_count(count):
        yield


def auto_streams(threads: int) -> int:
    return max(1, min(threads, MAX_AUTO_STREAMS))


class CpuStreams:
    def __init__(self, count: int, threads: int | None = None) -> None:
        self.threads = threads or torch.get_num_threads()
        self.count = max(1, min(count, self.threads))
        self.per_stream = max(1, self.threads // self.count)
        self._pool = ThreadPoolExecutor(self.count, thread_name_prefix="wde-cpu-stream")

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """fn over items, at most `count` at once, each on `per_stream` intra-op threads; results in order."""
        with intra_op_threads(self.per_stream):
            futures = [self._pool.submit(self._in_stream, fn, x) for x in items]
            return [f.result() for f in futures]

    def _in_stream(self, fn: Callable[[T], R], item: T) -> R:
        torch.set_num_threads(self.per_stream)  # this thread's own OpenMP and MKL counts (microseconds)
        return fn(item)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

