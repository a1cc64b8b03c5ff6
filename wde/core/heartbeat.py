"""The engine loop's heartbeat: when it last made progress, readable from other processes.

The loop (`AsyncEngine`'s thread, or the engine core's `run`) beats after every step and, while idle, at least
every second, so the age of the last beat stays near zero unless a step is running or the loop is stuck: a hung
step, a deadlock, a core frozen by SIGSTOP or swapped out. `/health` answers 503 once that age passes
`wde serve --stall-timeout`, and /metrics shows it (`wde_engine_seconds_since_step`).

Across processes the beat is 8 bytes in a file next to the core's socket (`heartbeat_path`), written by the core
through a shared memory map and read by every API server; the time is `time.monotonic()`, which on Linux (and
macOS, Windows) is one clock for all processes of the host, so the ages agree. A frozen core cannot write, which
is the point: its API servers see the beat grow old.
"""

from __future__ import annotations

import mmap
import os
import struct
import time

_VALUE = struct.Struct("<d")
IPC = "ipc://"


def heartbeat_path(address: str) -> str | None:
    """Where the core at `address` publishes its heartbeat: next to its ipc socket (None for other transports)."""
    return address[len(IPC):] + ".heartbeat" if address.startswith(IPC) else None


class Heartbeat:
    """The monotonic time of the last beat; `path` shares it with other processes (`writer`: this one beats)."""

    def __init__(self, path: str | None = None, *, writer: bool = True) -> None:
        self.path = path
        self.writer = writer
        self._last = time.monotonic()
        self._map: mmap.mmap | None = None
        if path is not None and writer:
            with open(path, "w+b") as f:
                f.write(_VALUE.pack(self._last))
                f.flush()
                self._map = mmap.mmap(f.fileno(), _VALUE.size)

    def beat(self) -> None:
        self._last = time.monotonic()
        if self._map is not None:
            _VALUE.pack_into(self._map, 0, self._last)

    @property
    def last(self) -> float | None:
        """The monotonic time of the last beat; None when a reader cannot see the writer's file (yet)."""
        if self.writer:
            return self._last
        if self._map is None and not self._open():
            return None
        assert self._map is not None
        first = _VALUE.unpack_from(self._map, 0)[0]
        for _ in range(3):  # a read racing a write could see half of it: take two reads that agree
            second = _VALUE.unpack_from(self._map, 0)[0]
            if second == first:
                break
            first = second
        return first

    def age(self) -> float:
        """Seconds since the last beat (0 when unknown)."""
        last = self.last
        return 0.0 if last is None else max(0.0, time.monotonic() - last)

    def _open(self) -> bool:
        assert self.path is not None
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return False
        try:
            if os.fstat(fd).st_size < _VALUE.size:
                return False
            self._map = mmap.mmap(fd, _VALUE.size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        return True

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
