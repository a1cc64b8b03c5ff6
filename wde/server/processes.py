"""`wde serve --api-servers N`: the engine core in one process, N API servers in others, one port for users.

The launcher checks the port and makes each API server's listening sockets first (a port in use fails at once,
nothing loaded; `wde.server.listeners`: with `SO_REUSEPORT` each API server has sockets of its own and the kernel
spreads connections over them), starts the core (`wde.core.engine_core`) and N API-server processes
(`wde.server.api_server`) at once, sends the API servers the core's description (`EngineInfo`) once its model is
loaded, then watches all of them (an API server imports its libraries and resolves its workflow while the model
loads). A server of several models (`wde serve --model A --model B`) has one core per model, loading at once, each
on its own socket; every API server is a client of every core, and the death of any core stops the server (exit
3), as the one core's does.

An API server that dies (killed, crashed, out of memory) takes the connections it holds with it: their clients
see the connection reset, and the connections waiting in its backlog are reset too. The others keep serving; the
launcher tells the core to drop the dead one's requests (`wire.Gone`) and starts a new process in its place, with
one log line. That restart is limited: an API server that dies more than `API_RESTARTS` times within
`API_RESTART_WINDOW_S` makes the launcher stop the server and exit 3 (`EXIT_GAVE_UP`, for a supervisor to restart
the whole server), and one that dies before it serves `START_FAILURES` times in a row (it cannot start: its log
says why) makes it exit 1 with one line, as any start-up failure does. Restarts after a start-up failure wait
`START_BACKOFF_S`, doubled each time. If the core dies, the API servers answer 503 and stop, and the launcher stops
the rest and exits 3.

SIGINT/SIGTERM stop the API servers first (each finishes its requests in flight), then the core; the exit code is
0. A stop signal sent to the whole process group or control group (Ctrl-C in a terminal, `kill -- -PGID`, GNU
`timeout`, systemd's default `KillMode=control-group`) reaches every process at once. The core ignores SIGTERM
while the launcher lives and stops on `STOP_CORE` (SIGUSR1) from the launcher, after the API servers have finished
their requests through it; an API server stops on SIGTERM whenever it comes (before its server runs, it exits at
once); and a process that died of the same signal the launcher got is part of the stop, not a failure (an API
server sent SIGTERM alone is restarted).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from wde.core import wire
from wde.restarts import EXIT_GAVE_UP, RestartBudget
from wde.server.api_server import api_server_main, routing_id
from wde.server.grpc import prepare as prepare_grpc
from wde.server.heap import frozen_heap
from wde.server.listeners import SplitListeners
from wde.server.startup import StartupError, log_to_stderr

if TYPE_CHECKING:
    from wde.core.engine_core import EngineCore
    from wde.engine_info import EngineInfo
    from wde.server.config import ServerConfig

log = logging.getLogger("wde.server")

READY_TIMEOUT_S = 3600.0
"""How long the launcher waits for the core to load its model (a large model from a slow disk)."""
STOP_TIMEOUT_S = 30.0
"""How long a process gets to finish its requests after SIGTERM before it is killed."""
STOP_CORE = signal.SIGUSR1
"""What the launcher stops the core with, once the API servers are gone (SIGTERM reaches it from the process group
while they still need it)."""
SIGNAL_GRACE_S = 1.0
"""How long the launcher waits for a stop signal of its own after a child died of SIGTERM/SIGINT (a signal to the
whole group reaches the processes in no set order)."""
API_RESTARTS = 5
API_RESTART_WINDOW_S = 60.0
"""An API server that served is restarted after each death, up to `API_RESTARTS` deaths within this window (the
next one stops the server: exit 3)."""
START_FAILURES = 3
"""An API server that dies before it serves this many times in a row cannot start: the launcher exits 1."""
START_BACKOFF_S = 0.5
"""The wait before restarting an API server that died before it served, doubled after each such death."""
CORE_GRACE_S = 2.0
"""How long the launcher waits to see the core's exit when an API server exits 3 (it lost the core)."""


def default_api_servers(device: str | None = None) -> int:
    """API servers `wde serve` starts when not told: none on a CPU-only host (the model needs every core; the
    engine runs in the server's process), else a quarter of the cores, 1 to 8."""
    import torch

    if (device or "").startswith("cpu") or (device is None and not torch.cuda.is_available()):
        return 0
    return max(1, min(8, (os.cpu_count() or 1) // 4))


def run_split_server(config: ServerConfig, api_servers: int) -> int:
    """Serve with each model's engine core in its own process; returns the exit code (see the module docstring)."""
    from wde.engine import resolve
    from wde.server.model_config import name_table
    from wde.server.service import check_long_inputs
    from wde.server.startup import startup_line

    log_to_stderr(config.log_level)
    listeners = SplitListeners(config.host, config.port)  # before anything loads: a port in use fails at once
    first: list[list[socket.socket]] = []
    workdir: str | None = None
    stopping: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, _: stopping.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    cores: list[BaseProcess] = []
    apis: _ApiServers | None = None
    try:
        first = listeners.first(api_servers)  # connections made while the model loads wait in these backlogs
        if config.port == 0:  # the port the kernel chose, for the start-up line
            config = dataclasses.replace(config, port=listeners.port)
        config = prepare_grpc(config)  # every API server serves gRPC on this one port (SO_REUSEPORT)
        count = len(config.served_models())
        for i in range(count):  # a bad workflow fails here, by name, before any process starts
            resolve(**config.engine_args(i))
        ctx = multiprocessing.get_context("spawn")
        workdir = _workdir()
        addresses = [f"ipc://{workdir}/core{i}.sock" for i in range(count)]
        metrics_dir = os.path.join(workdir, "metrics")
        os.mkdir(metrics_dir)
        with _environ(PROMETHEUS_MULTIPROC_DIR=metrics_dir):  # this server's own, whatever the caller's says
            readies = []
            for i, address in enumerate(addresses):  # every model loads at once, each in its own core
                ready, ready_child = ctx.Pipe(duplex=False)
                name = "wde-engine-core" if count == 1 else f"wde-engine-core-{i}"
                cores.append(ctx.Process(target=_core_main, args=(config, i, address, ready_child), name=name))
                cores[-1].start()
                ready_child.close()
                readies.append(ready)
            # The API servers start now too: they import and wait for the cores' descriptions while the models
            # load (on 2 vCPUs a server of 2 API servers got healthy in ~15 s instead of ~20 s).
            apis = _ApiServers(ctx, config, addresses, listeners, metrics_dir)
            apis.start(first)
            first = []
            infos = []
            for core, ready in zip(cores, readies):
                info = _await_ready(core, ready, stopping)
                if info is None:
                    return 0
                check_long_inputs(config, info)
                infos.append(info)
            apis.describe(infos)
            names = name_table(config.served_models())
            pids = ", ".join(f"{c.pid}" + (f" ({names[i][0]})" if count > 1 else "") for i, c in enumerate(cores))
            log.info("%s; engine core pid %s; API server pids %s",
                     startup_line(config, infos[0], names[0], api_servers, others=list(zip(infos[1:], names[1:]))),
                     pids, ", ".join(str(p.pid) for p in apis.processes()))
            return apis.supervise(cores, stopping)
    finally:
        for sockets in first:
            listeners.release(sockets)
        _stop(cores, apis.processes() if apis is not None else [])
        if apis is not None:
            apis.close()
        listeners.close()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


def _workdir() -> str:
    """The server's private folder: the core's socket and the metrics of every process."""
    try:
        return tempfile.mkdtemp(prefix="wde-serve-")
    except OSError as e:
        raise StartupError(f"cannot make a working folder in {tempfile.gettempdir()} ({e.strerror or e}): set"
                           " TMPDIR to a folder the server may write") from None


def _stopped_with_us(dead: list[BaseProcess], stopping: list[int]) -> bool:
    """Whether `dead` ended as part of a stop: each exited 0 or died of SIGTERM/SIGINT, and the launcher was told
    to stop too (a signal to the whole group: waits up to `SIGNAL_GRACE_S` for it to arrive here)."""
    if not all(p.exitcode in (0, -signal.SIGTERM, -signal.SIGINT) for p in dead):
        return False
    deadline = time.monotonic() + SIGNAL_GRACE_S
    while not stopping and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(stopping)


def _await_ready(core: BaseProcess, ready: Connection, stopping: list[int]) -> EngineInfo | None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and not stopping:
        if wait([ready, core.sentinel], timeout=0.5):
            if ready.poll():
                status, value = ready.recv()
                if status == "ready":
                    return value
                if status == "refused":  # a broken model folder: one line, as `wde serve` without API servers
                    from wde.errors import ModelLoadError

                    raise ModelLoadError(value)
                raise StartupError(f"the engine core failed to start: {value}")
            core.join(1)
            if _stopped_with_us([core], stopping):
                return None
            raise StartupError(f"the engine core exited while loading the model (exit code {core.exitcode}); the"
                               " log above says why")
    if not stopping:
        raise StartupError(f"the engine core did not get ready within {READY_TIMEOUT_S:.0f} s")
    return None


class _Slot:
    """API server `index`: the process in its place now, and how it has been dying."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.name = f"wde-api-server-{index}"
        self.generation = -1
        """Processes started in this place before the current one (its routing id is `routing_id(index, this)`)."""
        self.proc: BaseProcess | None = None
        self.ready: Connection | None = None
        """The launcher's end of the process's pipe: the cores' descriptions go down it, "serving" comes back up;
        closed once the process said it."""
        self.serving = False
        self.start_failures = 0
        """Deaths before serving, in a row."""
        self.restart_at: float | None = None
        self.budget = RestartBudget(API_RESTARTS, API_RESTART_WINDOW_S)


class _ApiServers:
    """Starts the API servers, watches them with the core, and restarts the ones that die (module docstring)."""

    def __init__(self, ctx: multiprocessing.context.SpawnContext, config: ServerConfig, addresses: list[str],
                 listeners: SplitListeners, metrics_dir: str) -> None:
        import zmq

        from wde.core.engine_core import socket as core_socket

        self.ctx = ctx
        self.config = config
        self.infos: list[EngineInfo] | None = None
        """Each core's description once its model is loaded (`describe`); every process started after gets it at
        once."""
        self.addresses = addresses
        """Each served model's core, in `config.served_models()` order."""
        self.listeners = listeners
        self.metrics_dir = metrics_dir
        self.slots: list[_Slot] = []
        self._cores = [core_socket(a, zmq.DEALER, bind=False, routing_id=b"launcher") for a in addresses]
        """Where `wire.Gone` goes when an API server died: every core."""

    def processes(self) -> list[BaseProcess]:
        return [s.proc for s in self.slots if s.proc is not None]

    def start(self, first: list[list[socket.socket]]) -> None:
        for i, sockets in enumerate(first):
            self.slots.append(_Slot(i))
            self._start(self.slots[-1], sockets)

    def describe(self, infos: list[EngineInfo]) -> None:
        """The cores are ready: send their descriptions to the API servers started before (one that died meanwhile
        is seen, and restarted, by `supervise`)."""
        self.infos = infos
        for s in self.slots:
            if s.ready is not None:
                _send(s.ready, infos)

    def close(self) -> None:
        for s in self.slots:
            if s.ready is not None:
                s.ready.close()
        for core in self._cores:
            core.close(0)

    def supervise(self, cores: list[BaseProcess], stopping: list[int]) -> int:
        """Watch the cores and API servers until told to stop (0) or a core dies (`EXIT_GAVE_UP`): the server is
        whole only while every model's core lives."""
        while not stopping:
            due = [s.restart_at for s in self.slots if s.restart_at is not None]
            timeout = max(0.0, min([0.5, *(t - time.monotonic() for t in due)]))
            waiting: list = [*(c.sentinel for c in cores), *(p.sentinel for p in self.processes())]
            wait(waiting + [s.ready for s in self.slots if s.ready is not None], timeout)
            self._note_serving()
            dead = [s for s in self.slots if s.proc is not None and not s.proc.is_alive()]
            if any(s.proc.exitcode == EXIT_GAVE_UP for s in dead if s.proc is not None):
                for core in cores:  # it lost a core: is that core gone?
                    core.join(CORE_GRACE_S / len(cores))
            ended = [p for p in (*cores, *(s.proc for s in dead)) if p is not None and not p.is_alive()]
            if ended and _stopped_with_us(ended, stopping):
                break
            for core in cores:
                if not core.is_alive():
                    log.critical("%s (pid %d) exited with code %s; stopping the server", core.name, core.pid,
                                 core.exitcode)
                    return EXIT_GAVE_UP
            for s in dead:
                if not self._replace(s):
                    return EXIT_GAVE_UP
            for s in self.slots:
                if s.restart_at is not None and s.restart_at <= time.monotonic():
                    self._start(s, self.listeners.replacement())
        log.info("stopping: API servers finish their requests first, then the engine core")
        return 0

    def _start(self, s: _Slot, sockets: list[socket.socket]) -> BaseProcess:
        s.generation += 1
        s.restart_at = None
        s.serving = False
        ready, ready_child = self.ctx.Pipe()
        proc = self.ctx.Process(target=api_server_main, name=s.name,
                                args=(self.config, self.addresses, s.index, s.generation, sockets, ready_child))
        try:
            proc.start()
        finally:
            ready_child.close()
            self.listeners.release(sockets)  # the process has its own copies
        s.proc, s.ready = proc, ready
        if self.infos is not None:
            _send(ready, self.infos)
        return proc

    def _note_serving(self) -> None:
        for s in self.slots:
            if s.ready is not None and s.ready.poll():
                try:
                    s.ready.recv()
                    s.serving = True
                    s.start_failures = 0
                except (EOFError, OSError):  # it died before it served (a reset: it died before it read the
                    pass                          # descriptions sent to it): seen with its exit
                s.ready.close()
                s.ready = None

    def _replace(self, s: _Slot) -> bool:
        """Clean up after the dead API server in `s` and restart it (now, or after a back-off if it never served);
        False when it died too often while serving (raises `StartupError` when it cannot start)."""
        from prometheus_client import multiprocess

        dead, served = s.proc, s.serving
        assert dead is not None and dead.pid is not None
        if s.ready is not None:
            s.ready.close()
        s.proc, s.ready, s.serving = None, None, False
        multiprocess.mark_process_dead(dead.pid, self.metrics_dir)  # its live gauges leave the sums
        for core in self._cores:
            core.send(wire.encoder.encode(wire.Gone(routing_id(s.index, s.generation))))
        how = _ended(dead.exitcode)
        if served:
            if not s.budget.spend():
                log.critical("%s (pid %d) %s, its %d%s death within %.0f s; stopping the server", s.name, dead.pid,
                             how, s.budget.recent, _ordinal(s.budget.recent), s.budget.window_s)
                return False
            new = self._start(s, self.listeners.replacement())
            log.warning("%s (pid %d) %s; restarted it as pid %d (the others kept serving)", s.name, dead.pid, how,
                        new.pid)
            return True
        s.start_failures += 1
        if s.start_failures >= START_FAILURES:
            raise StartupError(f"{s.name} {how} before it could serve, {s.start_failures} times in a row; the log"
                               " above says why")
        delay = START_BACKOFF_S * 2 ** (s.start_failures - 1)
        s.restart_at = time.monotonic() + delay
        log.error("%s (pid %d) %s before it could serve; restarting it in %.1f s", s.name, dead.pid, how, delay)
        return True


def _send(ready: Connection, infos: list[EngineInfo]) -> None:
    """The cores' descriptions to an API server (a few hundred bytes: never blocks); one that already died is seen
    with its exit."""
    try:
        ready.send(infos)
    except OSError:
        pass


def _ended(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            pass
    return f"exited with code {exitcode}"


def _ordinal(n: int) -> str:
    return "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


def _stop(cores: list[BaseProcess], apis: list[BaseProcess]) -> None:
    """API servers first (SIGTERM: they drain through the cores), then the cores (`STOP_CORE`); SIGKILL after
    `STOP_TIMEOUT_S`."""
    for group, stop_signal in ((apis, signal.SIGTERM), (cores, STOP_CORE)):
        for p in group:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, stop_signal)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in group:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                log.error("%s did not stop within %.0f s; killing it", p.name, STOP_TIMEOUT_S)
                p.kill()
                p.join()


def quieter(level: str, floor: str) -> str:
    """`level`, but no chattier than `floor` unless it is debug (API servers log uvicorn's warnings, not its
    per-process start-up lines)."""
    from wde.server.config import LOG_LEVELS

    return level if level == "debug" or LOG_LEVELS.index(level) < LOG_LEVELS.index(floor) else floor


class _environ:
    """Set environment variables for the processes started inside the block (restored after)."""

    def __init__(self, **values: str) -> None:
        self.values = values
        self.saved: dict[str, str | None] = {}

    def __enter__(self) -> None:
        for k, v in self.values.items():
            self.saved[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc: object) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _core_main(config: ServerConfig, index: int, address: str, ready: Connection) -> None:
    """The engine core process of served model `index`."""
    from wde.core.engine_core import EngineCore
    from wde.engine import Engine
    from wde.errors import ModelLoadError
    from wde.server.metrics import ServerMetrics
    from wde.server.model_config import name_table

    launcher = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log_to_stderr(config.log_level)
    try:
        engine = Engine.from_workflow(**config.engine_args(index))
    except ModelLoadError as e:  # the launcher raises it again: `wde serve` prints it and exits 1
        log.debug("the engine core could not load the model", exc_info=True)
        ready.send(("refused", str(e)))
        raise SystemExit(1) from None
    except Exception as e:  # noqa: BLE001 - reported to the launcher, which exits non-zero
        log.debug("the engine core failed to start", exc_info=True)
        ready.send(("error", f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    metrics = ServerMetrics().for_model(name_table(config.served_models())[index][0])
    metrics.on_weights(engine.components["model"])
    if engine.info.token_budget is not None:
        metrics.token_budget.set(engine.info.token_budget)
    engine.on_batch = metrics.on_batch
    with engine:
        core = EngineCore(engine, address, on_step=lambda c: metrics.on_core_step(c.engine.load(), c.restarts.used))
        _stop_on_launcher_signal(core, launcher)
        ready.send(("ready", engine.info))
        ready.close()
        with frozen_heap():
            code = core.run()
    raise SystemExit(code)


def _stop_on_launcher_signal(core: EngineCore, launcher: int) -> None:
    """The core finishes the requests in hand and exits on `STOP_CORE`, which the launcher sends once the API
    servers are gone. A SIGTERM to the process group is ignored while the launcher lives (the API servers still
    drain their requests through this core); an orphaned core (its launcher killed) stops on SIGTERM as usual."""

    def on_sigterm(signum: int, frame: object) -> None:
        if os.getppid() != launcher:
            core.stopping = True

    signal.signal(STOP_CORE, lambda *_: setattr(core, "stopping", True))
    signal.signal(signal.SIGTERM, on_sigterm)
