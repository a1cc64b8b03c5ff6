"""The three stages where Stanford ColBERT differs from a BERT embedder.

- `ColbertTokenizer`: the markers `[unused0]` (query) and `[unused1]` (document), which the input processor adds as
  prompts, become single tokens; a query (the request's option `task`, which `encode` is given) is cut to
  `query_length` tokens or padded to it with `[MASK]`, as ColBERT's QueryTokenizer pads (its `[SEP]` kept).
- `ColbertModel`: BERT plus the checkpoint's `linear` projection; a query's `[MASK]` tokens are masked as keys
  (`ModelInput.key_mask`), as ColBERT's attention mask leaves them out (`attend_to_mask_tokens: false`).
- `ColbertPooler`: normalize(linear(hidden)) per token, output 'colbert'; a document's punctuation is not scored.
"""

from __future__ import annotations

import string
from dataclasses import replace

import torch
from torch import nn

from wde.api import (BertModel, BuildContext, HFTokenizer, ModelInput, ModelLoadError, Params, Pooled, Pooler,
                     check_key_mask, l2_normalize, segment_ids)
from wde_plugin_colbert.params import ColbertModelParams, ColbertTokenizerParams

TASK = {"task": ("document", "query")}


def is_query(batch: ModelInput) -> torch.Tensor:
    """Boolean [tokens]: the token belongs to a query."""
    queries = [p.option("task", "document") == "query" for p in batch.pooling_params]
    return torch.tensor(queries, device=batch.input_ids.device)[segment_ids(batch)]


class ColbertTokenizer(HFTokenizer):
    name = "colbert_tokenizer"
    Params = ColbertTokenizerParams

    def __init__(self, params: ColbertTokenizerParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        hf = self.hf_tokenizer  # the loaded tokenizer: copies for other threads are made from it later
        hf.add_special_tokens({"additional_special_tokens": ["[unused0]", "[unused1]"]})
        self.query_id, self.mask_id = hf.convert_tokens_to_ids("[unused0]"), hf.mask_token_id
        if self.query_id == hf.unk_token_id or self.mask_id is None:
            raise ModelLoadError(f"{ctx.source.path}: the vocabulary lacks [unused0] or [MASK], which ColBERT needs")

    def request_options(self) -> dict[str, tuple[str, ...]]:
        return TASK

    def encode(self, prompts, max_length=None, direction="right", options=None):  # noqa: ANN001, ANN201
        out, n = [], self.params.query_length
        for (ids, types), opts in zip(super().encode(prompts, max_length, direction, options),
                                      options or [None] * len(prompts)):
            if (opts or {}).get("task") == "query":
                ids = ids[:n - 1] + ids[-1:] if len(ids) > n else ids + [self.mask_id] * (n - len(ids))
                types = None if types is None else [0] * len(ids)
            out.append((ids, types))
        return out


class ColbertModel(BertModel):
    name = "colbert_bert"
    Params = ColbertModelParams

    def __init__(self, params: ColbertModelParams, ctx: BuildContext) -> None:
        if not getattr(ctx.attention, "supports_key_mask", False):
            raise ModelLoadError(f"attention {ctx.attention.name!r} cannot mask keys, which ColBERT queries need")
        self.dim, self.mask_id = params.dim, ctx.tokenizer.mask_id  # read by build(), which super().__init__ runs
        super().__init__(params, ctx)

    def build(self, cfg: object) -> None:
        super().build(cfg)
        self.linear = nn.Linear(cfg.hidden_size, self.dim, bias=False)  # HF_ColBERT's `linear.weight`

    def request_options(self) -> dict[str, tuple[str, ...]]:
        return TASK

    def forward(self, batch: ModelInput) -> torch.Tensor:
        masked = is_query(batch) & (batch.input_ids == self.mask_id)
        if masked.any():
            keys = ~masked if batch.key_mask is None else batch.key_mask & ~masked
            check_key_mask(keys, batch.input_ids.shape[0])
            batch = replace(batch, key_mask=keys)
        return super().forward(batch)


class ColbertPooler(Pooler):
    name = "colbert_linear"
    outputs = ("colbert",)
    similarity_fn_name = "maxsim"

    def __init__(self, params: Params, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self.linear = ctx.model.linear
        hf = ctx.tokenizer.hf_tokenizer
        punctuation = [hf.encode(c, add_special_tokens=False)[0] for c in string.punctuation]  # as ColBERT's skiplist
        self.skiplist = torch.tensor(punctuation, device=ctx.model.device)

    def request_options(self) -> dict[str, tuple[str, ...]]:
        return TASK

    def forward(self, hidden: torch.Tensor, batch: ModelInput) -> Pooled:
        keep = is_query(batch) | ~torch.isin(batch.input_ids, self.skiplist)
        x = self.linear(hidden[keep]).float()
        norms = [p.normalize is not False for p in batch.pooling_params]
        counts = torch.bincount(segment_ids(batch)[keep], minlength=len(norms))  # scored tokens per sequence
        x = torch.where(torch.tensor(norms, device=x.device).repeat_interleave(counts)[:, None], l2_normalize(x), x)
        return Pooled(ragged={"colbert": (x, [0, *torch.cumsum(counts, 0).tolist()])})
