"""`wde serve --api-servers N`: the engine core in one process, N API servers in others, one port for users.

The launcher binds the listening sockets first (a port in use fails at once, nothing loaded), starts the core
(`wde.core.engine_core`), waits until its model is loaded, and hands the sockets to N API-server processes (the
kernel spreads connections over them), then watches all of them. SIGINT/SIGTERM stop the API servers first
(each finishes its requests in flight), then the core; the exit code is 0. If any process dies on its own, the
rest are stopped and the exit code is 3 (`EXIT_GAVE_UP`), so a process supervisor restarts the whole server; API
servers answer 503 meanwhile.

A stop signal sent to the whole process group or control group (Ctrl-C in a terminal, `kill -- -PGID`, GNU
`timeout`, systemd's default `KillMode=control-group`) reaches every process at once. The core ignores SIGTERM
while the launcher lives and stops on `STOP_CORE` (SIGUSR1) from the launcher, after the API servers have finished
their requests through it; an API server stops on SIGTERM whenever it comes (before its server runs, it exits at
once); and a process that died of the same signal the launcher got is part of the stop, not a failure.
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

from wde.core.engine_core import EXIT_GAVE_UP
from wde.server.heap import frozen_heap
from wde.server.startup import StartupError

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


def default_api_servers(device: str | None = None) -> int:
    """API servers `wde serve` starts when not told: none on a CPU-only host (the model needs every core; the
    engine runs in the server's process), else a quarter of the cores, 1 to 8."""
    import torch

    if (device or "").startswith("cpu") or (device is None and not torch.cuda.is_available()):
        return 0
    return max(1, min(8, (os.cpu_count() or 1) // 4))


def run_split_server(config: ServerConfig, api_servers: int) -> int:
    """Serve with the engine core in its own process; returns the exit code (see the module docstring)."""
    from wde.engine import resolve
    from wde.server.app import _log_to_stderr
    from wde.server.service import served_names
    from wde.server.startup import listen, startup_line

    _log_to_stderr(config.log_level)
    listeners = listen(config.host, config.port)  # before anything loads: a port in use fails at once
    workdir: str | None = None
    stopping: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, _: stopping.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    procs: list[BaseProcess] = []
    try:
        if config.port == 0:  # the port the kernel chose, for the start-up line
            config = dataclasses.replace(config, port=listeners[0].getsockname()[1])
        resolve(**config.engine_args())  # a bad workflow fails here, by name, before any process starts
        ctx = multiprocessing.get_context("spawn")
        workdir = _workdir()
        address = f"ipc://{workdir}/core.sock"
        metrics_dir = os.path.join(workdir, "metrics")
        os.mkdir(metrics_dir)
        with _environ(PROMETHEUS_MULTIPROC_DIR=metrics_dir):  # this server's own, whatever the caller's says
            ready, ready_child = ctx.Pipe(duplex=False)
            core = ctx.Process(target=_core_main, args=(config, address, ready_child), name="wde-engine-core")
            core.start()
            ready_child.close()
            procs.append(core)
            info = _await_ready(core, ready, stopping)
            if info is None:
                return 0
            for i in range(api_servers):
                api = ctx.Process(target=_api_main, args=(config, info, address, i, listeners),
                                  name=f"wde-api-server-{i}")
                api.start()
                procs.append(api)
        for sock in listeners:  # the API servers have their own copies
            sock.close()
        log.info("%s; engine core pid %d", startup_line(config, info, served_names(config), api_servers), core.pid)
        return _supervise(core, procs[1:], stopping)
    finally:
        _stop(procs)
        for sock in listeners:
            sock.close()
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


def _supervise(core: BaseProcess, apis: list[BaseProcess], stopping: list[int]) -> int:
    procs = [core, *apis]
    while not stopping:
        wait([p.sentinel for p in procs], timeout=0.5)
        dead = [p for p in procs if not p.is_alive()]
        if dead and not _stopped_with_us(dead, stopping):
            for p in dead:
                log.critical("%s (pid %d) exited with code %s; stopping the server", p.name, p.pid, p.exitcode)
            return EXIT_GAVE_UP
    log.info("stopping: API servers finish their requests first, then the engine core")
    return 0


def _stop(procs: list[BaseProcess]) -> None:
    """API servers first (SIGTERM: they drain through the core), then the core (`STOP_CORE`); SIGKILL after
    `STOP_TIMEOUT_S`."""
    for group, stop_signal in ((procs[1:], signal.SIGTERM), (procs[:1], STOP_CORE)):
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


def _quieter(level: str, floor: str) -> str:
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


def _core_main(config: ServerConfig, address: str, ready: Connection) -> None:
    """The engine core process."""
    from wde.core.engine_core import EngineCore
    from wde.engine import Engine
    from wde.engine_info import EngineInfo
    from wde.errors import ModelLoadError
    from wde.server.app import _log_to_stderr
    from wde.server.metrics import ServerMetrics

    launcher = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _log_to_stderr(config.log_level)
    try:
        engine = Engine.from_workflow(**config.engine_args())
    except ModelLoadError as e:  # the launcher raises it again: `wde serve` prints it and exits 1
        log.debug("the engine core could not load the model", exc_info=True)
        ready.send(("refused", str(e)))
        raise SystemExit(1) from None
    except Exception as e:  # noqa: BLE001 - reported to the launcher, which exits non-zero
        log.debug("the engine core failed to start", exc_info=True)
        ready.send(("error", f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    metrics = ServerMetrics()
    engine.on_batch = metrics.on_batch
    with engine:
        core = EngineCore(engine, address, on_step=lambda c: metrics.on_core_step(
            int(getattr(c.engine.scheduler, "num_waiting", 0)), c.restarts.used))
        _stop_on_launcher_signal(core, launcher)
        ready.send(("ready", EngineInfo.of(engine)))
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


def _api_main(config: ServerConfig, info: EngineInfo, address: str, index: int,
              listeners: list[socket.socket]) -> None:
    """One API-server process: HTTP, validation, tokenization and response encoding; the model is elsewhere."""
    import uvicorn

    from wde.core.client import CoreClient
    from wde.core.frontend import Frontend
    from wde.engine import resolve
    from wde.server.app import _log_to_stderr, create_app
    from wde.server.timeouts import http_protocol

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    told: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _: told.append(signum))  # told to stop before serving
    _log_to_stderr(config.log_level)
    workflow, source = resolve(**config.engine_args())
    client = CoreClient(Frontend(workflow, source, info), address, config.max_concurrent_requests, tag=f"a{index}.")
    app = create_app(client, config)
    server = uvicorn.Server(uvicorn.Config(app, log_level=_quieter(config.log_level, "warning"),
                                           access_log=config.access_log,
                                           http=http_protocol(config, app.state.service.metrics)))
    client.on_fatal = lambda error: setattr(server, "should_exit", True)
    # uvicorn re-raises a caught SIGTERM after its graceful shutdown into the handler in place before it ran;
    # this one makes that a clean exit, and stops the server if the signal comes before uvicorn's handler is in.
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    if told:
        raise SystemExit(0)
    with frozen_heap():
        server.run(sockets=listeners)
    raise SystemExit(EXIT_GAVE_UP if client.error is not None else 0)
