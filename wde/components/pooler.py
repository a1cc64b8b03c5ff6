"""Poolers: turn packed hidden states into per-request outputs, on the device, before the copy back.

Every pooler returns a `Pooled`: tensors with one row per request (`rows`), and/or flat per-token tensors
split by boundaries (`ragged`, e.g. per-token embeddings). The output processor only slices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np
import torch

from wde.components.base import BuildContext
from wde.components.kinds import Pooler
from wde.components.model_input_builder import ModelInput
from wde.components.models.fused import l2_normalize
from wde.components.params import SentencePoolerParams  # torch-free, so validating a workflow needs no torch
from wde.components.st_modules import after_pooling, read_modules, transformer_config
from wde.errors import ModelLoadError
from wde.request import PoolingParams

PoolingMode = Literal["cls", "mean", "max", "last", "weightedmean", "mean_sqrt_len", "all"]


@dataclass
class Pooled:
    """Per-request results of one batch. `ragged[name] = (flat, bounds)`: request i owns flat[bounds[i]:bounds[i+1]]."""

    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    ragged: dict[str, tuple[torch.Tensor, list[int]]] = field(default_factory=dict)

    def to(self, device: str | torch.device) -> "Pooled":
        return Pooled({k: v.to(device) for k, v in self.rows.items()},
                      {k: (v.to(device), b) for k, (v, b) in self.ragged.items()})

    @staticmethod
    def cat(parts: "list[Pooled]") -> "Pooled":
        """The outputs of consecutive pieces of one batch (`ModelInput.split`) as the outputs of the whole.

        Pieces may differ in width (a piece whose requests all ask for the same `dimensions` is cut to it, see
        `finish_embeddings`): narrower rows are padded with zeros, as a mixed batch's are; the output processor
        cuts each request's row to its width."""
        if len(parts) == 1:
            return parts[0]
        rows = {k: _cat_rows([p.rows[k] for p in parts]) for k in parts[0].rows}
        ragged = {}
        for k in dict.fromkeys(k for p in parts for k in p.ragged):  # a piece where nobody asked has none
            empty = next(p.ragged[k][0][:0] for p in parts if k in p.ragged)
            bounds = [0]
            for p in parts:
                offset, b = bounds[-1], p.ragged[k][1] if k in p.ragged else [0] * (p.num_seqs + 1)
                bounds.extend(offset + x - b[0] for x in b[1:])
            ragged[k] = (torch.cat([p.ragged[k][0] if k in p.ragged else empty for p in parts]), bounds)
        return Pooled(rows, ragged)

    @property
    def num_seqs(self) -> int:
        """How many requests these are the outputs of."""
        if self.ragged:
            return len(next(iter(self.ragged.values()))[1]) - 1
        return len(next(iter(self.rows.values())))


def _cat_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    width = max(r.shape[-1] for r in rows) if rows[0].dim() > 1 else None
    if width is not None and any(r.shape[-1] != width for r in rows):
        rows = [torch.nn.functional.pad(r, (0, width - r.shape[-1])) for r in rows]
    return torch.cat(rows)


def segment_ids(batch: ModelInput) -> torch.Tensor:
    """For every packed token, the index of the sequence it belongs to."""
    lens = torch.tensor(batch.seq_lens, device=batch.input_ids.device)
    return torch.repeat_interleave(torch.arange(batch.num_seqs, device=lens.device), lens)


def pool(hidden: torch.Tensor, batch: ModelInput, mode: PoolingMode, skip: torch.Tensor | None = None) -> torch.Tensor:
    """[num_seqs, hidden] pooled states (not for mode 'all', which keeps every token).

    `skip[i]` leading tokens of sequence i are left out (an instruction prompt, sentence-transformers'
    `include_prompt: false`): 'cls' then takes the first token after them, the averages and 'max' ignore them.
    Averages accumulate in float32. 'weightedmean' weighs token p (0-based) by p + 1, 'mean_sqrt_len' divides the
    sum by the square root of the token count; both as sentence-transformers does.
    """
    cu = batch.cu_seqlens.long()
    if mode == "cls":
        if skip is None:
            return hidden[cu[:-1]]
        lens = cu[1:] - cu[:-1]
        return hidden[cu[:-1] + torch.where(skip < lens, skip, 0)]
    if mode == "last":
        return hidden[cu[1:] - 1]
    seg = segment_ids(batch)
    h = hidden.float()
    keep = None
    if skip is not None or mode == "weightedmean":
        position = torch.arange(h.shape[0], device=h.device) - cu[:-1][seg]
        if skip is not None:
            keep = position >= skip[seg]
            h = torch.where(keep[:, None], h, 0.0) if mode != "max" else h.masked_fill(~keep[:, None], float("-inf"))
    if mode == "max":
        init = torch.full((batch.num_seqs, h.shape[1]), float("-inf"), device=h.device, dtype=h.dtype)
        return init.scatter_reduce_(0, seg[:, None].expand_as(h), h, "amax").to(hidden.dtype)
    weights = (position + 1).to(h.dtype) if mode == "weightedmean" else torch.ones(h.shape[0], device=h.device)
    if keep is not None:
        weights = weights * keep
    if mode == "weightedmean":
        h = h * weights[:, None]
    elif mode not in ("mean", "mean_sqrt_len"):
        raise ValueError(f"unknown pooling mode {mode!r}")
    sums = torch.zeros(batch.num_seqs, h.shape[1], device=h.device, dtype=h.dtype).index_add_(0, seg, h)
    counts = torch.zeros(batch.num_seqs, device=h.device, dtype=h.dtype).index_add_(0, seg, weights.to(h.dtype))
    counts = counts.clamp_min(1e-9)
    return (sums / (counts.sqrt() if mode == "mean_sqrt_len" else counts)[:, None]).to(hidden.dtype)


def finish_embeddings(x: torch.Tensor, batch: ModelInput, normalize_default: bool) -> torch.Tensor:
    """Apply per-request `dimensions` (matryoshka truncation) and normalization, in that order."""
    return finish_rows(x, batch.pooling_params, normalize_default)


def finish_rows(x: torch.Tensor, params: Sequence[PoolingParams], normalize_default: bool) -> torch.Tensor:
    """`finish_embeddings` for rows pooled with these params (one each)."""
    x = x.float()
    dims = [p.dimensions for p in params]
    norms = [normalize_default if p.normalize is None else p.normalize for p in params]
    if any(d is not None for d in dims):
        width = min(d or x.shape[1] for d in dims)
        if all(d == width for d in dims):
            x = x[:, :width]
        else:
            x = x.clone()
            for i, d in enumerate(dims):
                if d is not None:
                    x[i, d:] = 0.0
    if all(norms):
        return l2_normalize(x)
    if any(norms):
        mask = torch.tensor(norms, device=x.device)[:, None]
        return torch.where(mask, l2_normalize(x), x)
    return x


# sentence-transformers' pooling mode names -> WDE's.
_ST_MODES: dict[str, PoolingMode] = {"cls": "cls", "mean": "mean", "max": "max", "lasttoken": "last",
                                     "weightedmean": "weightedmean", "mean_sqrt_len_tokens": "mean_sqrt_len"}
# sentence-transformers < 5 wrote one boolean key per mode; >= 5 writes `"pooling_mode": "mean"` (a name, or a
# list of names to concatenate) plus `include_prompt`, and reads both forms.
_ST_LEGACY_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


@dataclass(frozen=True)
class StPooling:
    """A sentence-transformers Pooling config: the modes whose results are concatenated (most often one), and
    whether the instruction prompt's tokens are pooled too."""

    modes: tuple[PoolingMode, ...]
    include_prompt: bool = True


def st_pooling(cfg: dict, where: str) -> StPooling:
    """WDE's reading of a sentence-transformers `Pooling/config.json` in either format.

    Follows sentence-transformers' own reading: `pooling_mode` wins over the legacy boolean keys, and a config
    that names no mode at all means "mean" (its default). `where` names the file in errors.
    """
    override = " (or set pooler.params.pooling explicitly)"
    if "pooling_mode" in cfg:
        raw = cfg["pooling_mode"]
        if isinstance(raw, str):
            names = [raw]
        elif isinstance(raw, (list, tuple)) and raw and all(isinstance(m, str) for m in raw):
            names = list(raw)
        else:
            raise ModelLoadError(f"{where}: pooling_mode must be a mode name or a list of them, got {raw!r}{override}")
    else:
        names = [mode for key, mode in _ST_LEGACY_KEYS.items() if cfg.get(key)] or ["mean"]
    for name in names:
        if name not in _ST_MODES:
            raise ModelLoadError(f"{where}: unknown pooling mode {name!r}; WDE supports {', '.join(_ST_MODES)}{override}")
    include = cfg.get("include_prompt", True)
    if not isinstance(include, bool):
        raise ModelLoadError(f"{where}: include_prompt must be true or false, got {include!r}")
    return StPooling(tuple(_ST_MODES[n] for n in names), include)


def st_pooling_mode(cfg: dict, where: str) -> PoolingMode:
    """The one pooling mode of a sentence-transformers Pooling config, for poolers that pool with one mode over
    every token (`pool`); a concatenation of modes or `include_prompt: false` is refused naming the file."""
    st = st_pooling(cfg, where)
    override = " (or set pooler.params.pooling explicitly)"
    if len(st.modes) > 1:
        raise ModelLoadError(f"{where}: pooling concatenates the modes {list(st.modes)}; this pooler pools with"
                             f" exactly one{override}")
    if not st.include_prompt:
        raise ModelLoadError(f"{where}: include_prompt is false (prompt tokens left out of the pooling), which this"
                             f" pooler does not support{override}")
    return st.modes[0]


class ChunkedPooling:
    """The contract of a pooler whose dense embeddings may be computed in chunks (`PoolingParams.chunk`,
    wde/chunking.py): a sequence pooled with `normalize=False` and `dimensions=None` gives its raw embedding (after
    every module but the normalization), and `finish_chunks` turns the token-weighted mean of a request's raw chunk
    embeddings into its embedding. The engine accepts `chunk` only from a pooler that subclasses this."""

    def finish_chunks(self, mean: np.ndarray, params: PoolingParams) -> np.ndarray:
        raise NotImplementedError


TOKENS = "token_embeddings"
"""Per-token final hidden states (TEI's /embed_all, sentence-transformers' output_value="token_embeddings")."""

SPANS = "chunk_embeddings"
"""One embedding per token span of `PoolingParams.spans` (late chunking, wde/late_chunking.py)."""


class SpanPooling:
    """The contract of a pooler that pools token spans of a sequence (late chunking, `PoolingParams.spans`): a
    sequence with spans gets the ragged output `SPANS`, one row per span in order, each the mean of the span's
    final token states (mean pooling, as Jina's late chunking does, whatever the model's own pooling), then the
    modules after pooling, `dimensions` and normalization as for 'dense'. Rows are as wide as the model's
    embeddings: a row's features from its request's `dimensions` on are zeros. `pools_spans()` says whether this
    pooler, as built, can (one that pools every token, or concatenates pooling modes, cannot: its modules after
    pooling take another width). The engine accepts `spans` only from a pooler that subclasses this and says so."""

    def pools_spans(self) -> bool:
        return True

    def pool_spans(self, hidden: torch.Tensor, batch: ModelInput) -> tuple[torch.Tensor, list[int]]:
        """(rows, bounds): sequence i owns rows[bounds[i]:bounds[i+1]], one per span (none without spans)."""
        raise NotImplementedError


class SentencePooler(Pooler, ChunkedPooling, SpanPooling):
    """sentence-transformers' pipeline after the Transformer, read from the model folder's `modules.json`:
    Pooling (CLS, mean, max, last token, weighted mean, mean/sqrt(len), concatenations, with or without the
    prompt's tokens), then its Dense / LayerNorm / Dropout / Normalize modules in order (output 'dense'); or
    all-token states (`pooling: all`, output 'token_embeddings'). Every module runs here, on the device, in the
    same pass as the model; a module it does not implement is refused when the model is loaded.

    With a pooling mode other than `all`, a request whose `PoolingParams.outputs` names 'token_embeddings' also
    gets its tokens' final hidden states (special tokens included, raw unless the request sets `normalize=True`;
    TEI's /embed_all). Batches in which nobody asks cost nothing extra; a request that did not ask, batched with
    one that did, gets an empty [0, hidden] `token_embeddings`. Likewise a request with `PoolingParams.spans` gets
    one embedding per span as 'chunk_embeddings' (late chunking, `SpanPooling`)."""

    kind = "pooler"
    name = "sentence"
    Params = SentencePoolerParams

    def __init__(self, params: SentencePoolerParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        modules = read_modules(ctx.source)
        transformer_config(ctx.source)
        if params.pooling != "auto":
            st = StPooling((params.pooling,))  # type: ignore[arg-type]
        else:
            st = self._st_pooling(ctx)
        self.modes: tuple[PoolingMode, ...] = st.modes
        self.mode: str = "+".join(st.modes)
        """The pooling mode ("mean", ...; modes joined by "+" when the config concatenates several)."""
        self.include_prompt = st.include_prompt
        self.head, width, normalize_last = after_pooling(modules or [], ctx.model.hidden_size * len(st.modes))
        # pooling 'all' gives the Transformer's token states, as sentence-transformers' output_value=
        # "token_embeddings" does: the modules after pooling apply to sentence embeddings only.
        if self.head is not None:
            self.head.to(ctx.model.device)
        truncate_dim = (ctx.source.read_json("config_sentence_transformers.json") or {}).get("truncate_dim")
        if truncate_dim is not None:
            if not isinstance(truncate_dim, int) or isinstance(truncate_dim, bool) or truncate_dim < 1:
                raise ModelLoadError(f"{ctx.source.path / 'config_sentence_transformers.json'}: truncate_dim must be"
                                     f" a positive integer, got {truncate_dim!r}")
            width = min(width, truncate_dim)
        self.truncate_dim: int | None = truncate_dim
        """sentence-transformers' `truncate_dim`: every embedding keeps its first this many features (before
        normalization, so a normalizing model still returns unit vectors)."""
        if params.normalize == "auto":
            self.normalize = normalize_last
        else:
            self.normalize = bool(params.normalize)
        self.outputs: tuple[str, ...] = (TOKENS,) if self.mode == "all" else ("dense", TOKENS)
        self.dense_size = None if self.mode == "all" else width

    @staticmethod
    def _st_pooling(ctx: BuildContext) -> StPooling:
        folder = ctx.source.st_module_path("Pooling")
        cfg = ctx.source.read_json(f"{folder.relative_to(ctx.source.path)}/config.json") if folder else None
        if not cfg:
            raise ModelLoadError(
                f"pooler.params.pooling is 'auto' but {ctx.source.path} has no sentence-transformers Pooling config;"
                " set pooler.params.pooling to one of cls, mean, max, last, weightedmean, mean_sqrt_len, all")
        return st_pooling(cfg, str(folder / "config.json"))

    def finish_chunks(self, mean: np.ndarray, params: PoolingParams) -> np.ndarray:
        """`dimensions`, then the model's normalization (or the request's), as `forward` does per sequence."""
        return finish_rows(torch.from_numpy(mean)[None], [params], self.normalize)[0].numpy()

    def pools_spans(self) -> bool:
        """Spans are mean-pooled, which the modules after pooling take only where the model pools with one mode."""
        return self.mode != "all" and len(self.modes) == 1

    def pool_spans(self, hidden: torch.Tensor, batch: ModelInput) -> tuple[torch.Tensor, list[int]]:
        """Each span's mean token state, then the modules after pooling, `truncate_dim`, `dimensions` and
        normalization, as `embed` and `forward` give a sequence's 'dense' row."""
        means, bounds, params = span_means(hidden, batch)
        x = self.head(means) if self.head is not None else means
        if self.truncate_dim is not None:
            x = x[:, :self.truncate_dim]
        width = x.shape[1]
        x = finish_rows(x, params, self.normalize)
        return torch.nn.functional.pad(x, (0, width - x.shape[1])), bounds

    def embed(self, hidden: torch.Tensor, batch: ModelInput) -> torch.Tensor:
        """[num_seqs, width] float32 sentence embeddings before `dimensions` and normalization."""
        skip = None
        if not self.include_prompt and any(p.prompt_tokens for p in batch.pooling_params):
            skip = torch.tensor([p.prompt_tokens for p in batch.pooling_params], device=hidden.device)
        parts = [pool(hidden, batch, mode, skip).float() for mode in self.modes]
        x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if self.head is not None:
            x = self.head(x)
        return x if self.truncate_dim is None else x[:, :self.truncate_dim]

    def forward(self, hidden: torch.Tensor, batch: ModelInput) -> Pooled:
        if self.mode == "all":
            x = hidden.float()
            norms = [self.normalize if p.normalize is None else p.normalize for p in batch.pooling_params]
            if any(norms):
                per_token = torch.tensor(norms, device=x.device)[segment_ids(batch)][:, None]
                x = torch.where(per_token, l2_normalize(x), x)
            return Pooled(ragged={TOKENS: (x, batch.cu_seqlens.tolist())})
        pooled = Pooled(rows={"dense": finish_embeddings(self.embed(hidden, batch), batch, self.normalize)})
        wanted = [p.outputs is not None and TOKENS in p.outputs for p in batch.pooling_params]
        if any(wanted):
            pooled.ragged[TOKENS] = token_states(hidden, batch, wanted)
        if any(p.spans for p in batch.pooling_params):
            pooled.ragged[SPANS] = self.pool_spans(hidden, batch)
        return pooled


def span_means(hidden: torch.Tensor, batch: ModelInput) -> tuple[torch.Tensor, list[int], list[PoolingParams]]:
    """The float32 mean token state of every span of every sequence (`PoolingParams.spans`), in order; the bounds
    of each sequence's rows; each row's params. A sequence's spans are read off float64 prefix sums of its states:
    two rows per span whatever its length, and spans may overlap. A span outside its sequence raises (the engine
    refuses such spans when the request is made)."""
    cu = batch.cu_seqlens.tolist()
    rows: list[torch.Tensor] = []
    bounds = [0]
    params: list[PoolingParams] = []
    for i, p in enumerate(batch.pooling_params):
        spans = p.spans or ()
        if spans:
            length = cu[i + 1] - cu[i]
            if not all(0 <= start < end <= length for start, end in spans):
                raise ValueError(f"spans {list(spans)} are not all within the sequence's {length} tokens")
            seq = hidden[cu[i]:cu[i + 1]].double()
            sums = torch.cat([seq.new_zeros(1, seq.shape[1]), seq.cumsum(0)])
            starts = torch.tensor([s for s, _ in spans], device=seq.device)
            ends = torch.tensor([e for _, e in spans], device=seq.device)
            rows.append(((sums[ends] - sums[starts]) / (ends - starts)[:, None]).float())
            params.extend([p] * len(spans))
        bounds.append(bounds[-1] + len(spans))
    return torch.cat(rows), bounds, params


def token_states(hidden: torch.Tensor, batch: ModelInput, wanted: list[bool]) -> tuple[torch.Tensor, list[int]]:
    """The final hidden states of the tokens of the requests that asked (`wanted[i]`), float32, raw unless the
    request set `normalize=True`; the other requests own an empty range."""
    lens = [n if w else 0 for n, w in zip(batch.seq_lens, wanted)]
    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    if all(wanted):
        x = hidden.float()
    else:
        keep = torch.tensor(wanted, device=hidden.device)[segment_ids(batch)]
        x = hidden[keep].float()
    norms = [p.normalize is True for p, w in zip(batch.pooling_params, wanted) if w]
    if any(norms):
        per_token = torch.tensor(norms, device=x.device).repeat_interleave(
            torch.tensor([n for n in lens if n], device=x.device))[:, None]
        x = torch.where(per_token, l2_normalize(x), x)
    return x, bounds
