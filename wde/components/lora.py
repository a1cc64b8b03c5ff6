"""LoRA adapters chosen per request and mixed in one batch: `y = W x + scale * B_a (A_a x)` over packed tokens.

How a batch gets its adapters: each request names one with a per-request option (`adapter` for PEFT folders, or
a model's own, e.g. Jina v3's `task`); the model input builder packs each token's adapter slot into
`ModelInput.adapter_ids` (0: none) from an `AdapterTable` the model hands it; at the start of each forward the
model groups the tokens by slot once (`LoraGroups`), and every `LoraLinear` adds, for each adapter present, its
delta to that adapter's tokens (a gather, two small GEMMs and a scatter-add: one loop over the adapters in the
batch, never over tokens or sequences, and one forward for the whole batch).

The linear layers are wrapped between loading and packing (`PrefillModel.before_packing`), so oneDNN packs the
base weight inside the wrapper and never fuses an activation into a wrapped layer: the delta always lands before
the activation. A fused projection (q|k|v, gate|up) gets one combined A (the shards' A stacked) and a B with each
shard's B in its own rows and columns, so one wrapper serves every shard.

The groups reach the linear layers through a context variable set by the model's own forward on the thread that
runs it (CPU streams run each piece of a batch as a whole forward on its own thread), because every model calls its
linear layers as `linear(x)`.
"""

from __future__ import annotations

import contextvars
import json
import math
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn

from wde.components.models.loader import checkpoint_target
from wde.components.models.mixed_precision import CastLinear
from wde.errors import ModelLoadError, RequestError

if TYPE_CHECKING:
    from wde.components.models.base import PrefillModel
    from wde.request import PoolingParams

ADAPTER_OPTION = "adapter"
"""The per-request option naming a PEFT adapter loaded from a folder."""
NO_ADAPTER = "none"
"""The option's value (and default) for the base model."""

_PEFT_PREFIX = "base_model.model."
_HARMLESS = frozenset({
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "r", "target_modules", "exclude_modules", "lora_alpha", "lora_dropout", "init_lora_weights",
    "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern", "use_rslora", "megatron_core",
    "loftq_config", "eva_config", "corda_config", "lora_ga_config", "qalora_group_size", "ensure_weight_tying",
})
"""adapter_config.json keys that do not change what a loaded adapter computes at inference (or that WDE computes
exactly: `use_rslora`, `rank_pattern`, `alpha_pattern`); every other key must be unset (null, false, empty)."""
_FACTORS = ((".lora_A.weight", "lora_A"), (".lora_B.weight", "lora_B"),
            (".lora_embedding_A", "lora_A"), (".lora_embedding_B", "lora_B"))
"""PEFT's tensor names for the factors of a linear layer and of an embedding (A [r, in or vocab], B [out, r])."""


@dataclass(frozen=True)
class LoraGroups:
    """A batch's tokens grouped by adapter slot: (slot, token indices or None for every token), slot 0 left out."""

    groups: tuple[tuple[int, torch.Tensor | None], ...]

    @classmethod
    def of(cls, adapter_ids: torch.Tensor | None) -> "LoraGroups | None":
        if adapter_ids is None:
            return None
        slots = [s for s in torch.unique(adapter_ids).tolist() if s != 0]
        if not slots:
            return None
        if len(slots) == 1 and bool((adapter_ids == slots[0]).all()):
            return cls(((slots[0], None),))
        return cls(tuple((s, (adapter_ids == s).nonzero().flatten()) for s in slots))


_GROUPS: contextvars.ContextVar[LoraGroups | None] = contextvars.ContextVar("wde_lora_groups", default=None)


class LoraLinear(nn.Module):
    """A linear layer (`base`: `nn.Linear`, `CastLinear`, or after packing oneDNN's `PackedLinear`) plus the deltas
    of the adapters loaded into it, by slot: `adapters[slot] = (A [R, in], B [out, R])` with the scale in B."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        weight = base.weight
        self.shards: dict[int | None, tuple[int, int]] = dict(getattr(weight, "shard_offsets", None)
                                                              or {None: (0, self.out_features)})
        """Shard id → (first output row, rows) of a fused projection; {None: all rows} for a plain one."""
        self.dtype = weight.dtype
        self.device = weight.device
        self.adapters: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        groups = _GROUPS.get()
        if groups is None or not self.adapters:
            return y
        for slot, index in groups.groups:  # `y` is this call's own output: added to in place
            weights = self.adapters.get(slot)
            if weights is None:
                continue
            a, b = weights
            if index is None:
                h = x.to(a.dtype) @ a.T
                if y.dtype == b.dtype:
                    y.addmm_(h, b.T)
                else:
                    y += (h @ b.T).to(y.dtype)
            else:
                y.index_add_(0, index, ((x.index_select(0, index).to(a.dtype) @ a.T) @ b.T).to(y.dtype))
        return y

    def extra_repr(self) -> str:
        return f"adapters={sorted(self.adapters)}"


class LoraEmbedding(nn.Module):
    """A token embedding (`base`) plus its adapters' deltas by slot: `adapters[slot] = (A^T [vocab, R], B [dim, R])`
    with the scale in B; a token's delta is row `id` of A^T times B^T (PEFT's embedding LoRA)."""

    def __init__(self, base: nn.Embedding) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.num_embeddings, base.embedding_dim
        self.shards: dict[int | None, tuple[int, int]] = {None: (0, self.out_features)}
        self.dtype, self.device = base.weight.dtype, base.weight.device
        self.adapters: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y = self.base(ids)
        groups = _GROUPS.get()
        if groups is None or not self.adapters:
            return y
        for slot, index in groups.groups:
            weights = self.adapters.get(slot)
            if weights is None:
                continue
            a_t, b = weights
            if index is None:
                y += (nn.functional.embedding(ids, a_t) @ b.T).to(y.dtype)
            else:
                y.index_add_(0, index, (nn.functional.embedding(ids.index_select(0, index), a_t) @ b.T).to(y.dtype))
        return y


def wrap_linears(model: nn.Module, embeddings: tuple[str, ...] = ()) -> int:
    """Wrap every `nn.Linear` / `CastLinear` under `model` in a `LoraLinear` (before packing), and the `nn.Embedding`
    modules named in `embeddings` in a `LoraEmbedding`; returns how many."""
    count = 0
    for name in embeddings:
        try:
            child = model.get_submodule(name)
        except AttributeError:  # a subclass without this embedding: nothing to wrap
            continue
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if isinstance(child, nn.Embedding):
            setattr(owner, attr, LoraEmbedding(child))
            count += 1
    for module in list(model.modules()):
        if isinstance(module, (LoraLinear, LoraEmbedding)):
            continue
        for name, child in list(module.named_children()):
            if type(child) in (nn.Linear, CastLinear):
                setattr(module, name, LoraLinear(child))
                count += 1
    return count


@dataclass
class AdapterTable:
    """Which value of a per-request option selects which adapter slot (0: the base model, `default`). Slots are
    never reused, so a batch packed before an adapter was unloaded cannot run with another adapter's weights."""

    option: str
    default: str
    max_adapters: int
    slots: dict[str, int] = field(default_factory=dict)
    _next: int = 1

    def values(self) -> tuple[str, ...]:
        return (self.default, *self.slots)

    def slot_of(self, params: "PoolingParams") -> int:
        value = params.option(self.option, self.default)
        if value == self.default:
            return 0
        slot = self.slots.get(value)
        if slot is None:
            raise RequestError(f"{self.option} {value!r} is not loaded; loaded: {', '.join(self.values())}",
                               f"options.{self.option}")
        return slot

    def reserve(self, name: str) -> int:
        """A new slot for adapter `name` (published by `slots[name] = slot` once its weights are in place)."""
        if name == self.default or name in self.slots:
            what = "the base model" if name == self.default else "loaded"
            raise ModelLoadError(f"{self.option} {name!r} is already {what}")
        if len(self.slots) >= self.max_adapters:
            raise ModelLoadError(f"{len(self.slots)} adapters are loaded, the most allowed (lora.max_adapters ="
                                 f" {self.max_adapters}); unload one first")
        slot, self._next = self._next, self._next + 1
        return slot


class LoraSet:
    """A model's adapters: its wrapped layers by name, the table of loaded adapters, and the forward hooks that
    group each batch's tokens by adapter. Made by `PrefillModel.use_lora` (from `before_packing`).

    Adapters may be added and removed while batches run (`wde serve`'s load/unload routes): an adapter's weights are
    in every layer before its name is published, and an unloaded adapter's weights are dropped only when no forward
    is running; a batch packed with an adapter that was unloaded since fails (its requests then fail alone, naming
    it) instead of running without it."""

    def __init__(self, model: "PrefillModel", option: str = ADAPTER_OPTION, default: str = NO_ADAPTER,
                 max_adapters: int = 8) -> None:
        self.model = model
        wrap_linears(model, model.lora_embedding_modules)
        self.linears: dict[str, LoraLinear | LoraEmbedding] = {
            n: m for n, m in model.named_modules() if isinstance(m, (LoraLinear, LoraEmbedding))}
        """The layers that take adapters, by module name: every linear layer and the token embeddings."""
        self.table = AdapterTable(option, default, max_adapters)
        self._lock = threading.Lock()
        self._running = 0
        self._retired: set[int] = set()
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._leave, always_call=True)

    def request_options(self) -> dict[str, tuple[str, ...]]:
        return {self.table.option: self.table.values()}

    def add(self, name: str, deltas: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Load adapter `name`: module name (a `LoraLinear` or `LoraEmbedding` of the model) → (A [R, in],
        B [out, R]), scale in B (for an embedding, `in` is the vocabulary)."""
        for module, (a, b) in deltas.items():
            linear = self.linears.get(module)
            if linear is None:
                raise ModelLoadError(f"adapter {name!r}: the model has no layer {module!r} that takes adapters")
            if a.shape[1] != linear.in_features or b.shape != (linear.out_features, a.shape[0]):
                raise ModelLoadError(f"adapter {name!r}: {module} takes A [R, {linear.in_features}] and B"
                                     f" [{linear.out_features}, R], got {tuple(a.shape)} and {tuple(b.shape)}")
        with self._lock:
            slot = self.table.reserve(name)
        for module, (a, b) in deltas.items():
            linear = self.linears[module]
            a = a.T if isinstance(linear, LoraEmbedding) else a  # looked up by token id: [vocab, R]
            linear.adapters[slot] = (a.to(linear.device, linear.dtype).contiguous(),
                                     b.to(linear.device, linear.dtype).contiguous())
        with self._lock:
            if len(self.table.slots) >= self.table.max_adapters or name in self.table.slots:  # a concurrent add won
                self._drop({slot})
                self.table.reserve(name)  # raises the error naming why
            self.table.slots[name] = slot

    def remove(self, name: str) -> None:
        """Unload adapter `name`: new requests naming it are refused at once; its weights go once no batch runs."""
        with self._lock:
            slot = self.table.slots.pop(name, None)
            if slot is None:
                loaded = ", ".join(self.table.slots) or "none"
                raise ModelLoadError(f"{self.table.option} {name!r} is not loaded; loaded: {loaded}")
            self._retired.add(slot)
            if self._running == 0:
                self._drop(self._retired)

    def load_peft(self, name: str, path: str | Path) -> None:
        """Load the PEFT LoRA folder `path` as adapter `name`."""
        self.add(name, read_peft_adapter(path, self.model, set(self.linears)))

    def _drop(self, slots: set[int]) -> None:
        for linear in self.linears.values():
            for slot in slots:
                linear.adapters.pop(slot, None)
        slots.clear()

    def _enter(self, model: nn.Module, args: tuple[Any, ...]) -> None:
        groups = LoraGroups.of(getattr(args[0], "adapter_ids", None)) if args else None
        with self._lock:
            self._running += 1  # before any raise: `_leave` always runs
            live = set(self.table.slots.values())
            gone = [slot for slot, _ in (groups.groups if groups else ()) if slot not in live]
        _GROUPS.set(None)
        if gone:
            raise RuntimeError(f"the batch names {self.table.option} slots {gone}, unloaded since it was packed")
        _GROUPS.set(groups)

    def _leave(self, model: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        _GROUPS.set(None)
        with self._lock:
            self._running -= 1
            if self._running == 0 and self._retired:
                self._drop(self._retired)


def check_adapter_config(config: Mapping[str, Any], where: str) -> None:
    """Refuse an adapter_config.json WDE would not compute exactly, naming the setting."""
    if config.get("peft_type") != "LORA":
        raise ModelLoadError(f"{where}: peft_type {config.get('peft_type')!r} is not supported; only LORA adapters are")
    if config.get("bias", "none") != "none":
        raise ModelLoadError(f"{where}: bias={config['bias']!r} is not supported (trained biases); only bias='none'")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(("pissa", "olora", "corda", "loftq")):
        raise ModelLoadError(f"{where}: init_lora_weights={init!r} adapters are saved against a changed base model"
                             " (its residual); save them converted to plain LoRA (peft's"
                             " path_initial_model_for_weight_conversion) to serve them on the original base")
    if config.get("use_rslora") and (config.get("rank_pattern") or config.get("alpha_pattern")):
        raise ModelLoadError(f"{where}: use_rslora with rank_pattern or alpha_pattern is not supported")
    for key, value in config.items():
        if key not in _HARMLESS and key != "bias" and value not in (None, False, {}, [], ""):
            raise ModelLoadError(f"{where}: {key}={json.dumps(value, default=str)} is not supported by WDE's LoRA"
                                 " (it applies plain LoRA, rsLoRA and rank/alpha patterns only)")


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's `get_pattern_key`: the first pattern matching the end of `module` at a dot boundary."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key]
    return default


def read_peft_adapter(path: str | Path, model: "PrefillModel",
                      linears: set[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A PEFT LoRA folder's deltas as `LoraSet.add` takes them: each checkpoint module mapped onto the model's layer
    (and shard) the way its base weight loads (`checkpoint_target`), the scale folded into B."""
    from safetensors.torch import load_file

    folder = Path(path)
    where = f"LoRA adapter {folder}"
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for f in (config_file, weights_file):
        if not f.is_file():
            raise ModelLoadError(f"{where}: no {f.name} (a PEFT adapter folder has adapter_config.json and"
                                 " adapter_model.safetensors)")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as e:
        raise ModelLoadError(f"{where}: adapter_config.json is not JSON ({e})") from None
    check_adapter_config(config, where)
    tensors = load_file(str(weights_file))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    saved_bases: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(_PEFT_PREFIX)
        if name.endswith(".base_layer.weight"):  # PEFT saves a targeted embedding's own weight (save_embedding_layers)
            saved_bases[name.removesuffix(".base_layer.weight")] = tensor
            continue
        for suffix, part in _FACTORS:
            if name.endswith(suffix):
                pairs.setdefault(name[: -len(suffix)], {})[part] = tensor
                break
        else:
            raise ModelLoadError(f"{where}: tensor {key!r} is not a LoRA A or B factor (DoRA magnitudes, LoRA biases"
                                 " and saved modules are not supported)")
    skipped = set(model.lora_skipped_modules)
    merged: dict[str, list[tuple[int | None, torch.Tensor, torch.Tensor, float]]] = {}
    for module, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise ModelLoadError(f"{where}: module {module!r} has {sorted(pair)} only")
        if module in skipped:
            continue
        a, b = pair["lora_A"].float(), pair["lora_B"].float()
        r = _pattern_value(config.get("rank_pattern") or {}, module, config.get("r"))
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] != r:
            raise ModelLoadError(f"{where}: module {module!r} has A {tuple(a.shape)} and B {tuple(b.shape)}, not"
                                 f" rank {r} linear factors")
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        target, shard = checkpoint_target(f"{module}.weight", model.checkpoint_prefixes, model.packed_modules_mapping,
                                          model.checkpoint_name_mapping)
        layer = target.removesuffix(".weight")
        if layer not in linears:
            raise ModelLoadError(f"{where}: target module {module!r} (as {layer!r}) is not a layer of model"
                                 f" {model.name!r} that takes adapters (its linear layers and token embeddings)")
        merged.setdefault(layer, []).append((shard, a, b, scale))
    if not merged:
        raise ModelLoadError(f"{where}: no LoRA weights for any layer of model {model.name!r}")
    linear_modules = dict(model.named_modules())
    for module, saved in saved_bases.items():
        _check_saved_base(module, saved, model, linear_modules, where)
    return {layer: _combine(linear_modules[layer], parts, where) for layer, parts in merged.items()}


def _check_saved_base(module: str, saved: torch.Tensor, model: "PrefillModel", modules: Mapping[str, nn.Module],
                      where: str) -> None:
    """Accept a base weight an adapter folder carries only where it is the model's own (PEFT saves a targeted
    embedding whole): a different one (a resized or retrained embedding) would replace the base and is refused."""
    target, _ = checkpoint_target(f"{module}.weight", model.checkpoint_prefixes, model.packed_modules_mapping,
                                  model.checkpoint_name_mapping)
    layer = modules.get(target.removesuffix(".weight"))
    own = getattr(getattr(layer, "base", None), "weight", None)
    if not isinstance(own, torch.Tensor) or own.shape != saved.shape or not torch.allclose(
            own.detach().float().cpu(), saved.float(), rtol=0, atol=1e-6 if own.dtype == torch.float32 else 1e-2):
        raise ModelLoadError(f"{where}: it carries its own weights for {module!r} (base_layer.weight), which differ"
                             " from the model's; adapters that replace base weights are not supported")


def _combine(linear: LoraLinear, parts: list[tuple[int | None, torch.Tensor, torch.Tensor, float]],
             where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One (A, B) for a layer from its shards' factors: A stacked, each scaled B in its shard's rows."""
    rank = sum(a.shape[0] for _, a, _, _ in parts)
    a_all = torch.cat([a for _, a, _, _ in parts])
    b_all = torch.zeros(linear.out_features, rank)
    col = 0
    for shard, a, b, scale in parts:
        if shard is None:
            start, size = 0, linear.out_features  # the whole layer (a checkpoint tensor that loads whole)
        elif shard not in linear.shards:
            shards = sorted(linear.shards, key=str)
            raise ModelLoadError(f"{where}: shard {shard} does not exist in a layer with shards {shards}")
        else:
            start, size = linear.shards[shard]
        if b.shape[0] != size:
            raise ModelLoadError(f"{where}: B has {b.shape[0]} rows, the layer's shard {shard} has {size}")
        b_all[start:start + size, col:col + a.shape[0]] = b * scale
        col += a.shape[0]
    return a_all, b_all
