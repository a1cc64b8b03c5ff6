"""The `mean_max` pooler: [mean of token states ; max of token states], optionally L2-normalized.

Concatenating mean and max pooling keeps both the average meaning of a text and its strongest features;
the vector is twice the model's hidden size.
"""

from __future__ import annotations

import torch

from wde.api import BuildContext, ModelInput, Pooled, Pooler, finish_embeddings, pool
from wde_plugin_example.params import MeanMaxParams


class MeanMaxPooler(Pooler):
    """Pools packed hidden states per sequence with `pool()` from the core, so packing stays the core's job."""

    name = "mean_max"
    Params = MeanMaxParams
    outputs = ("dense",)

    def __init__(self, params: MeanMaxParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self.dense_size = 2 * ctx.model.hidden_size

    def forward(self, hidden: torch.Tensor, batch: ModelInput) -> Pooled:
        mean = pool(hidden, batch, "mean").float()
        top = pool(hidden, batch, "max").float() * self.params.max_weight
        dense = finish_embeddings(torch.cat([mean, top], dim=-1), batch, self.params.normalize)
        return Pooled(rows={"dense": dense})
