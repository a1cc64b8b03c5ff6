"""Start-up of `wde serve`: the listening sockets, made before anything loads, the checks that run before it,
and the one line it logs when it starts: what it serves, how, and where, so an operator reading the log (or a
supervisor's journal) never has to guess which model, workflow or device a process is running.

Every start-up failure is a `StartupError` (or a `ModelLoadError`, `WorkflowError`...): one line naming the
cause, exit status 1, no traceback unless `--log-level debug`."""

from __future__ import annotations

import errno
import logging
import os
import socket
import tempfile
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from wde.engine_info import EngineInfo
    from wde.server.config import ServerConfig


def log_to_stderr(level: str = "info") -> None:
    """The server's own log lines (failed requests with their ids and tracebacks, restarts, hints) on stderr,
    timestamped, at `level` (`wde serve --log-level`); where logging is already set up (a library user's, a test
    runner's) it is left alone."""
    log = logging.getLogger("wde")
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(level.upper())


def address(host: str, port: int) -> str:
    """The URL clients use: `http://127.0.0.1:8000`, an IPv6 host in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def startup_line(config: ServerConfig, info: EngineInfo, model_names: tuple[str, ...], api_servers: int = 0,
                 others: Sequence[tuple[EngineInfo, tuple[str, ...]]] = ()) -> str:
    """`serving <model> (API names: ...) with workflow <w> on <device> (<dtype>) at http://host:port`, where TEI's
    gRPC API listens too (`--grpc-port`), and how many API-server processes front the engine core when it runs in
    its own process, then the memory allocator (`wde.allocator`: tcmalloc or the system's). `others`: the (info,
    names) of the second and further models of a server of several, each listed after the first (`, model <m> (API
    names: ...) with workflow ...`)."""
    from wde.allocator import in_use

    models = config.served_models()
    served = []
    for i, (each, names) in enumerate(((info, model_names), *others)):
        model = models[i].model if i < len(models) and models[i].model else names[0]
        served.append(f"model {model} (API names: {', '.join(names)}) with workflow {each.workflow} on"
                      f" {each.device} ({each.dtype})")
    grpc = "" if config.grpc_port is None else \
        f" and TEI's gRPC API at {address(config.host, config.grpc_port).removeprefix('http://')}"
    split = f" through {api_servers} API-server processes" if api_servers else ""
    return f"serving {', '.join(served)} at {address(config.host, config.port)}{grpc}{split}; allocator {in_use()}"


class StartupError(Exception):
    """Why `wde serve` cannot start, in one line naming the cause; the command prints it and exits 1 (the
    traceback only with `--log-level debug`)."""


LISTEN_BACKLOG = 2048


def listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address `host` resolves to, made before any model is loaded, so a port in use
    or a bad host fails at once (`StartupError`) with nothing loaded.

    Each socket is created with `IPPROTO_TCP` (as asyncio's own `create_server` does) and has `TCP_NODELAY` set:
    asyncio sets `TCP_NODELAY` on an accepted connection only when its listener says protocol TCP, and Linux
    hands the listener's `TCP_NODELAY` to every connection it accepts. Without it a response written in two
    pieces (uvicorn writes the head and the body separately) waits for the client's delayed ACK, ~40 ms, on every
    request after the first of a kept-alive connection (Nagle's algorithm). Connections made while the model
    loads wait in the kernel's backlog and are answered once the server is ready.
    """
    where = address(host, port).removeprefix("http://")
    if not 0 <= port <= 65535:
        raise StartupError(f"cannot listen on {where}: --port must be from 0 to 65535, got {port}")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP,
                                   flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        reason = e.strerror if isinstance(e, socket.gaierror) else str(e)
        raise StartupError(f"cannot listen on {where}: --host {host!r} is neither an address nor a name that"
                           f" resolves ({reason})") from None
    addresses = list(dict.fromkeys((family, sockaddr[:2]) for family, _, _, _, sockaddr in infos))
    sockets: list[socket.socket] = []
    try:
        for family, sockaddr in addresses:
            try:
                sockets.append(tcp_socket(family, sockaddr, v6only=len(addresses) > 1))
            except OSError as e:
                raise StartupError(_bind_error(host, where, e)) from None
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def tcp_socket(family: int, sockaddr: tuple, v6only: bool, reuseport: bool = False,
               listening: bool = True) -> socket.socket:
    """One inheritable TCP socket bound at `sockaddr` (and listening, unless told not to yet), closed again if
    any step fails: `listen`'s, and each API server's own in split mode (`reuseport`, wde/server/listeners.py)."""
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        if os.name == "posix":  # restart at once, with the old server's connections still in TIME_WAIT
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuseport:  # several listeners on one port, the kernel spreading connections over them
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6 and v6only:  # `::` and `0.0.0.0` side by side
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(sockaddr)
        if listening:
            sock.listen(LISTEN_BACKLOG)
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


def _bind_error(host: str, where: str, error: OSError) -> str:
    if error.errno == errno.EADDRINUSE:
        return (f"cannot listen on {where}: the port is already in use (another server, or a `wde serve` still"
                " running); choose another --port or stop that server")
    if error.errno == errno.EADDRNOTAVAIL:
        return (f"cannot listen on {where}: {host!r} is not an address of this machine (--host takes one of its"
                " addresses, 127.0.0.1 for this machine only, or 0.0.0.0 / :: for every interface)")
    if error.errno == errno.EACCES:
        return f"cannot listen on {where}: permission denied (ports below 1024 need privileges; choose another --port)"
    return f"cannot listen on {where}: {error.strerror or error}"


METRICS_DIR_VARIABLES = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")


def check_metrics_dir() -> None:
    """Refuse an unusable prometheus-client multiprocess directory before anything loads.

    When `PROMETHEUS_MULTIPROC_DIR` is set (as for gunicorn), prometheus-client writes every metric of the process
    to a file there, from the first metric on; a missing or read-only folder would fail at the first metric, after
    the model loaded, with a traceback. A server with `--api-servers` uses a folder of its own instead.
    """
    for name in METRICS_DIR_VARIABLES:
        folder = os.environ.get(name)
        if folder is None:
            continue
        fix = "create it (an empty folder the server may write) or unset the variable"
        if not folder:
            raise StartupError(f"{name} is set but empty: prometheus-client writes this server's metrics to that"
                               f" folder; {fix}")
        try:
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as e:
            raise StartupError(f"{name}={folder!r} is not a folder this server can write ({e.strerror or e}):"
                               f" prometheus-client writes this server's metrics there; {fix}") from None
