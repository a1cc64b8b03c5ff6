"""Late interaction (ColBERT-style multi-vector models): sentence-transformers 6 `MultiVectorEncoder` folders (and
PyLate v3 and Stanford ColBERT folders, read as it reads them), one vector per scored token, with a query and a
document side picked per request by the option `task` (`document`, the default, or `query`), as `encode_document` /
`encode_query` do.

The `task` changes three stages, and each component that reads it declares it (`TASKS`):
- the input processor prepends the folder's `query` prompt to a query and its `document` prompt to a document,
  unless the request names its own;
- the request processor caps a query at `query_length` and a document at `document_length` (over it: refused
  unless the request truncates, as over the model's limit), and pads a query with the expansion token
  (`query_expansion`); without `attend`, its input builder masks those tokens as keys (`ModelInput.key_mask`);
- the pooler scores every token of a query (expansion tokens included) and drops a document's skiplist tokens
  (and keeps only `keep_only_token_ids` where set), as `MultiVectorMask` does, then runs the folder's per-token
  projection, Dense and Normalize modules, on the device, for the whole batch at once (output 'colbert', ragged),
  and merges the vectors of the tasks a `HierarchicalTokenPooling` pools (documents by default;
  wde/components/token_pooling.py).

The folder is read and checked by wde/components/multi_vector_config.py. `maxsim` scores a query against documents.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Literal, Sequence

import torch

from wde.components.base import BuildContext
from wde.components.kinds import Pooler
from wde.components.input_processor import InputName, TextInputParams, TextInputProcessor
from wde.components.model_input_builder import ModelInput, PackedInputBuilder
from wde.components.models.fused import l2_normalize
from wde.components.multi_vector_config import (TASKS, Projection, is_multi_vector_folder, read_multi_vector_config,
                                               register_prefix_tokens)
from wde.components.params import MultiVectorPoolerParams
from wde.components.pooler import Pooled, segment_ids
from wde.components.request_processor import LazyTokenizeParams, LazyTokenizeRequestProcessor
from wde.components.scheduler import SchedulerOutput
from wde.components.st_modules import StModule, after_pooling
from wde.components.token_pooling import pool_tokens
from wde.errors import ModelLoadError, RequestError
from wde.request import PoolingParams, Prompt, Request, SchedulableRequest, TokensPrompt

log = logging.getLogger(__name__)

OUTPUT = "colbert"
"""The output name: one vector per scored token, as bge-m3's ColBERT head gives."""


def task_of(params: PoolingParams) -> str:
    """The request's task: 'document' (the default) or 'query'."""
    return params.option("task", TASKS[0])


class MultiVectorInput(TextInputProcessor):
    """`text_input` whose default prompt follows the request's `task`, as `encode_query` / `encode_document` pick
    theirs; a request's `prompt` or `prompt_name` wins. `dimensions` is refused: the token vectors have no
    truncation to a prefix of their features."""

    name = "multi_vector_input"
    Params = TextInputParams

    def __init__(self, params: TextInputParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        # a PyLate folder's prompts, with its prefixes in front, or a Stanford folder's markers (a workflow that names
        # this processor for another folder, a plugin's, keeps the folder's sentence-transformers prompts; one that
        # gives both prompts itself, e.g. examples/wde-plugin-colbert's, needs none of the folder's)
        composed = None
        if not {"query", "document"} <= set(params.prompts) and is_multi_vector_folder(ctx.source):
            composed = read_multi_vector_config(ctx.source).prompts
        if composed is not None:
            self.prompts = {**composed, **params.prompts}
        # A MultiVectorEncoder always has a `query` and a `document` prompt, empty (or saved as null) when the folder
        # gives no text: encode_query / encode_document then apply none, never `default_prompt_name`.
        self.prompts = {"query": "", "document": "", **{name: text or "" for name, text in self.prompts.items()}}

    def request_options(self) -> dict[str, tuple[str, ...]]:
        return {"task": TASKS}

    def to_prompt(self, inputs: Any, params: PoolingParams, field: InputName = "input") -> Prompt:
        if params.dimensions is not None:
            raise RequestError("dimensions: a multi-vector model's token vectors cannot be truncated", "dimensions")
        if params.prompt is None and params.prompt_name is None:
            params = replace(params, prompt_name=task_of(params))
        return super().to_prompt(inputs, params, field)


class MultiVectorTokenize(LazyTokenizeRequestProcessor):
    """`lazy_tokenize` with a limit per task (`query_length`, `document_length`; a `fixed` query expansion's
    `length`), then a query shorter than the expansion length padded up to it with the expansion token."""

    name = "multi_vector_tokenize"
    Params = LazyTokenizeParams

    def __init__(self, params: LazyTokenizeParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        cfg = read_multi_vector_config(ctx.source)
        if cfg.prefix_tokens:  # PyLate's "[Q] " / "[D] ": one piece each, as sentence-transformers registers them
            ctx.tokenizer.register_special_tokens(lambda hf: register_prefix_tokens(hf, cfg.prefix_tokens))
        where = ctx.source.path / "sentence_bert_config.json"
        self.expansion = cfg.expansion
        query = None if cfg.query_length is None else (cfg.query_length, "query_length")
        if self.expansion is not None and self.expansion.strategy == "fixed":
            query = (self.expansion.length, "query_expansion length")  # the floor and the ceiling
        self.limits: dict[str, tuple[int, str] | None] = {
            "query": query,
            "document": None if cfg.document_length is None else (cfg.document_length, "document_length")}
        """Per task, the most tokens an input may have and the setting that says so (None: the model's limit)."""
        floor = None if self.expansion is None else (self.expansion.length, "query_expansion length")
        for limit in filter(None, (*self.limits.values(), floor)):
            if limit[0] > self.max_length:
                raise ModelLoadError(f"{where}: {limit[1]} {limit[0]} is more than the {self.max_length} tokens the"
                                     " model allows per input")
        self.expansion_id: int | None = None
        if self.expansion is not None:
            self.expansion_id = self._expansion_id(ctx, where)

    def _expansion_id(self, ctx: BuildContext, where: Any) -> int:
        """The expansion token's id, as sentence-transformers picks it: `token`, else the mask token, else EOS."""
        hf = ctx.tokenizer.hf_tokenizer
        token = self.expansion.token  # type: ignore[union-attr]
        if token is not None:
            token_id = hf.convert_tokens_to_ids(token)
            if token_id is None or (token_id == hf.unk_token_id and token != hf.unk_token):
                raise ModelLoadError(f"{where}: query_expansion token {token!r} is not in the tokenizer's vocabulary")
            return token_id
        token_id = hf.mask_token_id if hf.mask_token_id is not None else hf.eos_token_id
        if token_id is None:
            raise ModelLoadError(f"{where}: query_expansion names no token and the tokenizer has neither a mask nor an"
                                 " EOS token to expand queries with")
        return token_id

    def request_options(self) -> dict[str, tuple[str, ...]]:
        return {"task": TASKS}

    def _check_length(self, request: Request, ids: list[int], types: list[int] | None,
                      limit: int) -> SchedulableRequest | RequestError:
        task = task_of(request.params)
        own = self.limits[task]
        if own is not None and own[0] < limit:
            limit = own[0]
            if len(ids) > limit and not request.params.truncate and request.params.max_tokens is None:
                return RequestError(f"input has {len(ids)} tokens, more than the {limit} a {task} may have ({own[1]}"
                                    " of the model); shorten it or set truncate=true", "input", kind="too_long")
        result = super()._check_length(request, ids, types, limit)
        if task != "query" or self.expansion is None or not isinstance(result, SchedulableRequest):
            return result
        return self._expand(result)

    def _expand(self, query: SchedulableRequest) -> SchedulableRequest:
        """`query` padded to the expansion length with the expansion token, its expansion tokens masked as keys
        without `attend`. Token ids given as such count their trailing expansion tokens as expansion too (that is
        how a split engine's core receives a query its API server expanded), except a query as long as the
        expansion length or longer, which has none, as in sentence-transformers."""
        ids, types, length = query.token_ids, query.token_type_ids, self.expansion.length  # type: ignore[union-attr]
        missing = max(length - len(ids), 0)
        ids = ids + [self.expansion_id] * missing  # type: ignore[list-item]
        types = None if types is None else types + [0] * missing
        expansion = missing
        if isinstance(query.request.prompt, TokensPrompt) and len(ids) == length:
            real = length
            while real and ids[real - 1] == self.expansion_id:
                real -= 1
            expansion = length - real
        masked = 0 if self.expansion.attend else expansion  # type: ignore[union-attr]
        return SchedulableRequest(query.request, ids, types, masked_keys=masked)


class MultiVectorInputBuilder(PackedInputBuilder):
    """`packed`, plus the key mask of sequences with masked keys (`SchedulableRequest.masked_keys`: their last
    tokens, the query expansion without `attend`)."""

    name = "multi_vector_packed"

    def build(self, batch: SchedulerOutput) -> ModelInput:
        built = super().build(batch)
        masked = [s.masked_keys for s in batch.scheduled]
        if not any(masked):
            return built
        lens = torch.tensor(built.seq_lens)
        attended = (lens - torch.tensor(masked)).repeat_interleave(lens)
        keys = built.positions < attended
        return replace(built, key_mask=keys.pin_memory() if built.input_ids.is_pinned() else keys)


class MultiVectorPooler(Pooler):
    """A MultiVectorEncoder's modules after the Transformer: `MultiVectorMask` (which tokens are scored, per task),
    the per-token projection (Stanford's `linear.weight`), Dense modules and Normalize, then a
    `HierarchicalTokenPooling`. Output 'colbert': each request's scored (or pooled) tokens' vectors, float32.

    A request's `normalize` (else the params') decides the last L2 normalization: the folder's last Normalize, or
    for a pooled sequence the pooling's `normalize_embeddings` (its Normalize before the pooling always runs: the
    clustering reads unit vectors, as the folder's pipeline gives them).

    `similarity_fn_name` ('maxsim' or 'meanmaxsim', from the folder) and `vector_size` are plain data for scoring."""

    kind = "pooler"
    name = "multi_vector"
    Params = MultiVectorPoolerParams
    outputs = (OUTPUT,)

    def __init__(self, params: MultiVectorPoolerParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        cfg = read_multi_vector_config(ctx.source)
        device = ctx.model.device
        stages = [StModule(s.kind, s.path, s.config) for s in cfg.stages]
        width = ctx.model.hidden_size
        projection = None if cfg.projection is None else self._projection(ctx, cfg.projection, width)
        if projection is not None:
            width = projection.out_features
        head, self.vector_size, normalize_last = after_pooling(stages, width)
        if projection is not None:
            head = projection if head is None else torch.nn.Sequential(projection, head)
        self.head = None if head is None else head.to(device)
        self.normalize = normalize_last if params.normalize == "auto" else params.normalize
        self.token_pooling = cfg.token_pooling
        self.normalize_before_pooling = normalize_last
        """A pooled sequence's vectors are normalized before pooling when the folder's last Normalize precedes it."""
        self.normalize_pooled = self.normalize
        if self.token_pooling is not None and params.normalize == "auto":
            self.normalize_pooled = self.token_pooling.normalize_embeddings
        self.similarity_fn_name: Literal["maxsim", "meanmaxsim"] = cfg.similarity_fn_name  # type: ignore[assignment]
        self.skip_tasks = frozenset(cfg.skiplist_tasks)
        ids = self._skiplist_ids(ctx, cfg.skiplist_words)
        self.skiplist = torch.tensor(ids, dtype=torch.long, device=device) if ids else None
        keep = cfg.keep_only_token_ids
        self.keep_only = None if keep is None else torch.tensor(keep, dtype=torch.long, device=device)
        if cfg.expansion is not None and not cfg.expansion.attend and not ctx.attention.supports_key_mask:
            raise ModelLoadError(f"attention backend {ctx.attention.name!r} cannot mask keys, which this model's query"
                                 " expansion needs (attend: false); use attention auto, torch_sdpa or cpu_varlen")

    @staticmethod
    def _projection(ctx: BuildContext, projection: Projection, width: int) -> torch.nn.Linear:
        """The checkpoint's inline projection (Stanford's `linear.weight`) as a bias-free float32 Linear."""
        found = [t for _, t in ctx.source.iter_weights(lambda n: n == projection.tensor)]
        if not found:
            raise ModelLoadError(f"{ctx.source.path}: the checkpoint has no {projection.tensor!r}, the per-token"
                                 " projection a Stanford ColBERT folder holds beside the encoder's weights")
        weight = found[0]
        if weight.ndim != 2 or weight.shape[1] != width:
            raise ModelLoadError(f"{ctx.source.path}: {projection.tensor} has shape {tuple(weight.shape)}; it must"
                                 f" be [dim, {width}] for the encoder's {width} features")
        if projection.dim is not None and weight.shape[0] != projection.dim:
            raise ModelLoadError(f"{projection.where}: dim {projection.dim} does not match {projection.tensor}'s"
                                 f" {weight.shape[0]} rows")
        linear = torch.nn.Linear(width, weight.shape[0], bias=False)
        with torch.no_grad():
            linear.weight.copy_(weight.float())
        return linear.float().eval()

    @staticmethod
    def _skiplist_ids(ctx: BuildContext, words: Sequence[str]) -> list[int]:
        """The skiplist words' token ids, as MultiVectorMask resolves them: a word that is not one vocabulary token
        (it resolves to the unknown token) is dropped with a warning, as sentence-transformers drops it."""
        hf = ctx.tokenizer.hf_tokenizer
        ids, dropped = [], []
        for word in words:
            token_id = hf.convert_tokens_to_ids(word)
            if hf.unk_token_id is not None and token_id == hf.unk_token_id and word != hf.unk_token:
                dropped.append(word)
            else:
                ids.append(token_id)
        if dropped:
            log.warning("%s: skiplist words %s are not single vocabulary tokens; left out of the skiplist, as"
                        " sentence-transformers leaves them out", ctx.source.path, dropped)
        return ids

    def request_options(self) -> dict[str, tuple[str, ...]]:
        return {"task": TASKS}

    def scored(self, batch: ModelInput) -> torch.Tensor | None:
        """Boolean [tokens]: the tokens whose vectors are output (None: all of them). A query keeps every token,
        its expansion tokens included; the skiplist applies to the tasks in `skiplist_tasks` (documents by
        default), `keep_only_token_ids` to documents."""
        queries = [task_of(p) == "query" for p in batch.pooling_params]
        skip_query, skip_document = "query" in self.skip_tasks, "document" in self.skip_tasks
        skips = self.skiplist is not None and any(skip_query if q else skip_document for q in queries)
        restrict = self.keep_only is not None and not all(queries)
        if not skips and not restrict:
            return None
        ids = batch.input_ids
        is_query = torch.tensor(queries, device=ids.device)[segment_ids(batch)]
        keep = torch.ones_like(ids, dtype=torch.bool)
        if skips:
            applies = torch.where(is_query, skip_query, skip_document)
            keep &= ~(applies & torch.isin(ids, self.skiplist))
        if restrict:
            keep &= is_query | torch.isin(ids, self.keep_only)  # type: ignore[arg-type]
        return keep

    def forward(self, hidden: torch.Tensor, batch: ModelInput) -> Pooled:
        keep = self.scored(batch)
        x = (hidden if keep is None else hidden[keep]).float()
        if self.head is not None:
            x = self.head(x)
        counts = torch.tensor(batch.seq_lens, device=x.device)
        if keep is not None:
            counts = torch.zeros_like(counts).index_add_(0, segment_ids(batch), keep.long())
        pooled = [self.token_pooling is not None and task_of(p) in self.token_pooling.tasks
                  for p in batch.pooling_params]
        if any(pooled):
            x, counts = self._pool(x, counts, pooled)
        norms = [(self.normalize_pooled if pool else self.normalize) if p.normalize is None else p.normalize
                 for p, pool in zip(batch.pooling_params, pooled)]
        if all(norms):
            x = l2_normalize(x)
        elif any(norms):
            per_token = torch.tensor(norms, device=x.device).repeat_interleave(counts)[:, None]
            x = torch.where(per_token, l2_normalize(x), x)
        bounds = [0, *torch.cumsum(counts, 0).tolist()]
        return Pooled(ragged={OUTPUT: (x, bounds)})

    def _pool(self, x: torch.Tensor, counts: torch.Tensor, pooled: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """The pooled sequences' vectors normalized (when the folder's Normalize precedes the pooling) and merged."""
        if self.normalize_before_pooling:
            per_token = torch.tensor(pooled, device=x.device).repeat_interleave(counts)[:, None]
            x = torch.where(per_token, l2_normalize(x), x)
        return pool_tokens(x, counts, pooled, self.token_pooling)  # type: ignore[arg-type]


def maxsim(query: torch.Tensor, documents: Sequence[torch.Tensor],
           similarity: Literal["maxsim", "meanmaxsim"] = "maxsim") -> torch.Tensor:
    """Late-interaction scores of one query ([q, dim] vectors) against each document ([n_i, dim]): for each query
    vector its best dot product over the document's vectors, summed ('maxsim') or averaged over the query's vectors
    ('meanmaxsim'), as `MultiVectorEncoder.similarity` scores. [len(documents)] float32, all documents at once (one
    matrix product, one segmented max); a document without vectors scores 0."""
    if similarity not in ("maxsim", "meanmaxsim"):
        raise ValueError(f"similarity must be 'maxsim' or 'meanmaxsim', got {similarity!r}")
    q = query.float()
    if not documents:
        return q.new_zeros(0)
    lens = torch.tensor([d.shape[0] for d in documents], device=q.device)
    sims = torch.cat([d.to(q.device, torch.float32) for d in documents]) @ q.T  # [tokens of all documents, q]
    seg = torch.arange(len(documents), device=q.device).repeat_interleave(lens)
    best = q.new_zeros(len(documents), q.shape[0]).scatter_reduce_(0, seg[:, None].expand_as(sims), sims, "amax",
                                                                   include_self=False)
    scores = best.sum(1)
    return scores / q.shape[0] if similarity == "meanmaxsim" else scores
