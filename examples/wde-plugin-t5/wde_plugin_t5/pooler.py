"""The `sentence_dense` pooler: sentence-transformers' Pooling -> Dense... -> Normalize, read from the model folder.

sentence-T5 and GTR-T5 mean-pool the encoder states, project them with a bias-free Dense layer (identity
activation) and L2-normalize. The Dense modules are read from `modules.json` in order, with their
`config.json` (in/out features, bias, activation) and weights (`model.safetensors` or `pytorch_model.bin`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from wde.api import (BuildContext, ModelInput, ModelLoadError, Pooled, Pooler, finish_embeddings, pool,
                     st_pooling_mode)
from wde_plugin_t5.params import DensePoolerParams

ACTIVATIONS: dict[str, type[nn.Module]] = {
    "torch.nn.modules.linear.Identity": nn.Identity,
    "torch.nn.modules.activation.Tanh": nn.Tanh,
}
"""sentence-transformers Dense activations this pooler reproduces (by the class path ST writes)."""


def _load_dense(folder: Path) -> nn.Sequential:
    """One sentence-transformers Dense module as `Sequential(Linear, activation)`."""
    import json

    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ModelLoadError(f"{folder} has no config.json for its sentence-transformers Dense module")
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    act_name = cfg.get("activation_function", "torch.nn.modules.activation.Tanh")
    if act_name not in ACTIVATIONS:
        raise ModelLoadError(f"{cfg_path}: activation_function {act_name!r} is not supported;"
                             f" supported: {', '.join(ACTIVATIONS)}")
    if (folder / "model.safetensors").exists():
        from safetensors.torch import load_file

        state = load_file(str(folder / "model.safetensors"))
    elif (folder / "pytorch_model.bin").exists():
        state = torch.load(str(folder / "pytorch_model.bin"), map_location="cpu", weights_only=True)
    else:
        raise ModelLoadError(f"{folder} has no model.safetensors or pytorch_model.bin for its Dense module")
    linear = nn.Linear(int(cfg["in_features"]), int(cfg["out_features"]), bias=bool(cfg.get("bias", True)))
    try:
        linear.load_state_dict({k.removeprefix("linear."): v for k, v in state.items()})
    except RuntimeError as e:
        raise ModelLoadError(f"{folder}: the Dense weights do not match its config.json: {e}") from None
    return nn.Sequential(linear, ACTIVATIONS[act_name]())


class SentenceDensePooler(Pooler):
    """Pooling (mode from the ST config or `pooling`), every Dense module in `modules.json` order, then the
    per-request `dimensions` / `normalize` handling of `finish_embeddings` (output 'dense')."""

    name = "sentence_dense"
    Params = DensePoolerParams
    outputs = ("dense",)

    def __init__(self, params: DensePoolerParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        modules = ctx.source.read_json("modules.json") or []
        self.mode = params.pooling if params.pooling != "auto" else self._st_mode(ctx, modules)
        folders = [ctx.source.path / m.get("path", "") for m in modules if str(m.get("type", "")).endswith(".Dense")]
        self.dense = nn.Sequential(*(_load_dense(f) for f in folders)).to(ctx.model.device, ctx.model.dtype).eval()
        width = ctx.model.hidden_size
        for layer in self.dense:
            if layer[0].in_features != width:
                raise ModelLoadError(f"a Dense module of {ctx.source.path} takes {layer[0].in_features} features,"
                                     f" the input before it has {width}")
            width = layer[0].out_features
        self.dense_size = width
        if params.normalize == "auto":
            self.normalize = any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
        else:
            self.normalize = bool(params.normalize)

    @staticmethod
    def _st_mode(ctx: BuildContext, modules: list[dict]) -> str:
        pooling = [m for m in modules if str(m.get("type", "")).endswith(".Pooling")]
        cfg = ctx.source.read_json(f"{pooling[0].get('path', '')}/config.json") if pooling else None
        if not cfg:
            raise ModelLoadError(f"pooler.params.pooling is 'auto' but {ctx.source.path} has no sentence-transformers"
                                 " Pooling config; set pooler.params.pooling to one of mean, cls, max")
        mode = st_pooling_mode(cfg, f"{ctx.source.path}/{pooling[0].get('path', '')}/config.json")
        if mode not in ("mean", "cls", "max"):
            raise ModelLoadError(f"pooling mode {mode!r} is not supported by sentence_dense; use mean, cls or max")
        return mode

    def forward(self, hidden: torch.Tensor, batch: ModelInput) -> Pooled:
        x = self.dense(pool(hidden, batch, self.mode))
        return Pooled(rows={"dense": finish_embeddings(x, batch, self.normalize)})
