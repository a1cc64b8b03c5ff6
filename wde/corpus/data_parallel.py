"""Data-parallel embedding on one machine: N worker processes, each with its own engine on its own device.

The parent reads and shards the input (a feeder thread fills a bounded queue, so memory stays flat); each
worker takes a shard, embeds it and writes the shard file itself, then reports; the parent alone records finished
shards in the journal. One worker per GPU (`--devices cuda:0,cuda:1`), or several CPU workers (`--workers N`)
that split the cores between them. Workers are spawned (never forked), so CUDA and the tokenizer's threads start
clean in each. Workers ignore SIGINT (a terminal's Ctrl-C reaches the whole process group): the parent handles
SIGINT / SIGTERM, records the shards already reported, and terminates the workers, dropping their shards in flight.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import threading
from typing import Any

from wde.corpus.job import CorpusError, EmbedJob
from wde.corpus.progress import Progress
from wde.corpus.readers import Record
from wde.corpus.signals import Interrupted, check, polled
from wde.corpus.writer import ShardRecord, ShardWriter

POLL_S = 0.5


def plan_devices(workers: int, devices: list[str] | None) -> list[str]:
    """One device per worker: the given list, else `WDE_DEVICE` for all (as one worker would use), else the GPUs
    round-robin, else CPU for all."""
    if devices:
        if workers > 1 and workers != len(devices):
            raise CorpusError(f"--workers {workers} and --devices {','.join(devices)} disagree; give one of them"
                              " (--devices alone starts one worker per device)")
        return list(devices)
    forced = os.environ.get("WDE_DEVICE")
    if forced:
        return [forced] * workers
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"cuda:{i % gpus}" for i in range(workers)] if gpus else ["cpu"] * workers


def _next_task(tasks: Any, parent: int) -> Any:
    """The next shard, or None at the end; also None once the parent is gone (killed), so no worker lingers."""
    while True:
        try:
            return tasks.get(timeout=POLL_S)
        except queue.Empty:
            if os.getppid() != parent:
                return None


def _worker(wid: int, job_data: dict, device: str, threads: int, directory: str, tasks: Any, results: Any) -> None:
    """A worker process: build an engine, then embed and write shards until the sentinel (None) arrives."""
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the job; a Ctrl-C to the group is its to handle
    try:
        import torch

        if device == "cpu":
            torch.set_num_threads(threads)
        from wde.corpus.embedder import ShardEmbedder

        job = EmbedJob(**job_data)
        writer = ShardWriter(directory)
        with job.build_engine(device) as engine:
            embedder = ShardEmbedder(engine, job, lambda rows, tokens: results.put(("batch", rows, tokens)))
            results.put(("ready", wid))
            while (task := _next_task(tasks, parent)) is not None:
                index, rows, input_sha256, row_digests = task
                info = writer.write(index, embedder.embed([Record(*r) for r in rows]), row_digests)
                results.put(("shard", {**info, "input_sha256": input_sha256}))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which stops the job with this message
        results.put(("error", str(e) if isinstance(e, ValueError) else f"worker {wid} ({device}):"
                     f" {type(e).__name__}: {e}"))


def run_data_parallel(job: EmbedJob, todo: Any, writer: ShardWriter, progress: Progress, *,
                      workers: int, devices: list[str] | None = None) -> int:
    """Embed every shard of `todo` across worker processes; the number of shards written."""
    plan = plan_devices(workers, devices)
    n = len(plan)
    threads = max(1, (os.cpu_count() or 1) // n)
    ctx = mp.get_context("spawn")
    tasks = ctx.Queue(maxsize=2 * n)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, name=f"wde-embed-{i}", daemon=True,
                         args=(i, job.model_dump(), dev, threads, str(writer.directory), tasks, results))
             for i, dev in enumerate(plan)]
    with polled():  # a SIGTERM now is raised by the loop below, once the workers can be stopped
        _start_without_sigint(procs)
    stop = threading.Event()
    fed: dict[str, Any] = {"shards": 0, "done": False, "error": None}

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                tasks.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def feed() -> None:
        try:
            for shard in todo:
                rows = [(r.id, r.text, r.file, r.line, r.image) for r in shard.records]
                if not put((shard.index, rows, shard.input_sha256, shard.row_digests)):
                    return
                fed["shards"] += 1
        except Exception as e:  # noqa: BLE001 - a bad record (CorpusError) or an unreadable file ends the job
            fed["error"] = e
        finally:
            for _ in procs:
                put(None)
            fed["done"] = True

    feeder = threading.Thread(target=feed, name="wde-embed-feeder", daemon=True)
    feeder.start()
    written = 0
    interrupted = False

    def handle(msg: Any) -> None:
        nonlocal written
        if msg[0] == "batch":
            progress.batch(msg[1], msg[2])
        elif msg[0] == "ready":
            progress.start()
        elif msg[0] == "shard":
            writer.record(ShardRecord(**msg[1]))
            written += 1
        elif msg[0] == "error":
            raise CorpusError(msg[1])

    try:
        with polled():  # a signal is checked between messages, never raised inside a queue read
            while not (fed["done"] and written == fed["shards"]):
                check()
                try:
                    msg = results.get(timeout=POLL_S)
                except queue.Empty:
                    dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if dead:
                        i, code = dead[0]
                        raise CorpusError(f"embedding worker {i} ({plan[i]}) exited with code {code}; the shards"
                                          " written so far are kept: re-run with --resume") from None
                    continue
                handle(msg)
        if fed["error"] is not None:
            raise fed["error"]
    except Interrupted:
        interrupted = True
        _drain(results, handle)  # shards the workers finished before the signal are kept
        raise
    finally:
        stop.set()
        feeder.join(timeout=5)
        for p in procs:
            p.join(timeout=10 if not interrupted and written == fed["shards"] and fed["error"] is None else 0.1)
            if p.is_alive():
                p.terminate()
                p.join()
        writer.remove_temporaries()  # a worker terminated mid-write leaves its temporary file
        for q in (tasks, results):  # unread items must not block this process's exit
            q.cancel_join_thread()
            q.close()
    return written


def _start_without_sigint(procs: list[Any]) -> None:
    """Start the workers with SIGINT blocked, so a Ctrl-C while one is still starting up (before it ignores
    SIGINT itself) cannot end it with a traceback; the mask is inherited across spawn's exec."""
    block = threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_sigmask")
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if block else None
    try:
        for p in procs:
            p.start()
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _drain(results: Any, handle: Any) -> None:
    """Record the shards already reported (after a signal); everything else in the queue is dropped."""
    while True:
        try:
            msg = results.get_nowait()
        except (queue.Empty, OSError, ValueError, EOFError):
            return
        if msg[0] == "shard":
            handle(msg)
