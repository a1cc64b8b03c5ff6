"""A causal LM used as a reranker: the score is how much more likely the next token is "yes" than "no".

Qwen3-Reranker (and LLM rerankers like it) prompts the model to judge a (query, document) pair and reads the
LM head's logits for the two answer tokens at the last position: score = softmax([logit_no, logit_yes])[1],
which is sigmoid(logit_yes - logit_no). Only those two rows of the LM head are ever loaded or multiplied, never
the full vocabulary: [num_seqs, hidden] @ [hidden, 2].
"""

from __future__ import annotations

from typing import Iterator

import torch

from wde.components.base import BuildContext
from wde.components.kinds import Pooler
from wde.components.model_input_builder import ModelInput
from wde.components.params import YesNoScorerParams  # torch-free, so validating a workflow needs no torch
from wde.components.pooler import Pooled, pool
from wde.errors import ModelLoadError


class YesNoScorer(Pooler):
    """Pooler scoring each sequence by its last token's LM-head logits for the yes/no tokens (output 'score')."""

    kind = "pooler"
    name = "yes_no_score"
    Params = YesNoScorerParams
    outputs = ("score",)

    def __init__(self, params: YesNoScorerParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self.token_ids = (self._token_id(ctx, params.no_token, "no_token"),
                          self._token_id(ctx, params.yes_token, "yes_token"))
        """(no, yes) vocabulary ids: the order of the two logits, as in the reference's stack([no, yes])."""
        rows = self._lm_head_rows(ctx, list(self.token_ids))
        self.weight = rows.to(device=ctx.model.device, dtype=ctx.model.dtype)
        """[2, hidden]: the LM head's rows for no and yes."""

    @staticmethod
    def _token_id(ctx: BuildContext, token: str, param: str) -> int:
        """The id of `token` as one vocabulary entry; refuses a token the vocabulary lacks (it would be split)."""
        tid = ctx.tokenizer.hf_tokenizer.convert_tokens_to_ids(token)
        if not isinstance(tid, int) or ctx.tokenizer.convert_ids_to_tokens([tid]) != [token]:
            raise ModelLoadError(f"pooler.params.{param} {token!r} is not a single token of the tokenizer in"
                                 f" {ctx.source.path}; name a token of its vocabulary")
        return tid

    @staticmethod
    def _lm_head_rows(ctx: BuildContext, ids: list[int]) -> torch.Tensor:
        """Rows `ids` of the LM head (the input embeddings when the config ties them), reading only those rows
        from a safetensors checkpoint."""
        cfg = ctx.source.hf_config
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        names = ("model.embed_tokens.weight", "embed_tokens.weight") if tied else ("lm_head.weight",)
        for name, rows in _tensor_rows(ctx, names, ids):
            expected = (len(ids), int(cfg.hidden_size))
            if tuple(rows.shape) != expected:
                raise ModelLoadError(f"{name} in {ctx.source.path} gives rows of shape {tuple(rows.shape)},"
                                     f" expected {expected}")
            return rows
        what = "tied input embeddings" if tied else "LM head"
        raise ModelLoadError(f"the yes/no scorer needs the {what} ({' or '.join(names)}), which {ctx.source.path}"
                             " lacks; a Qwen3-Reranker checkpoint is a *ForCausalLM with its LM head")

    def forward(self, hidden: torch.Tensor, batch: ModelInput) -> Pooled:
        logits = (pool(hidden, batch, "last") @ self.weight.T).float()
        log_odds = logits[:, 1] - logits[:, 0]
        on = [self.params.activation if p.activation is None else p.activation for p in batch.pooling_params]
        if all(on):
            return Pooled(rows={"score": torch.softmax(logits, dim=-1)[:, 1]})
        if any(on):
            mask = torch.tensor(on, device=logits.device)
            return Pooled(rows={"score": torch.where(mask, torch.softmax(logits, dim=-1)[:, 1], log_odds)})
        return Pooled(rows={"score": log_odds})


def _tensor_rows(ctx: BuildContext, names: tuple[str, ...], ids: list[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor[ids]) for the first of `names` the checkpoint holds: sliced lazily from safetensors (the
    full vocabulary matrix is never read), else from the loaded state dict."""
    index = torch.tensor(ids)
    for f in ctx.source.weight_files():
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in names:
                    if name in sf.keys():
                        view = sf.get_slice(name)
                        yield name, torch.stack([view[i:i + 1][0] for i in ids])
                        return
    for name, tensor in ctx.source.iter_weights(lambda n: n in names):
        yield name, tensor.index_select(0, index)
        return
