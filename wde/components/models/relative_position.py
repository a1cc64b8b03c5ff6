"""T5-style bucketed relative positions (T5, MPNet): the bucket of each key-minus-query distance.

A model with a relative position bias keeps a `[num_buckets, heads]` table; the bias of the query at position i
and the key at position j is the table's row for the bucket of `j - i`. Half of the buckets count distances to the
left, half to the right (bidirectional); the first half of each side is exact, the rest logarithmic up to
`max_distance`, beyond which every distance shares the last bucket. The arithmetic is transformers' own
(`T5Attention._relative_position_bucket`, `MPNetEncoder.relative_position_bucket`), float for float, so the
buckets are the same at every boundary.
"""

from __future__ import annotations

import math

import torch


def relative_position_bucket(relative_position: torch.Tensor, num_buckets: int, max_distance: int,
                             bidirectional: bool = True) -> torch.Tensor:
    """The bucket (long tensor, same shape) of each `key position - query position` in `relative_position`.

    Bidirectional: buckets `[0, num_buckets // 2)` for keys at or left of the query, the upper half for keys to its
    right. Unidirectional (a decoder's view): only keys at or left of the query are told apart; every key to the
    right falls in bucket 0.
    """
    buckets = torch.zeros_like(relative_position, dtype=torch.long)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).to(torch.long) * num_buckets
        distance = relative_position.abs()
    else:
        distance = -torch.clamp(relative_position, max=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # log(0) is -inf for distance 0, which is small: torch.where never picks its (meaningless) long value.
    if_large = max_exact + (torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
                            * (num_buckets - max_exact)).to(torch.long)
    if_large = torch.clamp(if_large, max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, if_large)


def relative_position_buckets(length: int, num_buckets: int, max_distance: int, device: torch.device | None = None,
                              bidirectional: bool = True) -> torch.Tensor:
    """`[length, length]` buckets of `key - query` for positions `0..length-1` (row: query, column: key).

    A sequence of n <= length tokens uses the top-left `n x n` corner, so one tensor built for a batch's longest
    sequence serves every sequence in it: look it up in the model's `[num_buckets, heads]` table and permute to
    `[heads, length, length]` for an attention bias (`check_bias`).
    """
    pos = torch.arange(length, dtype=torch.long, device=device)
    return relative_position_bucket(pos[None, :] - pos[:, None], num_buckets, max_distance, bidirectional)
