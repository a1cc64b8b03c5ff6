"""The `thread` executor's device thread: one per process, shared by every engine that uses it; an engine built
with it loads its model and runs its load probe there (`Executor.place`), every batch computes there, and the thread
stepping the engine runs its own torch ops on one intra-op thread (`Executor.host_work`), so that on CPU the process
has one OpenMP pool (wde/components/executor.py). A `sync` engine does everything on the calling thread."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from wde import Engine
from wde.components import executor as executor_module
from wde.components.executor import SyncExecutor, ThreadExecutor, device_thread, on_device_thread
from wde.components.runner import TorchRunner
from wde.errors import ModelLoadError


MEAN = ["pooler.params.pooling=mean"]


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(thread name, intra-op threads) of every runner call: the load probe's, then each batch's."""
    seen: list[tuple[str, int]] = []
    run = TorchRunner.run

    def spy(self: TorchRunner, batch):  # noqa: ANN001
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return run(self, batch)

    monkeypatch.setattr(TorchRunner, "run", spy)
    return seen


def test_a_thread_engine_loads_probes_and_computes_on_the_device_thread(tiny_bert: Path, runs: list,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    builders: list[str] = []
    original = TorchRunner.__init__

    def spy_init(self, params, ctx):  # noqa: ANN001
        builders.append(threading.current_thread().name)
        original(self, params, ctx)

    monkeypatch.setattr(TorchRunner, "__init__", spy_init)
    with Engine.from_workflow("bert", tiny_bert, overrides=[*MEAN, "executor.name=thread"]) as engine:
        assert isinstance(engine.executor, ThreadExecutor)
        vectors = engine.embed(["a sentence", "another one, a little longer than the first"])
    assert vectors.shape[0] == 2
    assert builders and all(name.startswith("wde-device") for name in builders)
    assert len(runs) >= 2 and all(name.startswith("wde-device") for name, _ in runs)  # the probe, then batches
    assert not on_device_thread()


def test_every_thread_engine_of_a_process_shares_the_one_device_thread(tiny_bert: Path, runs: list) -> None:
    with Engine.from_workflow("bert", tiny_bert, overrides=MEAN) as first, \
            Engine.from_workflow("bert", tiny_bert, overrides=MEAN) as second:
        first.embed(["one"])
        second.embed(["two"])
        first.embed(["three"])
    names = {name for name, _ in runs}
    assert len(names) == 1 and next(iter(names)).startswith("wde-device")
    # closing an engine waits for its own batches only: the thread still serves the process
    assert device_thread().submit(threading.current_thread).result().name in names


def test_the_stepping_thread_runs_its_torch_ops_on_one_thread_while_batches_keep_every_thread(
        tiny_bert: Path, runs: list, monkeypatch: pytest.MonkeyPatch) -> None:
    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("one intra-op thread here: nothing to keep apart")
    with Engine.from_workflow("bert", tiny_bert, overrides=MEAN) as engine:
        host: list[int] = []
        build = engine.input_builder.build
        monkeypatch.setattr(engine.input_builder, "build", lambda batch: (host.append(torch.get_num_threads()),
                                                                           build(batch))[1])
        engine.embed(["a sentence"] * 3)
    assert host and set(host) == {1}  # packing, on the stepping thread
    assert runs[-1][1] == threads  # the batch, on the device thread
    assert torch.get_num_threads() == threads  # restored after each step


def test_a_sync_engine_does_everything_on_the_calling_thread(tiny_bert: Path, runs: list) -> None:
    with Engine.from_workflow("bert", tiny_bert, overrides=[*MEAN, "executor.name=sync"]) as engine:
        assert isinstance(engine.executor, SyncExecutor)
        with engine.executor.host_work():
            inside = torch.get_num_threads()
        engine.embed(["a sentence"])
    me = threading.current_thread().name
    assert [name for name, _ in runs] == [me, me]  # the probe, then the batch
    assert inside == torch.get_num_threads()  # host work is not narrowed where the same thread computes


def test_a_build_error_on_the_device_thread_reaches_the_caller(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ModelLoadError):
        Engine.from_workflow("bert", tmp_path)
    assert device_thread().submit(lambda: 7).result() == 7  # the thread survives a failed build


def test_place_on_the_device_thread_runs_inline() -> None:
    """An engine built from a task of the device thread itself must not wait on that thread (a deadlock)."""
    assert device_thread().submit(lambda: ThreadExecutor.place(threading.current_thread)).result().name \
        .startswith("wde-device")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_starts_a_device_thread_of_its_own() -> None:
    device_thread().submit(lambda: None).result()  # the parent's thread exists
    pid = os.fork()
    if pid == 0:  # the child: the parent's thread is not copied; a new one must serve
        try:
            ok = executor_module._device is None and device_thread().submit(lambda: 41 + 1).result(timeout=10) == 42
        except BaseException:  # noqa: BLE001
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
