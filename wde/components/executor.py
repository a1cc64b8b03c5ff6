"""Executors: how runner calls are issued. `sync` runs each batch inline; `thread` runs batches on a worker
thread so the engine can schedule, tokenize and pack the next batch while the current one computes."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from pydantic import Field

from typing import TYPE_CHECKING

from wde.components.base import BuildContext, Params
from wde.components.kinds import Executor

if TYPE_CHECKING:  # torch-heavy modules, needed for annotations only: validating a workflow imports no torch
    from wde.components.model_input_builder import ModelInput
    from wde.components.pooler import Pooled


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
    name = "thread"
    Params = ThreadExecutorParams

    def __init__(self, params: ThreadExecutorParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self._runner = ctx.runner
        self.max_inflight = params.max_inflight
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wde-device")

    def submit(self, batch: ModelInput) -> "Future[tuple[Pooled, float]]":
        return self._pool.submit(self._runner.run, batch)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
