"""Token pooling: a late-interaction model's document vectors merged into fewer, as sentence-transformers'
`HierarchicalTokenPooling` merges them (a folder's last module, read by `multi_vector_config.TokenPooling`).

For each pooled sequence, its first `num_protected_tokens` vectors are kept as they are and the others are clustered
by Ward linkage on their cosine distance (`1 - a.b`, clamped to [0, 2]) into at most `count // pool_factor` clusters
(at least one; scipy's `linkage` and `fcluster(criterion="maxclust")`, as the reference runs them without
fastcluster), each cluster replaced by the mean of its vectors, clusters in the order of their labels. The linkage
is scipy's, once per pooled sequence on the CPU; the distances are one batched product over the pooled sequences
(zero-padded), the means one scatter of every token of the batch into its output row, on the device.
"""

from __future__ import annotations

import numpy as np
import torch

from wde.components.multi_vector_config import TokenPooling

DISTANCE_BUDGET = 1 << 24
"""The most float32 elements of padded distance matrices computed at once (64 MiB)."""


def pool_tokens(x: torch.Tensor, counts: torch.Tensor, pooled: list[bool],
                pooling: TokenPooling) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's vectors after pooling, and each sequence's new count.

    :param x: [tokens, dim] every sequence's vectors, one sequence after another.
    :param counts: [sequences] how many vectors each sequence has (on x's device).
    :param pooled: per sequence, whether its task is pooled (the others pass through unchanged).
    :param pooling: the folder's settings.
    """
    n = len(pooled)
    if pooling.pool_factor <= 1 or not any(pooled) or x.shape[0] == 0:
        return x, counts
    sizes = counts.tolist()
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    # each token's row within its sequence's output: its own position unless it joins a cluster
    rows = np.arange(x.shape[0], dtype=np.int64) - np.repeat(starts, sizes)
    out_counts = list(sizes)
    keep = pooling.num_protected_tokens
    clustered = [i for i in range(n) if pooled[i] and _clusters(sizes[i] - keep, pooling) < sizes[i] - keep]
    for chunk in _chunks(clustered, [sizes[i] - keep for i in clustered]):
        widths = [sizes[i] - keep for i in chunk]
        for i, distance in zip(chunk, _distances(x, [starts[i] + keep for i in chunk], widths)):
            labels = _labels(distance, _clusters(sizes[i] - keep, pooling))
            rows[starts[i] + keep:starts[i] + sizes[i]] = keep + labels
            out_counts[i] = keep + int(labels.max()) + 1
    out_starts = np.concatenate([[0], np.cumsum(out_counts)[:-1]]).astype(np.int64)
    target = torch.from_numpy(rows + np.repeat(out_starts, sizes)).to(x.device)
    total = int(sum(out_counts))
    sums = x.new_zeros(total, x.shape[1]).index_add_(0, target, x)
    members = torch.zeros(total, dtype=x.dtype, device=x.device).index_add_(0, target, torch.ones_like(x[:, 0]))
    return sums / members[:, None], torch.tensor(out_counts, device=counts.device, dtype=counts.dtype)


def _clusters(count: int, pooling: TokenPooling) -> int:
    """How many clusters `count` vectors are merged into (the reference's `max(int(count // pool_factor), 1)`)."""
    return max(int(count // pooling.pool_factor), 1)


def _chunks(ids: list[int], widths: list[int]) -> list[list[int]]:
    """`ids` in runs whose padded distance matrices (run length x widest^2 floats) stay within DISTANCE_BUDGET
    elements (a longer sequence alone in its run)."""
    budget = DISTANCE_BUDGET
    runs: list[list[int]] = []
    widest = 0
    for i, width in zip(ids, widths):
        if runs and (len(runs[-1]) + 1) * max(widest, width) ** 2 <= budget:
            runs[-1].append(i)
            widest = max(widest, width)
        else:
            runs.append([i])
            widest = width
    return runs


def _distances(x: torch.Tensor, starts: list[int], widths: list[int]) -> list[np.ndarray]:
    """Each run `x[start:start + width]`'s cosine distances `(1 - a.b)` clamped to [0, 2], float32 on the CPU, as the
    reference computes them; all in one batched product over the runs zero-padded to the widest."""
    rows = torch.from_numpy(np.concatenate([np.arange(s, s + w) for s, w in zip(starts, widths)])).to(x.device)
    vectors = x[rows].detach().float().cpu().split(widths)
    padded = torch.nn.utils.rnn.pad_sequence(list(vectors), batch_first=True)
    distance = (1 - torch.bmm(padded, padded.transpose(1, 2))).clamp_(0, 2).numpy()
    return [distance[j, :w, :w] for j, w in enumerate(widths)]


def _labels(distance: np.ndarray, clusters: int) -> np.ndarray:
    """Each vector's cluster from their distances, numbered 0.. in the order of fcluster's labels (dense: fcluster
    may give fewer clusters than asked on ties)."""
    from scipy.cluster.hierarchy import fcluster, linkage
    from scipy.spatial.distance import squareform

    tree = linkage(squareform(distance, checks=False), method="ward")
    labels = fcluster(tree, t=clusters, criterion="maxclust")
    return np.unique(labels, return_inverse=True)[1].astype(np.int64).reshape(-1)
