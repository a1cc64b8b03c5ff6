"""The split server's listening sockets (`wde.server.listeners`), without a server: one set per API server on one
port with `SO_REUSEPORT`, a replacement set that takes no connection until it listens, the port checked as one
process checks it (a second split server on the same port is refused, not let in), and the shared fallback."""

from __future__ import annotations

import logging
import socket
import sys

import pytest

from tests.test_server import free_port
from wde.server import listeners as listeners_module
from wde.server.listeners import SplitListeners
from wde.server.startup import StartupError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT spreads on Linux only")


def accepted(sock: socket.socket) -> int:
    """Connections waiting in `sock`'s backlog (accepted and closed here)."""
    sock.setblocking(False)
    n = 0
    while True:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return n
        conn.close()
        n += 1


def connect(port: int, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]


def test_each_api_server_gets_its_own_sockets_and_the_kernel_spreads_connections() -> None:
    held = SplitListeners("127.0.0.1", 0)
    try:
        assert held.reuseport and held.port != 0
        (a,), (b,) = held.first(2)
        assert a is not b and a.getsockname() == b.getsockname() == ("127.0.0.1", held.port)
        assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        clients = connect(held.port, 64)
        got = [accepted(a), accepted(b)]
        assert sum(got) == 64 and min(got) >= 14, got  # a hash per connection: below 14 of 64 is ~4e-6
        for c in clients:
            c.close()

        (c_sock,) = held.replacement()  # bound, not listening: it takes no connection yet
        clients = connect(held.port, 16)
        assert not c_sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        assert accepted(a) + accepted(b) == 16
        for s in (a, b):
            held.release([s])
        with pytest.raises(ConnectionRefusedError):  # no listener left: refused, not left waiting
            socket.create_connection(("127.0.0.1", held.port), timeout=10)
        c_sock.listen(16)  # as asyncio does once the restarted server is ready
        clients += connect(held.port, 4)
        assert accepted(c_sock) == 4
        for c in clients:
            c.close()
        c_sock.close()
    finally:
        held.close()


def test_the_port_is_checked_as_one_process_checks_it() -> None:
    held = SplitListeners("127.0.0.1", 0)
    try:
        (api,) = held.first(1)  # a running split server: its API server listens
        with pytest.raises(StartupError, match="already in use"):  # a second split server is refused, not let in
            SplitListeners("127.0.0.1", held.port)
        held.release(api)
    finally:
        held.close()
    port = free_port()
    with socket.socket() as plain:
        plain.bind(("127.0.0.1", port))
        plain.listen()
        with pytest.raises(StartupError, match="already in use"):
            SplitListeners("127.0.0.1", port)


def test_without_reuseport_the_api_servers_share_one_set(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(listeners_module, "_no_reuseport", lambda: "SO_REUSEPORT does not spread here")
    with caplog.at_level(logging.WARNING, logger="wde.server"):
        held = SplitListeners("127.0.0.1", 0)
    try:
        assert not held.reuseport and "share one listening socket" in caplog.text
        first = held.first(2)
        assert first[0] is first[1] is held.replacement()
        held.release(first[0])  # shared: the launcher keeps them for restarts
        clients = connect(held.port, 3)
        assert accepted(first[0][0]) == 3
        for c in clients:
            c.close()
    finally:
        held.close()
