"""AsyncEngine: lets many asyncio callers share one `Engine`, whose step loop runs on its own thread: the serving
front end (wde/serving.py) over `InProcessCore`.

The event loop only validates inputs (cheap), queues them and awaits futures; the engine thread tokenizes,
batches whatever has arrived from every connection, runs the model and resolves the futures with
`loop.call_soon_threadsafe`. A failing request fails alone (`Engine.step` isolates it). The loop is
supervised: should `step` itself raise (a bug, an out-of-memory error), every caller waiting at that moment
gets `EngineRestarted`, the engine's queues are reset and the loop starts again; after `max_restarts` within
`restart_window_s` it gives up: reports unhealthy, then fails the waiting callers with `EngineUnavailable` and calls
`on_fatal` (`wde serve` then exits non-zero so a
process supervisor can restart it). No caller waits forever: stopping drains the queue, then fails what is left,
and a call given a `timeout` is aborted in the scheduler when it passes (`EngineTimeout`).

The loop beats a heartbeat (`wde.core.heartbeat`) after every step and every second while idle, so
`seconds_since_step` grows only while a step runs or the loop is stuck; the server's /health reads it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from wde.components.image_decode import ImageDecoder
from wde.core.heartbeat import Heartbeat
from wde.engine import BatchStats, Engine, EngineLoad
from wde.request import Request, RequestOutput
from wde.restarts import RestartBudget
from wde.serving import (Admitted, EngineOverloaded, EngineRestarted, EngineTimeout, EngineUnavailable, InputNames,
                         ServingFrontEnd, admit, await_within, check_capacity, input_names, timed_out)

__all__ = ["AsyncEngine", "InProcessCore", "EngineOverloaded", "EngineRestarted", "EngineTimeout",
           "EngineUnavailable", "InputNames", "admit", "await_within", "check_capacity", "input_names", "timed_out"]

log = logging.getLogger("wde.async_engine")

IDLE_BEAT_S = 0.25
"""How often an idle engine loop beats its heartbeat (a busy one beats after every step)."""


RESTARTED = "the engine restarted after an internal error while this request was waiting; retrying it is safe"


class InProcessCore:
    """The transport to an `Engine` in this process: its step loop runs on a thread, supervised (restarted after a
    failure, within `restarts`), and resolves the front end's futures as outputs come."""

    def __init__(self, engine: Engine, *, max_restarts: int = 5, restart_window_s: float = 60.0) -> None:
        self.engine = engine
        self.info = engine.info
        self.source = engine.source
        self.tokenizer = engine.tokenizer
        self.input_processor = engine.input_processor
        self.restarts = RestartBudget(max_restarts, restart_window_s)
        self.heartbeat = Heartbeat()
        self.images = ImageDecoder.of(engine)
        """Decodes a call's images before they are queued, so the engine loop never decodes (None: texts only)."""
        self.make_request = engine.make_request
        self._front: ServingFrontEnd | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def num_restarts(self) -> int:
        return self.restarts.used

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def seconds_since_step(self) -> float:
        """Seconds since the engine loop last finished a step or looked at an empty queue: near 0 unless a step
        is running or the loop is stuck."""
        return self.heartbeat.age()

    @property
    def queue_depth(self) -> int:
        return int(self.engine.scheduler.num_waiting)

    def start(self, front: ServingFrontEnd) -> None:
        self._front = front
        self.heartbeat.beat()
        self._thread = threading.Thread(target=self._run, name="wde-engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Finish what is queued (up to `timeout` seconds) and stop the loop."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.images is not None:
            self.images.close()

    async def prepare(self, requests: list[Request], timeout: float | None) -> tuple[list[Any], list[Request]]:
        """Decode a call's images (within `timeout`); the engine thread tokenizes."""
        if self.images is not None and self.images.wanted(requests):  # decoded before the engine sees them
            requests = await await_within(self.images.prepare(requests), timeout)
        entries = [r if isinstance(r, RequestOutput) else Admitted(r.request_id) for r in requests]
        return entries, [r for r in requests if not isinstance(r, RequestOutput)]

    def submit(self, submission: list[Request]) -> None:
        for r in submission:
            self.engine.scheduler.add(r)

    async def send(self, submission: list[Request]) -> None:
        self._wake.set()

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.engine.abort(rid)

    def reset(self) -> None:
        self.engine.reset()

    def _run(self) -> None:
        """The supervisor: runs the step loop, and restarts it after a failure (see the module docstring)."""
        while True:
            try:
                self._loop()
                return
            except Exception as e:  # noqa: BLE001 - recorded, callers told, loop restarted or given up
                if not self._restart(e):
                    return
            except BaseException as e:  # noqa: BLE001 - e.g. SystemExit from a plugin: never restarted
                self._give_up(e)
                return

    def _loop(self) -> None:
        engine, front = self.engine, self._front
        assert front is not None
        beat = self.heartbeat.beat
        while not self._stopping or engine.has_unfinished():
            self._wake.clear()
            outputs = engine.step()
            beat()
            if outputs:
                front.resolve([(o.request_id, o) for o in outputs])
            elif not engine.has_unfinished() and not self._stopping:
                while not self._wake.wait(IDLE_BEAT_S):
                    beat()
                beat()

    def _restart(self, error: Exception) -> bool:
        """Fail every waiting caller, reset the engine's queues; False when the restart budget is spent."""
        log.error("the engine loop failed (%s: %s); restarting it", type(error).__name__, error, exc_info=error)
        if not self.restarts.spend():  # counted before any caller hears of the restart (`num_restarts`)
            self._give_up(error, reset=True)  # unhealthy before a waiting caller hears of it
            return False
        self._front.fail_all(EngineRestarted(RESTARTED), reset=True)  # type: ignore[union-attr]
        return True

    def _give_up(self, error: BaseException, reset: bool = False) -> None:
        log.critical("the engine loop failed %d times in %.0f s (last: %s: %s); giving up", self.restarts.recent,
                     self.restarts.window_s, type(error).__name__, error)
        self._front.fatal(error, EngineUnavailable(  # type: ignore[union-attr]
            "the engine is not running: it failed repeatedly; see the server log"), reset=reset)


class AsyncEngine(ServingFrontEnd):
    """The serving front end over an `Engine` in this process. `start()` it before use and `stop()` it when done."""

    def __init__(self, engine: Engine, max_concurrent_requests: int = 512,
                 on_batch: Callable[[BatchStats], None] | None = None, *, max_restarts: int = 5,
                 restart_window_s: float = 60.0, on_fatal: Callable[[BaseException], None] | None = None) -> None:
        core = InProcessCore(engine, max_restarts=max_restarts, restart_window_s=restart_window_s)
        super().__init__(core, max_concurrent_requests, on_fatal=on_fatal)
        self.core: InProcessCore = core
        self.engine = engine
        self.restarts = core.restarts
        self.heartbeat = core.heartbeat
        self.images = core.images
        engine.on_batch = on_batch

    @property
    def load(self) -> EngineLoad:
        """Queued and running inputs and tokens of the engine (`Engine.load`)."""
        return self.engine.load()
