"""The one serving front end (wde/serving.py) over a scripted transport: the bookkeeping both real transports
(`InProcessCore`, `ZmqCore`) rely on — outputs in input order, refusals passed through, aborts of what is
unanswered on a cancel or a timeout, the counts, a dead core — with no model and no thread."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from wde.errors import RequestError
from wde.request import PoolingParams, Request, RequestOutput, TextPrompt
from wde.serving import (Admitted, EngineOverloaded, EngineTimeout, EngineUnavailable, ServingFrontEnd)


class _Inputs:
    def check_request(self, requests: Any, names: Any) -> None:
        return None


class ScriptedCore:
    """Answers a request `echo:<text>` at once, never answers `hang`, refuses `bad` while preparing."""

    info = None
    source = None
    tokenizer = None
    num_restarts = 0
    seconds_since_step = 0.0
    queue_depth = 0

    def __init__(self) -> None:
        self.input_processor = _Inputs()
        self.running = True
        self.front: ServingFrontEnd | None = None
        self.queued: list[str] = []
        self.aborted: list[str] = []

    def make_request(self, inputs: Any, params: PoolingParams, request_id: str, field: Any) -> Request:
        return Request(request_id, TextPrompt(inputs), params)

    def start(self, front: ServingFrontEnd) -> None:
        self.front = front

    def stop(self, timeout: float) -> None:
        self.running = False

    async def prepare(self, requests: list[Request], timeout: float | None) -> tuple[list[Any], list[Request]]:
        entries: list[Any] = []
        for r in requests:
            if r.prompt.text == "bad":
                entries.append(RequestOutput(r.request_id, error=RequestError("refused", "input")))
            else:
                entries.append(Admitted(r.request_id))
        return entries, [r for r in requests if r.prompt.text != "bad"]

    def submit(self, submission: list[Request]) -> None:
        self.queued += [r.request_id for r in submission]

    async def send(self, submission: list[Request]) -> None:
        assert self.front is not None
        self.front.resolve([(r.request_id, RequestOutput(r.request_id, {"echo": r.prompt.text}))
                            for r in submission if r.prompt.text != "hang"])

    def abort(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    def reset(self) -> None:
        self.queued.clear()


def started(limit: int = 8) -> tuple[ServingFrontEnd, ScriptedCore]:
    core = ScriptedCore()
    front = ServingFrontEnd(core, limit)  # type: ignore[arg-type]
    front.start()
    return front, core


def test_outputs_in_order_with_refusals_passed_through() -> None:
    async def scenario() -> None:
        front, core = started()
        outs = await front.encode(["a", "bad", "b"], PoolingParams(), request_id="r")
        assert [o.outputs.get("echo") for o in outs] == ["a", None, "b"]
        assert isinstance(outs[1].error, RequestError)
        assert core.queued == ["r.0-0", "r.0-2"] and front.num_pending == 0 and front.active_calls == 0

    asyncio.run(scenario())


def test_a_timeout_aborts_what_is_unanswered_and_is_counted() -> None:
    async def scenario() -> None:
        front, core = started()
        with pytest.raises(EngineTimeout, match="request timeout of 0.05 s"):
            await front.encode(["a", "hang"], PoolingParams(), request_id="t", timeout=0.05)
        assert core.aborted == ["t.0-1"]
        assert (front.num_timed_out, front.num_aborted, front.num_pending, front.active_calls) == (1, 0, 0, 0)

    asyncio.run(scenario())


def test_a_cancelled_call_aborts_and_counts_its_unanswered_inputs() -> None:
    async def scenario() -> None:
        front, core = started()
        call = asyncio.ensure_future(front.encode(["hang", "hang", "a"], PoolingParams(), request_id="c"))
        while not core.queued:
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert core.aborted == ["c.0-0", "c.0-1"] and front.num_aborted == 2 and front.num_pending == 0

    asyncio.run(scenario())


def test_the_call_limit_and_a_dead_core_refuse_calls() -> None:
    async def scenario() -> None:
        front, core = started(limit=1)
        first = asyncio.ensure_future(front.encode(["hang"], PoolingParams()))
        while not core.queued:
            await asyncio.sleep(0)
        with pytest.raises(EngineOverloaded, match="1 requests in flight, the limit is 1"):
            await front.encode(["a"], PoolingParams())
        fatal: list[BaseException] = []
        front.on_fatal = fatal.append
        gone = EngineUnavailable("the core went away")
        front.fatal(gone, gone)
        with pytest.raises(EngineUnavailable, match="the core went away"):
            await first
        assert fatal == [gone] and not front.healthy
        with pytest.raises(EngineUnavailable, match="the engine is not running: the core went away"):
            await front.encode(["a"], PoolingParams())

    asyncio.run(scenario())
