"""bge-m3 (BAAI): one XLM-R pass, three heads — dense (CLS), sparse (lexical weights), ColBERT vectors.

Each request names the heads it wants in `PoolingParams.outputs` (default: dense only); a head that no
request of the batch asked for is not run. The math follows FlagEmbedding's BGEM3FlagModel:
dense = normalize(h[CLS]); sparse = relu(sparse_linear(h)) per token, special tokens dropped, max weight
per token id; colbert = normalize(colbert_linear(h[1:])) (every token after CLS, the final </s> included).
"""

from __future__ import annotations


import numpy as np
import torch
from torch import nn

from wde.components.base import BuildContext
from wde.components.kinds import Pooler
from wde.components.model_input_builder import ModelInput
from wde.components.models.fused import l2_normalize
from wde.components.output_processor import EmbeddingOutputProcessor
from wde.components.params import BGEM3OutputParams, BGEM3PoolerParams  # torch-free, for validation
from wde.components.pooler import Pooled, finish_embeddings, pool, segment_ids
from wde.components.scheduler import SchedulerOutput
from wde.errors import ModelLoadError
from wde.request import PoolingParams, RequestOutput

M3_OUTPUTS: tuple[str, ...] = ("dense", "sparse", "colbert")
SPARSE_DROPPED_ROLES = ("cls_token", "eos_token", "pad_token", "unk_token")
"""Tokens FlagEmbedding leaves out of the lexical weights."""


def requested(params: PoolingParams) -> tuple[str, ...]:
    return params.outputs if params.outputs is not None else ("dense",)


def _load_linear(ctx: BuildContext, filename: str, device: torch.device, dtype: torch.dtype) -> nn.Linear:
    """A head bge-m3 ships as a bare `nn.Linear` state dict beside the weights."""
    state = ctx.source.load_extra(filename)
    if state is None:
        raise ModelLoadError(f"{ctx.source.path} has no {filename}, which the bge_m3 pooler needs")
    weight = state.get("weight")
    if weight is None or weight.dim() != 2 or set(state) - {"weight", "bias"}:
        raise ModelLoadError(f"{filename} must hold an nn.Linear state dict (weight, bias); it has {sorted(state)}")
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in state)
    linear.load_state_dict(state)
    return linear.to(device=device, dtype=dtype).eval()


class BGEM3Pooler(Pooler):
    """Dense, sparse and ColBERT outputs of bge-m3; computes only the heads the batch's requests ask for."""

    kind = "pooler"
    name = "bge_m3"
    Params = BGEM3PoolerParams
    outputs = M3_OUTPUTS

    def __init__(self, params: BGEM3PoolerParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        device, dtype = ctx.model.device, ctx.model.dtype
        self.dense_size = ctx.model.hidden_size
        self.sparse_linear = _load_linear(ctx, params.sparse_file, device, dtype)
        self.colbert_linear = _load_linear(ctx, params.colbert_file, device, dtype)
        if self.sparse_linear.out_features != 1:
            raise ModelLoadError(f"{params.sparse_file} must map hidden states to 1 weight,"
                                 f" not {self.sparse_linear.out_features}")

    def forward(self, hidden: torch.Tensor, batch: ModelInput) -> Pooled:
        wanted = set().union(*(requested(p) for p in batch.pooling_params))
        out = Pooled()
        if "dense" in wanted:
            out.rows["dense"] = finish_embeddings(pool(hidden, batch, "cls"), batch, self.params.normalize)
        if "sparse" in wanted:
            weights = torch.relu(self.sparse_linear(hidden)).squeeze(-1).float()
            out.ragged["sparse"] = (weights, batch.cu_seqlens.tolist())
        if "colbert" in wanted:
            out.ragged["colbert"] = self._colbert(hidden, batch)
        return out

    def _colbert(self, hidden: torch.Tensor, batch: ModelInput) -> tuple[torch.Tensor, list[int]]:
        after_cls = batch.positions != 0
        vecs = self.colbert_linear(hidden[after_cls]).float()
        norms = [self.params.normalize if p.normalize is None else p.normalize for p in batch.pooling_params]
        if all(norms):
            vecs = l2_normalize(vecs)
        elif any(norms):
            per_token = torch.tensor(norms, device=vecs.device)[segment_ids(batch)[after_cls]][:, None]
            vecs = torch.where(per_token, l2_normalize(vecs), vecs)
        bounds = [end - i for i, end in enumerate(batch.cu_seqlens.tolist())]
        return vecs, bounds


class BGEM3OutputProcessor(EmbeddingOutputProcessor):
    """Per request: only the outputs it asked for (the engine rejects unknown names at submission); sparse
    weights become a {token: weight} dict."""

    name = "bge_m3"
    Params = BGEM3OutputParams

    def __init__(self, params: BGEM3OutputParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self._tokenizer = ctx.tokenizer
        self._dropped = ctx.tokenizer.special_ids_for(SPARSE_DROPPED_ROLES)

    def process(self, batch: SchedulerOutput, pooled: Pooled, inference_time: float) -> list[RequestOutput]:
        outs = super().process(batch, pooled, inference_time)
        for s, out in zip(batch.scheduled, outs):
            out.outputs = {n: out.outputs[n] for n in requested(s.request.params)}
            if "sparse" in out.outputs:
                out.outputs["sparse"] = self._lexical_weights(out.outputs["sparse"], s.token_ids)
        return outs

    def _lexical_weights(self, weights: np.ndarray, token_ids: list[int]) -> dict[int | str, float]:
        best: dict[int, float] = {}
        for w, tid in zip(weights.tolist(), token_ids):
            if tid not in self._dropped and w > best.get(tid, 0.0):
                best[tid] = w
        if self.params.sparse_keys == "ids":
            return best  # type: ignore[return-value]
        return dict(zip(self._tokenizer.convert_ids_to_tokens(list(best)), best.values()))
