"""One token budget shared by the engines of one process (`wde serve` with several models).

Each engine's step takes its batch's tokens from the pool before the forward and gives them back when the forward
ends, so the forwards of all engines together never hold more tokens than the pool: the activations of several
models in one process are bounded as one model's are by its own budget. A batch larger than the pool takes the
whole pool (it waits for it to be free, never for itself). An engine that already has a forward in flight does not
wait: it tries, and on failure finishes what it has first (`Engine.step`); an engine with nothing in flight holds
nothing and waits, so no engine waits on another that waits on it. A waiter goes first: while one waits, tries
fail, so a large batch is not starved by small ones.
"""

from __future__ import annotations

import threading
from collections import Counter


class TokenPool:
    """`size` tokens shared by the forwards of several engines; `held` says how many each owner holds now."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a shared token pool needs at least 1 token, got {size}")
        self.size = size
        self._free = size
        self._waiting = 0
        self._held: Counter[str] = Counter()
        self._cond = threading.Condition()

    @property
    def in_use(self) -> int:
        return self.size - self._free

    def held(self, owner: str) -> int:
        """Tokens `owner`'s forwards hold now."""
        return self._held[owner]

    def take(self, owner: str, tokens: int, wait: bool) -> int | None:
        """Take `tokens` (at most the pool's size) for `owner`; returns how many were taken, to give back with
        `give`. With `wait`, blocks until they are free; without, returns None unless they are free now and nobody
        is waiting."""
        want = max(1, min(tokens, self.size))
        with self._cond:
            if not wait and (self._waiting or self._free < want):
                return None
            self._waiting += 1
            try:
                self._cond.wait_for(lambda: self._free >= want)
            finally:
                self._waiting -= 1
            self._free -= want
            self._held[owner] += want
            return want

    def give(self, owner: str, taken: int) -> None:
        """Give back what `take` returned for `owner`."""
        with self._cond:
            self._free += taken
            self._held[owner] -= taken
            self._cond.notify_all()
