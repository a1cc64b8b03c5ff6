"""Generated text workloads shared by the benchmarks (deterministic for a seed)."""

from __future__ import annotations

import random

_WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact be have do say get make go know take see come think look "
    "want give use find tell ask seem feel try leave call good new first last long great little own other old "
    "right big high different small large next early young important few public bad same able to of in for on "
    "with at by from up about into over after the and a that it not he as you this but his they her she or an"
).split()


def sentences(n: int, mean_words: int = 30, seed: int = 0) -> list[str]:
    """`n` sentences with lengths spread around `mean_words` (uniform 0.25x..1.75x)."""
    rng = random.Random(seed)
    lo, hi = max(1, mean_words // 4), max(2, mean_words * 7 // 4)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "." for _ in range(n)]
