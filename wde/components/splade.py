"""SPLADE sparse embeddings: a masked-LM's vocabulary logits pooled into one `{token_id: weight}` per input.

sentence-transformers' SpladePooling, per input: `weight[v] = pool over tokens t of log(1 + relu(logit[t, v]))`
(`activation_function: log1p_relu` takes one more `log1p`), pooled with `max` (SPLADE v2 and later) or `sum`,
over every token of the input, [CLS] and [SEP] included; `max_active_dims` then keeps the largest weights. WDE
computes it on the device in the model's pass, a chunk of tokens at a time (never a whole batch's
[tokens, vocabulary] logits); since log1p∘relu never decreases, max pooling takes the max of the raw logits and
transforms only the [inputs, vocabulary] result. Only the non-zero weights leave the device.
"""

from __future__ import annotations

import torch

from wde.components.base import BuildContext
from wde.components.kinds import Pooler
from wde.components.model_input_builder import ModelInput
from wde.components.output_processor import EmbeddingOutputProcessor
from wde.components.params import SparseOutputParams, SpladePoolerParams  # torch-free, for validation
from wde.components.pooler import Pooled, segment_ids
from wde.components.scheduler import SchedulerOutput
from wde.components.sparse_encoder import SpladeConfig, read_splade_config
from wde.errors import ModelLoadError
from wde.request import RequestOutput

SPARSE = "sparse"
SPARSE_IDS = "sparse_ids"
"""The token ids of the `sparse` weights, a ragged output beside them; the output processor joins the two."""
CHUNK_LOGITS = 1 << 24
"""Logits computed at once: tokens per chunk = this // vocabulary (64 MiB of float32 at a time)."""


class SpladePooler(Pooler):
    """SPLADE pooling of a masked-LM model's logits (the model must have `mlm_logits`, e.g. `bert_mlm`): output
    'sparse', the non-zero weights of each input with their token ids."""

    kind = "pooler"
    name = "splade"
    Params = SpladePoolerParams
    outputs = (SPARSE,)

    def __init__(self, params: SpladePoolerParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        model = ctx.model
        if not model.has_mlm_head:
            raise ModelLoadError(f"pooler 'splade' pools masked-LM vocabulary logits, and model"
                                 f" {model.name!r} has no MLM head (mlm_logits); use"
                                 " model: {name: bert_mlm}")
        self.model = model
        folder = read_splade_config(ctx.source) or SpladeConfig()
        self.vocab_size = int(model.mlm_vocab_size)
        if folder.embedding_dimension is not None and folder.embedding_dimension != self.vocab_size:
            raise ModelLoadError(f"{ctx.source.path}: SpladePooling says embedding_dimension"
                                 f" {folder.embedding_dimension} but the MLM head has {self.vocab_size} outputs")
        self.pooling_strategy = (folder.pooling_strategy if params.pooling_strategy == "auto"
                                 else params.pooling_strategy)
        self.activation_function = (folder.activation_function if params.activation_function == "auto"
                                    else params.activation_function)
        self.max_active_dims: int | None = params.max_active_dims or folder.max_active_dims
        self.mode = f"splade_{self.pooling_strategy}"
        """What the server reports as the pooling."""
        self.chunk = max(1, CHUNK_LOGITS // self.vocab_size)

    def _activate(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.log1p(torch.relu(x))
        return torch.log1p(x) if self.activation_function == "log1p_relu" else x

    def weights(self, hidden: torch.Tensor, batch: ModelInput) -> torch.Tensor:
        """[num_seqs, vocab] float32 SPLADE weights of every input (dense; zeros where inactive)."""
        seg = segment_ids(batch)
        use_max = self.pooling_strategy == "max"
        fill = float("-inf") if use_max else 0.0
        out = torch.full((batch.num_seqs, self.vocab_size), fill, dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], self.chunk):
            logits = self.model.mlm_logits(hidden[start:start + self.chunk]).float()
            rows = seg[start:start + self.chunk]
            if use_max:
                out.scatter_reduce_(0, rows[:, None].expand_as(logits), logits, "amax")
            else:
                out.index_add_(0, rows, self._activate(logits))
        if use_max:
            out = self._activate(out)
        if self.max_active_dims is not None and self.max_active_dims < self.vocab_size:
            top = torch.topk(out, self.max_active_dims, dim=1)
            out = torch.zeros_like(out).scatter_(1, top.indices, top.values)
        return out

    def forward(self, hidden: torch.Tensor, batch: ModelInput) -> Pooled:
        w = self.weights(hidden, batch)
        rows, ids = w.nonzero(as_tuple=True)  # row-major: each input's ids ascending
        counts = torch.bincount(rows, minlength=batch.num_seqs).tolist()
        bounds = [0]
        for n in counts:
            bounds.append(bounds[-1] + n)
        return Pooled(ragged={SPARSE: (w[rows, ids], bounds), SPARSE_IDS: (ids, bounds)})


class SparseOutputProcessor(EmbeddingOutputProcessor):
    """The `splade` pooler's weights as one `{token_id: weight}` dict per input (ids ascending), or keyed by token
    text with `sparse_keys: tokens`."""

    name = "sparse"
    Params = SparseOutputParams

    def __init__(self, params: SparseOutputParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self._tokenizer = ctx.tokenizer

    def process(self, batch: SchedulerOutput, pooled: Pooled, inference_time: float) -> list[RequestOutput]:
        outs = super().process(batch, pooled, inference_time)
        for out in outs:
            ids = out.outputs.pop(SPARSE_IDS, None)
            if ids is None or SPARSE not in out.outputs:
                continue
            weights = dict(zip(ids.tolist(), out.outputs[SPARSE].tolist()))
            if self.params.sparse_keys == "tokens":
                weights = dict(zip(self._tokenizer.convert_ids_to_tokens(list(weights)), weights.values()))
            out.outputs[SPARSE] = weights
        return outs
