"""How often a failed engine loop may be restarted before the server gives up (and exits for a supervisor)."""

from __future__ import annotations

import time
from collections import deque

EXIT_GAVE_UP = 3
"""The exit code of a server, or engine-core process, whose engine loop failed more often than its restart budget
allows (or whose core died): a supervisor restarts it."""


class EngineFailed(RuntimeError):
    """The engine loop gave up after repeated failures; `wde serve` exits `EXIT_GAVE_UP` so a supervisor restarts
    it."""


class RestartBudget:
    """At most `max_restarts` restarts within any `window_s` seconds."""

    def __init__(self, max_restarts: int = 5, window_s: float = 60.0) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.used = 0
        """Restarts granted so far."""
        self._times: deque[float] = deque()

    def spend(self) -> bool:
        """Record a failure now; True if the loop may restart, False once the budget is exhausted."""
        now = time.monotonic()
        self._times.append(now)
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) > self.max_restarts:
            return False
        self.used += 1
        return True

    @property
    def recent(self) -> int:
        """Failures within the current window."""
        return len(self._times)
