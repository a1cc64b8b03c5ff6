"""A sentence-transformers folder's module pipeline (`modules.json`), read and checked, and the modules that run
after pooling (Dense, LayerNorm, Normalize, Dropout) as one torch module.

sentence-transformers runs Transformer → Pooling → [Dense | LayerNorm | Normalize | Dropout]* in order. WDE runs
the Transformer as its model and the rest in the pooler, on the device, in the same pass. A module type WDE does
not implement (Router, StaticEmbedding, CNN, LSTM, WordWeights, a custom class, ...) or a setting of a known one
it does not implement is refused when the model is loaded, by name and path, never skipped.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from wde.components.models.fused import l2_normalize
from wde.errors import ModelLoadError

if TYPE_CHECKING:
    from wde.model_source import ModelSource

KNOWN = ("Transformer", "Pooling", "Dense", "LayerNorm", "Normalize", "Dropout")
"""The module classes of sentence-transformers WDE implements (under any of their package paths)."""
AFTER_POOLING = ("Dense", "LayerNorm", "Normalize", "Dropout")


@dataclass(frozen=True)
class StModule:
    """One entry of `modules.json`: its class name (e.g. "Dense"), its folder and its config.json (or {})."""

    kind: str
    path: Path
    config: dict[str, Any] = field(default_factory=dict)


def _kind(type_name: str, where: str) -> str:
    cls = type_name.rsplit(".", 1)[-1]
    if not type_name.startswith("sentence_transformers.") or cls not in KNOWN:
        raise ModelLoadError(
            f"{where}: sentence-transformers module type {type_name!r} is not implemented by WDE (it implements"
            f" {', '.join(KNOWN)}); it would change the vectors, so the model is refused rather than served without it")
    return cls


def read_modules(source: "ModelSource") -> list[StModule] | None:
    """The folder's sentence-transformers modules in order, or None when it has no `modules.json`.

    Raises `ModelLoadError` naming the module for an unknown type, a pipeline WDE cannot run (the Transformer
    not first, a module that is neither Pooling nor after it, a Dense on token embeddings) or a malformed file.
    """
    raw = source.read_json("modules.json")
    if raw is None:
        return None
    where = str(source.path / "modules.json")
    if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
        raise ModelLoadError(f"{where}: expected a list of modules, got {type(raw).__name__}")
    modules = []
    for i, m in enumerate(sorted(raw, key=lambda m: int(m.get("idx", 0)))):
        rel = str(m.get("path", ""))
        kind = _kind(str(m.get("type", "")), f"{where} module {i} ({rel or '.'})")
        cfg = source.read_json(f"{rel}/config.json") if rel and kind != "Transformer" else None
        if kind == "Transformer":
            cfg = {"path": rel} if rel else {}
        modules.append(StModule(kind, source.path / rel, cfg if isinstance(cfg, dict) else {}))
    _check_order(modules, where)
    return modules


def _check_order(modules: list[StModule], where: str) -> None:
    kinds = [m.kind for m in modules]
    if not kinds or kinds[0] != "Transformer" or "Transformer" in kinds[1:]:
        raise ModelLoadError(f"{where}: WDE runs pipelines that start with one Transformer module; this one is {kinds}")
    if modules[0].config.get("path"):
        raise ModelLoadError(f"{where}: the Transformer module lives in {modules[0].config['path']!r}; WDE loads"
                             " the model from the folder itself (point --model at that subfolder)")
    rest = kinds[1:]
    if "Pooling" in rest:
        if rest.index("Pooling") != 0 or rest.count("Pooling") > 1:
            raise ModelLoadError(f"{where}: WDE runs one Pooling module right after the Transformer; this pipeline is {kinds}")
        rest = rest[1:]
    elif rest:
        raise ModelLoadError(f"{where}: modules {rest} follow the Transformer without a Pooling module; WDE cannot"
                             " run them on token embeddings")
    for m in modules[2:]:
        name_in, name_out = m.config.get("module_input_name"), m.config.get("module_output_name")
        for name in (name_in, name_out):
            if name not in (None, "sentence_embedding"):
                raise ModelLoadError(f"{m.path / 'config.json'}: {m.kind} reads or writes {name!r}; WDE runs"
                                     " modules after pooling on 'sentence_embedding' only")


def transformer_config(source: "ModelSource") -> dict[str, Any]:
    """The Transformer module's settings (`sentence_bert_config.json`), checked for ones WDE does not implement."""
    cfg = source.read_json("sentence_bert_config.json") or {}
    if cfg.get("do_lower_case"):
        raise ModelLoadError(f"{source.path / 'sentence_bert_config.json'}: do_lower_case is true (the text is"
                             " lower-cased before tokenizing), which WDE does not implement")
    return cfg


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    st = folder / "model.safetensors"
    if st.exists():
        from safetensors.torch import load_file

        try:
            return load_file(str(st), device="cpu")
        except Exception as e:  # noqa: BLE001 - any unreadable file is one start-up error
            raise ModelLoadError(f"cannot read {st}: {e}") from None
    binary = folder / "pytorch_model.bin"
    if binary.exists():
        try:
            return torch.load(str(binary), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"cannot read {binary}: {e}") from None
    raise ModelLoadError(f"{folder}: no weights (model.safetensors or pytorch_model.bin)")


def activation(name: str | None, where: str) -> nn.Module:
    """A Dense module's activation from its dotted class name, as sentence-transformers resolves it without
    remote code: a `torch.*` class that is an `nn.Module`, built with no arguments (Tanh by default)."""
    if name is None:
        return nn.Tanh()
    module, _, cls_name = name.rpartition(".")
    cls = None
    if name.startswith("torch.") and module:
        try:
            cls = getattr(importlib.import_module(module), cls_name, None)
        except ImportError:
            cls = None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ModelLoadError(f"{where}: activation_function {name!r} is not a torch.nn module class; WDE (like"
                             " sentence-transformers without trust_remote_code) runs only those")
    try:
        return cls()
    except TypeError as e:
        raise ModelLoadError(f"{where}: activation_function {name!r} cannot be built without arguments: {e}") from None


def _dense(m: StModule, width: int) -> _Dense:
    where = str(m.path / "config.json")
    cfg = m.config
    try:
        n_in, n_out = int(cfg["in_features"]), int(cfg["out_features"])
    except (KeyError, TypeError, ValueError):
        raise ModelLoadError(f"{where}: a Dense module needs integer in_features and out_features") from None
    if n_in != width:
        raise ModelLoadError(f"{where}: Dense takes {n_in} features but {width} reach it")
    unknown = set(cfg) - {"in_features", "out_features", "bias", "activation_function", "module_input_name",
                          "module_output_name", "use_residual"}
    if unknown:
        raise ModelLoadError(f"{where}: Dense settings {sorted(unknown)} are not implemented by WDE")
    bias, residual = bool(cfg.get("bias", True)), bool(cfg.get("use_residual", False))
    layer = _Dense(n_in, n_out, bias, activation(cfg.get("activation_function"), where), residual)
    _load(layer, _weights(m.path), m.path)
    return layer


class _Dense(nn.Module):
    """sentence-transformers' Dense: activation(linear(x)) [+ x, or + residual(x) when the widths differ]."""

    def __init__(self, n_in: int, n_out: int, bias: bool, act: nn.Module, use_residual: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_out, bias=bias)
        self.act = act
        self.use_residual = use_residual
        if use_residual and n_in != n_out:
            self.residual = nn.Linear(n_in, n_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act(self.linear(x))
        if self.use_residual:
            out = out + (self.residual(x) if hasattr(self, "residual") else x)
        return out


class _L2Normalize(nn.Module):
    """A Normalize module in the middle of the pipeline (one at the end is the pooler's `normalize`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return l2_normalize(x)


def _load(module: "nn.Module", state: dict[str, torch.Tensor], folder: Path) -> None:
    own = dict(module.state_dict())
    missing = sorted(set(own) - set(state))
    unused = sorted(set(state) - set(own))
    if missing or unused:
        raise ModelLoadError(f"{folder}: weights do not fit the module: missing {missing or 'none'},"
                             f" unused {unused or 'none'}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ModelLoadError(f"{folder}: {name} has shape {tuple(tensor.shape)}, the config says {tuple(own[name].shape)}")
    module.load_state_dict(state)


def _layer_norm(m: StModule) -> nn.LayerNorm:
    try:
        dim = int(m.config["dimension"])
    except (KeyError, TypeError, ValueError):
        raise ModelLoadError(f"{m.path / 'config.json'}: a LayerNorm module needs an integer dimension") from None
    holder = nn.Module()
    holder.norm = nn.LayerNorm(dim)  # sentence-transformers' default eps (1e-5), as its LayerNorm module uses
    _load(holder, _weights(m.path), m.path)
    return holder.norm


def after_pooling(modules: list[StModule], width: int) -> tuple["nn.Module | None", int, bool]:
    """The modules after Pooling as one `nn.Sequential` in float32 (None when there are none but a final
    Normalize), the output width, and whether the pipeline ends in Normalize (left to the pooler, so a request's
    `dimensions` and `normalize` apply the way they do for every model).

    `width` is the pooled width; each module's declared input width is checked against what reaches it.
    """
    tail = [m for m in modules if m.kind in AFTER_POOLING]
    normalize_last = bool(tail) and tail[-1].kind == "Normalize"
    if normalize_last:
        tail = tail[:-1]
    layers: list[nn.Module] = []
    for m in tail:
        if m.kind == "Dense":
            layer = _dense(m, width)
            width = layer.linear.out_features
        elif m.kind == "LayerNorm":
            layer = _layer_norm(m)
            if layer.normalized_shape[0] != width:
                raise ModelLoadError(f"{m.path / 'config.json'}: LayerNorm of {layer.normalized_shape[0]} features but"
                                     f" {width} reach it")
        elif m.kind == "Normalize":
            layer = _L2Normalize()
        else:  # Dropout: the identity at inference
            continue
        layers.append(layer)
    head = nn.Sequential(*layers).to(torch.float32).eval() if layers else None
    return head, width, normalize_last
