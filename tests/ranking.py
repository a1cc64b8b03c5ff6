"""How far a result may move with its batch, and rankings compared without relying on the order of near-ties.

WDE promises that a text's result alone and inside any batch agree within BATCH_TOLERANCE (float32 on CPU, max abs
diff), not bit for bit (docs/architecture.md): the GEMM kernels block and vectorize by the batch's token count and
by the CPU's instruction set, so the last bits move with the batch and the host (AVX-512 and AVX2 differ). Two
scores closer than that may therefore come out in either order, and a test that compares a ranking with one computed
elsewhere (another engine, another batch, another library) must not care which.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence

BATCH_TOLERANCE = 1e-5
"""fp32: the max abs diff allowed between a result alone and the same input inside a batch
(tests/test_batch_invariance.py)."""


def assert_ranked(got: Sequence[tuple[Hashable, float]], reference: Mapping[Hashable, float] | Sequence[float], *,
                  tol: float = BATCH_TOLERANCE, top_n: int | None = None) -> None:
    """`got`: (key, score) pairs as a ranking answered them, best first; `reference`: each key's score computed
    elsewhere (a sequence is indexed by position). Checks that every key comes once (the best `top_n` when given),
    each score is within `tol` of its reference, the answer's own scores never rise, and no key is ranked above one
    whose reference score is higher by more than `tol`; keys whose scores are within `tol` of each other may come
    in either order."""
    ref = dict(reference) if isinstance(reference, Mapping) else dict(enumerate(reference))
    keys = [key for key, _ in got]
    count = len(ref) if top_n is None else min(top_n, len(ref))
    assert len(keys) == count and len(set(keys)) == count and set(keys) <= set(ref), (keys, count)
    for key, score in got:
        assert abs(score - ref[key]) <= tol, f"{key!r}: {score} against {ref[key]}"
    scores = [score for _, score in got]
    assert scores == sorted(scores, reverse=True), f"not best first: {scores}"
    order = keys + [key for key in ref if key not in keys]  # what was left out ranks below what was answered
    for rank, key in enumerate(keys):
        for below in order[rank + 1:]:
            assert ref[key] >= ref[below] - tol, f"{key!r} ({ref[key]}) ranked above {below!r} ({ref[below]})"
