"""The `wde embed` progress bar: rows with ETA, plus tokens/s, on stderr."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable


class Progress:
    """A tqdm bar over input rows whose postfix is the token rate; a no-op when disabled."""

    def __init__(self, enabled: bool) -> None:
        self.tokens = 0
        self._t0: float | None = None
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm

            cols, rows = _shape()
            self._bar = tqdm(total=None, unit="row", unit_scale=True, desc="wde embed", file=sys.stderr,
                             ncols=cols, nrows=rows, smoothing=0.1)

    def count_in_background(self, count: Callable[[], int]) -> None:
        """Fill in the total (for the ETA) from `count()` on a thread, so a huge input starts embedding at once."""
        if self._bar is None:
            return

        def run() -> None:
            try:
                total = count()
            except Exception:  # noqa: BLE001 - a bar without a total is still a bar; the reader reports real errors
                return
            if self._bar is not None:
                self._bar.total = total
                self._bar.refresh()

        threading.Thread(target=run, name="wde-embed-count", daemon=True).start()

    def skipped(self, rows: int) -> None:
        """Rows whose shard an earlier run finished (resume)."""
        if self._bar is not None:
            self._bar.update(rows)

    def start(self) -> None:
        """The engine is built: the token rate counts from here, not from model loading."""
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def batch(self, rows: int, tokens: int) -> None:
        self.tokens += tokens
        if self._bar is None:
            return
        self.start()
        elapsed = time.perf_counter() - self._t0  # type: ignore[operator]
        if elapsed > 0:
            self._bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tok/s", refresh=False)
        self._bar.update(rows)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _shape() -> tuple[int, int]:
    """The terminal's size; a pty that reports 0 x 0 (script, some CI runners) would hide the bar, so it gets
    $COLUMNS (or 100) x 24."""
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
        cols, rows = size.columns, size.lines
    except (OSError, ValueError, AttributeError):
        cols, rows = 0, 0
    return cols or int(os.environ.get("COLUMNS") or 100), rows or 24
