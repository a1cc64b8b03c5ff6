"""`wde serve --api-servers N`: the engine core in one process, N API servers in others, one port for users.

The launcher starts the core (`wde.core.engine_core`), waits until its model is loaded, binds the listening
socket itself and hands it to N API-server processes (the kernel spreads connections over them), then watches
all of them. SIGINT/SIGTERM stop the API servers first (each finishes its requests in flight), then the core;
the exit code is 0. If any process dies on its own, the rest are stopped and the exit code is 3
(`EXIT_GAVE_UP`), so a process supervisor restarts the whole server; API servers answer 503 meanwhile.
"""

from __future__ import annotations

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

if TYPE_CHECKING:
    from wde.engine_info import EngineInfo
    from wde.server.config import ServerConfig

log = logging.getLogger("wde.server")

READY_TIMEOUT_S = 3600.0
"""How long the launcher waits for the core to load its model (a large model from a slow disk)."""
STOP_TIMEOUT_S = 30.0
"""How long a process gets to finish its requests after SIGTERM before it is killed."""


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
    from wde.server.startup import startup_line

    _log_to_stderr()
    resolve(**config.engine_args())  # a bad workflow fails here, by name, before any process starts
    ctx = multiprocessing.get_context("spawn")
    workdir = tempfile.mkdtemp(prefix="wde-serve-")
    address = f"ipc://{workdir}/core.sock"
    metrics_dir = os.path.join(workdir, "metrics")
    os.mkdir(metrics_dir)
    stopping: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, _: stopping.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    procs: list[BaseProcess] = []
    try:
        with _environ(PROMETHEUS_MULTIPROC_DIR=metrics_dir):
            ready, ready_child = ctx.Pipe(duplex=False)
            core = ctx.Process(target=_core_main, args=(config, address, ready_child), name="wde-engine-core")
            core.start()
            ready_child.close()
            procs.append(core)
            info = _await_ready(core, ready, stopping)
            if info is None:
                return 0 if stopping else 1
            listener = _listen(config.host, config.port)
            for i in range(api_servers):
                api = ctx.Process(target=_api_main, args=(config, info, address, i, listener),
                                  name=f"wde-api-server-{i}")
                api.start()
                procs.append(api)
            listener.close()
        log.info("%s; engine core pid %d", startup_line(config, info, served_names(config), api_servers), core.pid)
        return _supervise(core, procs[1:], stopping)
    finally:
        _stop(procs)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        shutil.rmtree(workdir, ignore_errors=True)


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
                log.critical("the engine core failed to start: %s", value)
                return None
            log.critical("the engine core exited while loading (exit code %s)", core.exitcode)
            return None
    if not stopping:
        log.critical("the engine core did not get ready within %.0f s", READY_TIMEOUT_S)
    return None


def _supervise(core: BaseProcess, apis: list[BaseProcess], stopping: list[int]) -> int:
    procs = [core, *apis]
    while not stopping:
        wait([p.sentinel for p in procs], timeout=0.5)
        dead = [p for p in procs if not p.is_alive()]
        if dead:
            for p in dead:
                log.critical("%s (pid %d) exited with code %s; stopping the server", p.name, p.pid, p.exitcode)
            return EXIT_GAVE_UP
    log.info("stopping: API servers finish their requests first, then the engine core")
    return 0


def _stop(procs: list[BaseProcess]) -> None:
    """API servers first (they drain through the core), then the core; SIGKILL after `STOP_TIMEOUT_S`."""
    for group in (procs[1:], procs[:1]):
        for p in group:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in group:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                log.error("%s did not stop within %.0f s; killing it", p.name, STOP_TIMEOUT_S)
                p.kill()
                p.join()


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


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
    from wde.core.engine_core import EngineCore, stop_on_sigterm
    from wde.engine import Engine
    from wde.engine_info import EngineInfo
    from wde.errors import ModelLoadError
    from wde.server.app import _log_to_stderr
    from wde.server.metrics import ServerMetrics

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _log_to_stderr()
    try:
        engine = Engine.from_workflow(**config.engine_args())
    except ModelLoadError as e:  # the launcher raises it again: `wde serve` prints it and exits 1
        ready.send(("refused", str(e)))
        raise SystemExit(1) from None
    except Exception as e:  # noqa: BLE001 - reported to the launcher, which exits non-zero
        ready.send(("error", f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    metrics = ServerMetrics()
    engine.on_batch = metrics.on_batch
    with engine:
        core = EngineCore(engine, address, on_step=lambda c: metrics.on_core_step(
            int(getattr(c.engine.scheduler, "num_waiting", 0)), c.restarts.used))
        stop_on_sigterm(core)
        ready.send(("ready", EngineInfo.of(engine)))
        ready.close()
        code = core.run()
    raise SystemExit(code)


def _api_main(config: ServerConfig, info: EngineInfo, address: str, index: int, listener: socket.socket) -> None:
    """One API-server process: HTTP, validation, tokenization and response encoding; the model is elsewhere."""
    import uvicorn

    from wde.core.client import CoreClient
    from wde.core.frontend import Frontend
    from wde.engine import resolve
    from wde.server.app import _log_to_stderr, create_app

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _log_to_stderr()
    workflow, source = resolve(**config.engine_args())
    client = CoreClient(Frontend(workflow, source, info), address, config.max_concurrent_requests, tag=f"a{index}.")
    app = create_app(client, config)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=config.access_log))
    client.on_fatal = lambda error: setattr(server, "should_exit", True)
    # uvicorn re-raises a caught SIGTERM after its graceful shutdown; a no-op handler makes that a clean exit.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run(sockets=[listener])
    raise SystemExit(EXIT_GAVE_UP if client.error is not None else 0)
