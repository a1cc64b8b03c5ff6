"""One request's failure costs only that request: fault-injection components (tests/faults.py) in the tokenizer,
model, pooler, runner and metrics callback; the supervised engine loop; no head-of-line blocking by a huge input."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from tests import faults
from wde import Engine, PoolingParams
from wde.async_engine import AsyncEngine, EngineRestarted, EngineUnavailable

TEXTS = ["the water is hot", "a poison apple", "paris and berlin", "café naïve", "numbers 1 2 3", "last one"]
POISONED = 1


@pytest.fixture(scope="module", autouse=True)
def fault_components() -> None:
    faults.register()


@pytest.fixture(autouse=True)
def quiet_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL + 1)  # the injected faults log tracebacks on purpose


def reference(minilm_engine: Engine, texts: list[str]) -> np.ndarray:
    return minilm_engine.embed(texts)


@pytest.mark.parametrize("executor", ["sync", "thread"])
@pytest.mark.parametrize("override", ["tokenizer.name=fault_hf_tokenizer", "model_input_builder.name=fault_packed",
                                      "model.name=fault_bert", "pooler.name=fault_sentence", "runner.name=fault_torch",
                                      "output_processor.name=fault_embedding"])
def test_only_the_culprit_fails(minilm_path: Path, minilm_engine: Engine, override: str, executor: str) -> None:
    with Engine.from_workflow("bert", minilm_path, overrides=[override, f"executor.name={executor}"]) as engine:
        outs = engine.encode(TEXTS, raise_on_error=False)
    bad = outs[POISONED]
    assert not bad.ok and bad.error.kind == "internal" and bad.outputs == {}
    message = str(bad.error)
    assert bad.request_id in message and "injected" not in message and "InjectedFault" not in message
    assert isinstance(bad.error.__cause__, faults.InjectedFault)  # offline callers can still inspect the cause
    good = [i for i in range(len(TEXTS)) if i != POISONED]
    assert all(outs[i].ok for i in good)
    got = np.stack([outs[i].outputs["dense"] for i in good])
    assert np.abs(got - reference(minilm_engine, [TEXTS[i] for i in good])).max() <= 1e-5


def test_bisection_finds_the_culprit_in_a_big_batch(minilm_path: Path, minilm_engine: Engine) -> None:
    texts = [f"sentence {i} about the weather" for i in range(40)]
    texts[29] = "poison in the middle"
    with Engine.from_workflow("bert", minilm_path, overrides=["runner.name=fault_torch"]) as engine:
        at_load = engine.components["runner"].calls  # the load probe's run (wde/engine.py Engine._probe)
        outs = engine.encode(texts, raise_on_error=False)
        runs = engine.components["runner"].calls - at_load
    assert [i for i, o in enumerate(outs) if not o.ok] == [29]
    assert runs <= 1 + 2 * 6 + 1  # the batch, two halves per level down to the culprit (log2(40) < 6), its retry
    good = [o.outputs["dense"] for i, o in enumerate(outs) if i != 29]
    assert np.abs(np.stack(good) - reference(minilm_engine, texts[:29] + texts[30:])).max() <= 1e-5


def test_a_transient_fault_costs_no_request(minilm_path: Path, minilm_engine: Engine) -> None:
    texts = [f"request number {i}" for i in range(24)]
    overrides = ["runner.name=fault_torch", "runner.params.fail_every=3", "scheduler.params.max_num_requests=4"]
    with Engine.from_workflow("bert", minilm_path, overrides=overrides) as engine:
        outs = engine.encode(texts)  # raises if any request failed
        assert engine.components["runner"].faults >= 3
    assert np.abs(np.stack([o.outputs["dense"] for o in outs]) - reference(minilm_engine, texts)).max() <= 1e-5


def test_a_failing_metrics_callback_loses_nothing(minilm_path: Path) -> None:
    with Engine.from_workflow("bert", minilm_path) as engine:
        calls = []

        def broken(stats: object) -> None:
            calls.append(stats)
            raise RuntimeError("metrics backend down")

        engine.on_batch = broken
        assert engine.embed(["one", "two", "three"]).shape == (3, 384)
        assert calls


def test_the_tokenizer_copy_per_thread_keeps_results_identical(minilm_engine: Engine) -> None:
    """The engine thread and the background tokenizer each use their own tokenizer (a fast tokenizer is not
    safe to share while one call changes its truncation settings)."""
    long = "word " * 3000
    with Engine.from_workflow("bert", overrides=["request_processor.params.background_chars=1000"]) as engine:
        got = engine.embed([long, "short", long + "tail", "another"], truncate=True)
    assert np.abs(got - minilm_engine.embed([long, "short", long + "tail", "another"], truncate=True)).max() <= 1e-5


def drain(engine: Engine, want: set[str], limit: int = 20_000) -> dict[str, object]:
    done: dict[str, object] = {}
    for _ in range(limit):
        for out in engine.step():
            done[out.request_id] = out
        if want <= set(done):
            return done
    raise AssertionError(f"not finished: {sorted(want - set(done))}")


def test_a_huge_input_does_not_block_the_requests_behind_it(minilm_path: Path, minilm_engine: Engine) -> None:
    """The tokenizer holds the huge text until released; the small request queued after it finishes first."""
    huge = "many words in a very long document " * 400
    overrides = ["tokenizer.name=fault_hf_tokenizer", "tokenizer.params.hold_chars=5000",
                 "request_processor.params.background_chars=5000"]
    faults.HOLD.clear()
    with Engine.from_workflow("bert", minilm_path, overrides=overrides) as engine:
        try:
            big = engine.add_request(huge, PoolingParams(truncate=True))
            small = engine.add_request("hello")
            done = drain(engine, {small})
            assert big not in done and engine.has_unfinished()
        finally:
            faults.HOLD.set()
        done.update(drain(engine, {big}))
    assert np.abs(done[small].outputs["dense"] - minilm_engine.embed("hello")).max() <= 1e-5
    assert np.abs(done[big].outputs["dense"] - minilm_engine.embed(huge, truncate=True)).max() <= 1e-5


@pytest.fixture()
def crashing_engine(minilm_path: Path) -> Iterator[Engine]:
    with Engine.from_workflow("bert", minilm_path, overrides=["scheduler.name=fault_fcfs"]) as engine:
        yield engine


def test_the_loop_restarts_after_a_crash_and_nobody_waits_forever(crashing_engine: Engine,
                                                                  minilm_engine: Engine) -> None:
    async def scenario() -> None:
        engine = AsyncEngine(crashing_engine)
        engine.start()
        try:
            waiting = [asyncio.ensure_future(engine.encode([t], PoolingParams())) for t in ("crash now", "bystander")]
            results = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), 300)
            assert isinstance(results[0], EngineRestarted)
            assert all(isinstance(r, EngineRestarted) or r[0].ok for r in results[1:])
            assert engine.num_restarts == 1 and engine.healthy and engine.num_pending == 0
            out = await asyncio.wait_for(engine.encode(["after the restart"], PoolingParams()), 300)
            assert np.abs(out[0].outputs["dense"] - minilm_engine.embed("after the restart")).max() <= 1e-5
        finally:
            engine.stop()

    asyncio.run(scenario())


def test_a_request_arriving_while_the_loop_restarts_is_served(crashing_engine: Engine) -> None:
    """The engine's queues are reset in the same step as the waiting callers are failed: a request sent the moment
    its predecessor got `EngineRestarted` used to land in the queue just before the reset emptied it, and wait for
    ever (the reset is slowed down here to make that window wide)."""
    reset = crashing_engine.reset

    def slow_reset() -> list[str]:
        time.sleep(0.5)
        return reset()

    async def scenario() -> None:
        engine = AsyncEngine(crashing_engine)
        engine.start()
        try:
            with pytest.raises(EngineRestarted):
                await asyncio.wait_for(engine.encode(["crash now"], PoolingParams()), 300)
            out = await asyncio.wait_for(engine.encode(["right after the restart"], PoolingParams()), 30)
            assert out[0].ok and engine.num_pending == 0
        finally:
            engine.stop()

    crashing_engine.reset = slow_reset  # type: ignore[method-assign]
    try:
        asyncio.run(scenario())
    finally:
        del crashing_engine.reset


def test_the_loop_gives_up_after_repeated_crashes(crashing_engine: Engine) -> None:
    fatal: list[BaseException] = []

    async def scenario() -> None:
        # a window far longer than the test: a loaded machine that spreads the three crashes out still counts them together
        engine = AsyncEngine(crashing_engine, max_restarts=2, restart_window_s=3600, on_fatal=fatal.append)
        give_up = engine.core._give_up

        def slow_give_up(error: BaseException, **kwargs: bool) -> None:  # a busy engine thread: no caller hears first
            time.sleep(0.5)
            give_up(error, **kwargs)

        engine.core._give_up = slow_give_up  # type: ignore[method-assign]
        engine.start()
        try:
            for attempt in range(2):
                with pytest.raises(EngineRestarted):
                    await asyncio.wait_for(engine.encode(["crash again"], PoolingParams()), 300)
            with pytest.raises(EngineUnavailable, match="failed repeatedly") as last:
                await asyncio.wait_for(engine.encode(["crash again"], PoolingParams()), 300)
            assert not isinstance(last.value, EngineRestarted)  # the engine is gone: no retry will help
            assert not crashing_engine.has_unfinished()  # its queues emptied, as at every restart
            assert not engine.healthy and isinstance(engine.error, faults.InjectedFault)
            with pytest.raises(EngineUnavailable, match="not running"):
                await engine.encode(["anything"], PoolingParams())
        finally:
            engine.stop()

    asyncio.run(scenario())
    assert len(fatal) == 1 and isinstance(fatal[0], faults.InjectedFault)


def test_stop_drains_the_queue_then_fails_what_is_left(minilm_path: Path) -> None:
    async def scenario() -> list:
        with Engine.from_workflow("bert", minilm_path) as inner:
            engine = AsyncEngine(inner)
            engine.start()
            tasks = [asyncio.ensure_future(engine.encode([f"text {i}"], PoolingParams())) for i in range(20)]
            await asyncio.sleep(0)  # all twenty are queued
            await asyncio.to_thread(engine.stop)
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 300)

    results = asyncio.run(scenario())
    assert all(not isinstance(r, BaseException) and r[0].ok for r in results)
