"""The listening sockets of a split server (`wde serve --api-servers N`): one set per API server, on one port.

With one listening socket shared by N processes, the kernel wakes one of them for a burst of connections and that
process's accept loop (asyncio accepts up to 100 at a wakeup) takes them all: 64 connections opened at once (as a
client pool does) landed 64/0, 63/1, 61/3 and 57/7 on 2 processes; the issue saw all 33 on one API server in 3 of 4
runs. With `SO_REUSEPORT` each API server listens on a socket of its own on the same port and the kernel hashes each
new connection to one of them: 32/32, 36/28, 34/30, 33/31 in the same measurement. It also lets one API server die
alone: its sockets close with it (the connections waiting in its backlog are reset, never left hanging), new
connections go to the others, and the restarted one joins again.

`SplitListeners` checks the port as one process does (`startup.listen`: a port in use or a bad host fails at once,
nothing loaded), then holds it with a `SO_REUSEPORT` socket that is bound but never listens (such a socket takes no
connections) while the API servers come and go. `first(n)` makes each API server's listening sockets before the
model loads (a connection made while it loads waits in a backlog, as in one process); `replacement()` makes a
restarted API server's sockets bound but not listening: asyncio listens on them when that server is ready, so
until then new connections go to the live ones.

Where `SO_REUSEPORT` does not spread connections (only Linux hashes them over listeners; macOS and the BSDs accept
the option but give connections to one socket) or cannot be set, every API server shares one set of sockets, as
before, and the launcher keeps them for restarts (a warning says so).
"""

from __future__ import annotations

import logging
import socket
import sys

from wde.server.startup import StartupError, listen, tcp_socket

log = logging.getLogger("wde.server")


class SplitListeners:
    def __init__(self, host: str, port: int) -> None:
        probe = listen(host, port)  # the one-process checks and messages; closed at once (nothing accepted yet)
        self.addresses = [(s.family, s.getsockname()) for s in probe]
        self.port: int = self.addresses[0][1][1]
        self._v6only = len(self.addresses) > 1  # `::` and `0.0.0.0` side by side, as `listen` does
        self._reserved: list[socket.socket] = []
        self.shared: list[socket.socket] | None = None
        """Set when `SO_REUSEPORT` is not usable here: the sockets every API server shares."""
        why = _no_reuseport()
        if why is None:
            for s in probe:
                s.close()
            try:
                self._reserved = self._bind(listening=False)
                self._bind(listening=False, check=True)  # a second socket on the port: the option works here
            except OSError as e:
                self.close()
                why = f"SO_REUSEPORT did not let two sockets share port {self.port} ({e.strerror or e})"
                probe = listen(host, self.port)
        if why is not None:
            log.warning("%s: the API servers share one listening socket, and connections may not spread evenly"
                        " over them", why)
            self.shared = probe

    @property
    def reuseport(self) -> bool:
        return self.shared is None

    def first(self, n: int) -> list[list[socket.socket]]:
        """The listening sockets of each of the first `n` API servers, made before the model loads."""
        return [self.shared] * n if self.shared is not None else [self._made(listening=True) for _ in range(n)]

    def replacement(self) -> list[socket.socket]:
        """The sockets of an API server restarted after its predecessor died: bound, listening once it serves."""
        return self.shared if self.shared is not None else self._made(listening=False)

    def release(self, sockets: list[socket.socket]) -> None:
        """The launcher's copies of sockets handed to an API server process (which has its own), unless shared."""
        if sockets is not self.shared:
            for s in sockets:
                s.close()

    def close(self) -> None:
        for s in [*self._reserved, *(self.shared or [])]:
            s.close()
        self._reserved = []
        self.shared = None

    def _made(self, listening: bool) -> list[socket.socket]:
        try:
            return self._bind(listening)
        except OSError as e:
            raise StartupError(f"cannot listen on port {self.port} again ({e.strerror or e})") from None

    def _bind(self, listening: bool, check: bool = False) -> list[socket.socket]:
        sockets: list[socket.socket] = []
        try:
            for family, sockaddr in self.addresses:
                sockets.append(tcp_socket(family, sockaddr, self._v6only, reuseport=True, listening=listening))
        except BaseException:
            for s in sockets:
                s.close()
            raise
        if check:
            for s in sockets:
                s.close()
        return sockets


def _no_reuseport() -> str | None:
    """Why `SO_REUSEPORT` cannot spread connections on this system; None where it can (Linux)."""
    if not sys.platform.startswith("linux"):
        return f"SO_REUSEPORT does not spread connections over listeners on {sys.platform}"
    if not hasattr(socket, "SO_REUSEPORT"):
        return "this Python has no SO_REUSEPORT"
    return None
