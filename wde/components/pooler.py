"""Poolers: turn packed hidden states into per-request outputs, on the device, before the copy back.

Every pooler returns a `Pooled`: tensors with one row per request (`rows`), and/or flat per-token tensors
split by boundaries (`ragged`, e.g. per-token embeddings). The output processor only slices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from wde.components.base import BuildContext, Component
from wde.components.model_input_builder import ModelInput
from wde.components.models.fused import l2_normalize
from wde.components.params import SentencePoolerParams  # torch-free, so validating a workflow needs no torch
from wde.errors import ModelLoadError

PoolingMode = Literal["cls", "mean", "max", "last", "all"]


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
        """The outputs of consecutive pieces of one batch (`ModelInput.split`) as the outputs of the whole."""
        if len(parts) == 1:
            return parts[0]
        rows = {k: torch.cat([p.rows[k] for p in parts]) for k in parts[0].rows}
        ragged = {}
        for k in parts[0].ragged:
            bounds = [0]
            for p in parts:
                offset, b = bounds[-1], p.ragged[k][1]
                bounds.extend(offset + x - b[0] for x in b[1:])
            ragged[k] = (torch.cat([p.ragged[k][0] for p in parts]), bounds)
        return Pooled(rows, ragged)


def segment_ids(batch: ModelInput) -> torch.Tensor:
    """For every packed token, the index of the sequence it belongs to."""
    lens = torch.tensor(batch.seq_lens, device=batch.input_ids.device)
    return torch.repeat_interleave(torch.arange(batch.num_seqs, device=lens.device), lens)


def pool(hidden: torch.Tensor, batch: ModelInput, mode: PoolingMode) -> torch.Tensor:
    """[num_seqs, hidden] pooled states (not for mode 'all', which keeps every token)."""
    cu = batch.cu_seqlens.long()
    if mode == "cls":
        return hidden[cu[:-1]]
    if mode == "last":
        return hidden[cu[1:] - 1]
    seg = segment_ids(batch)
    h = hidden.float()
    if mode == "mean":
        sums = torch.zeros(batch.num_seqs, h.shape[1], device=h.device, dtype=h.dtype).index_add_(0, seg, h)
        lens = (cu[1:] - cu[:-1]).to(h.dtype)
        return (sums / lens[:, None]).to(hidden.dtype)
    if mode == "max":
        init = torch.full((batch.num_seqs, h.shape[1]), float("-inf"), device=h.device, dtype=h.dtype)
        return init.scatter_reduce_(0, seg[:, None].expand_as(h), h, "amax").to(hidden.dtype)
    raise ValueError(f"unknown pooling mode {mode!r}")


def finish_embeddings(x: torch.Tensor, batch: ModelInput, normalize_default: bool) -> torch.Tensor:
    """Apply per-request `dimensions` (matryoshka truncation) and normalization, in that order."""
    x = x.float()
    dims = [p.dimensions for p in batch.pooling_params]
    norms = [normalize_default if p.normalize is None else p.normalize for p in batch.pooling_params]
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


# sentence-transformers' pooling mode names -> WDE's. Its other modes (mean_sqrt_len_tokens, weightedmean) and
# concatenations of several modes are refused when the model is loaded, never silently pooled another way.
_ST_MODES: dict[str, PoolingMode] = {"cls": "cls", "mean": "mean", "max": "max", "lasttoken": "last"}
_ST_KNOWN_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
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


def st_pooling_mode(cfg: dict, where: str) -> PoolingMode:
    """WDE's pooling mode for a sentence-transformers `Pooling/config.json` in either format.

    Follows sentence-transformers' own reading: `pooling_mode` wins over the legacy boolean keys, and a config
    that names no mode at all means "mean" (its default). `where` names the file in errors.
    """
    override = " (or set pooler.params.pooling explicitly)"
    supported = ", ".join(_ST_MODES)
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
        if name not in _ST_KNOWN_MODES:
            raise ModelLoadError(f"{where}: unknown pooling mode {name!r}; WDE supports {supported}{override}")
    if len(names) > 1:
        raise ModelLoadError(f"{where}: pooling concatenates the modes {names}; WDE pools with exactly one"
                             f" of {supported}{override}")
    if names[0] not in _ST_MODES:
        raise ModelLoadError(f"{where}: pooling mode {names[0]!r} is not supported; WDE supports {supported}{override}")
    if cfg.get("include_prompt", True) is False:
        raise ModelLoadError(f"{where}: include_prompt is false (prompt tokens left out of the pooling), which WDE"
                             f" does not support; it pools over every token, prompt included{override}")
    return _ST_MODES[names[0]]


class SentencePooler(Component):
    """CLS, mean, max, last-token or all-token pooling with optional L2 normalization (output 'dense')."""

    kind = "pooler"
    name = "sentence"
    Params = SentencePoolerParams

    def __init__(self, params: SentencePoolerParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self.mode: PoolingMode = params.pooling if params.pooling != "auto" else self._st_mode(ctx)  # type: ignore[assignment]
        if params.normalize == "auto":
            self.normalize = ctx.source.st_module_path("Normalize") is not None
        else:
            self.normalize = bool(params.normalize)
        self.outputs = ("token_embeddings",) if self.mode == "all" else ("dense",)
        self.dense_size = None if self.mode == "all" else ctx.model.hidden_size

    @staticmethod
    def _st_mode(ctx: BuildContext) -> str:
        folder = ctx.source.st_module_path("Pooling")
        cfg = ctx.source.read_json(f"{folder.relative_to(ctx.source.path)}/config.json") if folder else None
        if not cfg:
            raise ModelLoadError(
                f"pooler.params.pooling is 'auto' but {ctx.source.path} has no sentence-transformers Pooling config;"
                " set pooler.params.pooling to one of cls, mean, max, last, all")
        return st_pooling_mode(cfg, str(folder / "config.json"))

    def forward(self, hidden: torch.Tensor, batch: ModelInput) -> Pooled:
        if self.mode == "all":
            x = hidden.float()
            norms = [self.normalize if p.normalize is None else p.normalize for p in batch.pooling_params]
            if any(norms):
                per_token = torch.tensor(norms, device=x.device)[segment_ids(batch)][:, None]
                x = torch.where(per_token, l2_normalize(x), x)
            return Pooled(ragged={"token_embeddings": (x, batch.cu_seqlens.tolist())})
        return Pooled(rows={"dense": finish_embeddings(pool(hidden, batch, self.mode), batch, self.normalize)})
