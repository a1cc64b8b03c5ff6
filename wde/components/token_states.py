"""The `sentence_tokens` pooler: the `sentence` pooler's embedding, plus every token's final hidden state for
the requests that ask for it (`PoolingParams.outputs` containing "token_embeddings"; TEI's /embed_all).

Serve an embedder with it by swapping the pooler's name (its params carry over):
`wde serve --model M --set pooler.name=sentence_tokens`. Batches in which nobody asks for token states cost
nothing extra; a request that did not ask gets an empty [0, hidden] `token_embeddings`.
"""

from __future__ import annotations

import torch

from wde.components.base import BuildContext
from wde.components.model_input_builder import ModelInput
from wde.components.models.fused import l2_normalize
from wde.components.params import SentencePoolerParams
from wde.components.pooler import Pooled, SentencePooler, segment_ids

TOKENS = "token_embeddings"


class SentenceTokensPooler(SentencePooler):
    """Like `sentence`; token states are raw (unnormalized) unless the request sets `normalize=True`."""

    name = "sentence_tokens"
    Params = SentencePoolerParams

    def __init__(self, params: SentencePoolerParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        if self.mode != "all":
            self.outputs = ("dense", TOKENS)

    def forward(self, hidden: torch.Tensor, batch: ModelInput) -> Pooled:
        pooled = super().forward(hidden, batch)
        if self.mode == "all":
            return pooled
        wanted = [p.outputs is not None and TOKENS in p.outputs for p in batch.pooling_params]
        if any(wanted):
            pooled.ragged[TOKENS] = self._token_states(hidden, batch, wanted)
        return pooled

    @staticmethod
    def _token_states(hidden: torch.Tensor, batch: ModelInput, wanted: list[bool]) -> tuple[torch.Tensor, list[int]]:
        """The tokens of the asking requests only; the others own an empty range."""
        lens = [n if w else 0 for n, w in zip(batch.seq_lens, wanted)]
        bounds = [0]
        for n in lens:
            bounds.append(bounds[-1] + n)
        seg = segment_ids(batch)
        keep = torch.tensor(wanted, device=hidden.device)[seg]
        x = hidden[keep].float() if not all(wanted) else hidden.float()
        norms = [p.normalize is True for p, w in zip(batch.pooling_params, wanted) if w]
        if any(norms):
            per_token = torch.tensor(norms, device=x.device).repeat_interleave(
                torch.tensor([n for n in lens if n], device=x.device))[:, None]
            x = torch.where(per_token, l2_normalize(x), x)
        return x, bounds
