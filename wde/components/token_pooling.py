"""Token pooling: a late-interaction model's document vectors merged into fewer, as sentence-transformers'
`HierarchicalTokenPooling` merges them (a folder's last module, read by `multi_vector_config.TokenPooling`).

For each pooled sequence, its first `num_protected_tokens` vectors are kept as they are and the others are clustered
by Ward linkage on their cosine distance (`1 - a.b`, clamped to [0, 2]) into at most `count // pool_factor` clusters
(at least one; scipy's `linkage` and `fcluster(criterion="maxclust")`, as the reference runs them without
fastcluster), each cluster replaced by the mean of its vectors, clusters in the order of their labels. The linkage
is scipy's, once per pooled sequence on the CPU; everything else is one pass over the whole batch (one scatter of
every token into its output row), on the device.
"""

from __future__ import annotations

import numpy as np
import torch

from wde.components.multi_vector_config import TokenPooling


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
    if clustered:
        picks = np.concatenate([np.arange(starts[i] + keep, starts[i] + sizes[i]) for i in clustered])
        vectors = x[torch.from_numpy(picks).to(x.device)].detach().float().cpu()
        offset = 0
        for i in clustered:
            width = sizes[i] - keep
            labels = _labels(vectors[offset:offset + width], _clusters(width, pooling))
            offset += width
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


def _labels(vectors: torch.Tensor, clusters: int) -> np.ndarray:
    """Each vector's cluster, numbered 0.. in the order of fcluster's labels (dense: fcluster may give fewer
    clusters than asked on ties)."""
    from scipy.cluster.hierarchy import fcluster, linkage
    from scipy.spatial.distance import squareform

    distance = (1 - torch.mm(vectors, vectors.t())).clamp_(0, 2).numpy()
    tree = linkage(squareform(distance, checks=False), method="ward")
    labels = fcluster(tree, t=clusters, criterion="maxclust")
    return np.unique(labels, return_inverse=True)[1].astype(np.int64).reshape(-1)
