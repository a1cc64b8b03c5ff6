"""Executors: how runner calls are issued. `sync` runs each batch inline; `thread` runs batches on the process's
device thread so the engine can schedule, tokenize and pack the next batch while the current one computes.

The device thread is one per process, shared by every `thread` executor, and the engines that use it build their
components and run their load probe on it too (`Executor.place`). On CPU that keeps one OpenMP thread pool in the
process: torch's OpenMP runtime (libgomp) gives each thread that starts parallel work a pool of its own, and once
its pools hold more threads than there are CPUs it cuts the time its idle threads spin before they sleep, so every
op then waits for a sleeping thread to wake. A model loaded on one thread and run on another measured ~10% slower
for it (all-MiniLM-L6-v2 int8, long texts, 2 vCPUs: docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Callable, ContextManager, TypeVar

from pydantic import Field

from wde.components.base import BuildContext, Params
from wde.components.kinds import Executor

if TYPE_CHECKING:  # torch-heavy modules, needed for annotations only: validating a workflow imports no torch
    from wde.components.model_input_builder import ModelInput
    from wde.components.pooler import Pooled

T = TypeVar("T")

_device_lock = threading.Lock()
_device: ThreadPoolExecutor | None = None
_device_ident: int | None = None


def device_thread() -> ThreadPoolExecutor:
    """The process's device thread (started on first use; a forked child starts its own)."""
    global _device
    with _device_lock:
        if _device is None:
            _device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wde-device",
                                         initializer=_mark_device_thread)
        return _device


def _mark_device_thread() -> None:
    global _device_ident
    _device_ident = threading.get_ident()


def on_device_thread() -> bool:
    """Whether the calling thread is the device thread."""
    return _device_ident is not None and threading.get_ident() == _device_ident


def _forget_device_thread() -> None:  # a forked child has no copy of the parent's threads
    global _device, _device_ident, _device_lock
    _device, _device_ident, _device_lock = None, None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_device_thread)


class SyncExecutor(Executor):
    """Runs each batch inline: the future is done when `submit` returns."""

    name = "sync"
    Params = Params

    def __init__(self, params: Params, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self._runner = ctx.runner

    def submit(self, batch: ModelInput) -> "Future[tuple[Pooled, float]]":
        fut: Future[tuple[Pooled, float]] = Future()
        try:
            fut.set_result(self._runner.run(batch))
        except BaseException as e:  # noqa: BLE001 - delivered to the waiter
            fut.set_exception(e)
        return fut


class ThreadExecutorParams(Params):
    max_inflight: int = Field(2, ge=1, le=8, description="batches queued on the device thread at once")


class ThreadExecutor(Executor):
    """Runs batches on the process's device thread (shared with the other engines of the process), where the
    engine's components were built (`place`)."""

    name = "thread"
    Params = ThreadExecutorParams

    def __init__(self, params: ThreadExecutorParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self._runner = ctx.runner
        self.max_inflight = params.max_inflight
        self._pending: set[Future[tuple[Pooled, float]]] = set()

    @classmethod
    def place(cls, fn: Callable[[], T]) -> T:
        if on_device_thread():  # already there (an engine built by a task of the device thread)
            return fn()
        return device_thread().submit(fn).result()

    def submit(self, batch: ModelInput) -> "Future[tuple[Pooled, float]]":
        future = device_thread().submit(self._runner.run, batch)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return future

    def shutdown(self) -> None:
        """Wait for this engine's batches; the device thread stays for the process's other engines."""
        wait(list(self._pending))

    def host_work(self) -> ContextManager[None]:
        """The stepping thread's torch ops (packing, output conversion) on one intra-op thread, so that they never
        start an OpenMP pool beside the device thread's (module docstring); not taken under `_THREAD_COUNT`, which a
        split batch on the device thread holds for its whole forward."""
        if on_device_thread():
            return contextlib.nullcontext()
        from wde.components.cpu_streams import thread_count  # torch-side: validating a workflow imports no torch

        return thread_count(1)
