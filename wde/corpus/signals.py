"""SIGINT and SIGTERM during `wde embed`: stop at once, keep every finished shard, say how far the run got.

`SignalGuard` (entered by the CLI) turns either signal into `Interrupted`, raised in the main thread. The shard in
flight is **dropped**, not finished (a shard can take minutes; a supervisor's grace period is often 30 s): its
rows are embedded again by `--resume`. Writing and recording a finished shard is a `deferred()` section, so a
signal that arrives meanwhile waits for the shard to be whole on disk and in the journal before it is raised.
The data-parallel parent runs `polled()`: its loop calls `check()` between messages instead of being interrupted
inside a queue read. `Interrupted.exit_code` is 128 + the signal number: 130 for SIGINT, 143 for SIGTERM.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived. A BaseException (like KeyboardInterrupt), so no `except Exception` of the engine
    mistakes it for a failed batch and carries on."""

    def __init__(self, signum: int, message: str | None = None) -> None:
        super().__init__(message or f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class SignalGuard:
    """While entered (in the main thread), SIGINT and SIGTERM raise `Interrupted`; the old handlers come back on
    exit. Only the first signal raises: later ones, while the run cleans up, are noted and ignored."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._raised = False
        self._hold = 0  # > 0 inside deferred() / polled(): note the signal, raise it later
        self._old: dict[int, Any] = {}
        self._previous: SignalGuard | None = None

    def __enter__(self) -> "SignalGuard":
        global _ACTIVE
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        self._previous, _ACTIVE = _ACTIVE, self
        return self

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        _ACTIVE = self._previous
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
        if not self._hold:
            self.check()

    def check(self) -> None:
        """Raise `Interrupted` if a signal arrived and none was raised yet."""
        if self.received is not None and not self._raised:
            self._raised = True
            raise Interrupted(self.received)


_ACTIVE: SignalGuard | None = None


@contextmanager
def _held() -> Iterator[SignalGuard | None]:
    """The active guard (None without one) holding signals back while the block runs."""
    guard = _ACTIVE
    if guard is None:
        yield None
        return
    guard._hold += 1
    try:
        yield guard
    finally:
        guard._hold -= 1


@contextmanager
def deferred(raise_after: bool = True) -> Iterator[None]:
    """A section a signal must not cut (a shard's rename and journal line): the signal is raised when it ends
    (or, with `raise_after=False`, only noted: the run is complete and exits normally). A no-op without a guard."""
    with _held() as guard:
        yield
    if guard is None:
        return
    if not raise_after:
        guard._raised = True
    elif not guard._hold:
        guard.check()


@contextmanager
def polled() -> Iterator[None]:
    """Signals are only noted; the caller's loop calls `check()` often (a loop waiting on queues with a timeout)."""
    with _held():
        yield


def check() -> None:
    if _ACTIVE is not None:
        _ACTIVE.check()
