"""One API-server process of `wde serve --api-servers N`: HTTP, validation, tokenization and response encoding; the
model is in the engine-core process (`wde.server.processes` starts and restarts these).

Each process has a ZeroMQ routing id of its own, `a{index}.{generation}` (`generation` counts the restarts of that
index), which also tags its request ids, so the core never mixes a dead process's requests with its successor's
and the launcher can name the dead one (`wire.Gone`). It tells the launcher once it serves (its sockets listen),
which is how the launcher tells a server that fails at start-up from one that died while serving. It counts the
connections it accepts, `wde_api_server_connections_total{api_server="<index>"}` in /metrics, to show how the
kernel spreads them.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import uvicorn

from wde.restarts import EXIT_GAVE_UP
from wde.server.heap import frozen_heap

if TYPE_CHECKING:
    from wde.engine_info import EngineInfo
    from wde.server.config import ServerConfig


def routing_id(index: int, generation: int) -> bytes:
    """The ZeroMQ routing id of API server `index` after `generation` restarts (never reused while the server runs)."""
    return f"a{index}.{generation}".encode()


def api_server_main(config: ServerConfig, addresses: list[str], index: int, generation: int,
                    sockets: list[socket.socket], ready: Connection) -> None:
    """The process's body: serve on `sockets` until SIGTERM, or until a core goes away (exit 3). Each served
    model has its core (`addresses`, in `config.served_models()` order, described by the `EngineInfo` list the
    launcher sends on `ready` once the models are loaded); this process holds a client of each."""
    from wde.core.client import CoreClient
    from wde.core.frontend import Frontend
    from wde.engine import resolve
    from wde.server.app import create_app
    from wde.server.processes import quieter
    from wde.server.startup import LISTEN_BACKLOG, log_to_stderr
    from wde.server.timeouts import http_protocol

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    told: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _: told.append(signum))  # told to stop before serving
    log_to_stderr(config.log_level)
    rid = routing_id(index, generation)
    resolved = [resolve(**config.engine_args(i)) for i in range(len(addresses))]
    infos = _described(ready, told)
    clients = []
    for (workflow, source), info, address in zip(resolved, infos, addresses):
        clients.append(CoreClient(Frontend(workflow, source, info), address, config.max_concurrent_requests,
                                  tag=f"{rid.decode()}.", routing_id=rid))
    app = create_app(clients, config)
    protocol = counting(http_protocol(config, app.state.service.metrics), index)
    server = ReportingServer(uvicorn.Config(app, log_level=quieter(config.log_level, "warning"),
                                            access_log=config.access_log, http=protocol, backlog=LISTEN_BACKLOG),
                             ready)
    for client in clients:
        client.on_fatal = lambda error: setattr(server, "should_exit", True)
    # uvicorn re-raises a caught SIGTERM after its graceful shutdown into the handler in place before it ran;
    # this one makes that a clean exit, and stops the server if the signal comes before uvicorn's handler is in.
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    if told:
        raise SystemExit(0)
    with frozen_heap():
        server.run(sockets=sockets)
    raise SystemExit(EXIT_GAVE_UP if any(client.error is not None for client in clients) else 0)


def _described(ready: Connection, told: list[int]) -> list[EngineInfo]:
    """The cores' descriptions, once the launcher sends them (their models are loaded); exits 0 when told to stop
    first, or when the launcher is gone."""
    while not ready.poll(0.1):
        if told:
            raise SystemExit(0)
    try:
        return ready.recv()
    except EOFError:
        raise SystemExit(0) from None


def counting(protocol: type[asyncio.Protocol], index: int) -> type[asyncio.Protocol]:
    """`protocol`, counting each connection it is made for in `wde_api_server_connections_total`."""
    from prometheus_client import Counter

    accepted = Counter("wde_api_server_connections", "connections accepted, by API server", ["api_server"],
                       registry=None).labels(str(index))

    class Counted(protocol):  # type: ignore[valid-type, misc]
        def connection_made(self, transport: Any) -> None:
            accepted.inc()
            super().connection_made(transport)

    return Counted


class ReportingServer(uvicorn.Server):
    """uvicorn's server, telling the launcher (`ready`) once it started: its app's start-up ran and its sockets
    listen."""

    def __init__(self, config: Any, ready: Connection | None) -> None:
        super().__init__(config)
        self._ready = ready

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self._ready is not None:
            self._ready.send("serving")
            self._ready.close()
            self._ready = None
