"""What a model component is: an `nn.Module` over packed tokens that loads its own checkpoint."""

from __future__ import annotations

import contextlib
from typing import ClassVar, Iterator, Literal

import torch
from torch import nn

from wde.components.attention.base import AttentionBackend
from wde.components.base import BuildContext, Component, Params
from wde.components.model_input_builder import ModelInput
from wde.components.models.cpu_linear import CpuLinear, pack_linears, resolve_cpu_linear
from wde.components.models.loader import load_weights
from wde.device import default_device, suggest_cpu_bf16
from wde.errors import ModelLoadError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelParams(Params):
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """auto: float16 on CUDA, float32 on CPU."""
    device: str = "auto"
    """auto: cuda when available, else cpu; or any torch device string."""
    cpu_linear: CpuLinear = "auto"
    """On CPU: linear layers through PyTorch (MKL) or oneDNN with prepacked weights; auto: oneDNN for float32 on
    AVX-512 hosts (about twice as fast) and for bfloat16 on native-bf16 hosts (wde/components/models/cpu_linear.py)."""


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return default_device()
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class PrefillModel(nn.Module, Component):
    """A model over packed tokens. Subclasses build their layers in `build(config)` and implement `forward`.

    Class attributes describe the checkpoint so the loader stays generic (nano-vllm's habit):
    `checkpoint_prefixes` are stripped from checkpoint names, `packed_modules_mapping` maps separate
    checkpoint projections (q, k, v) onto one fused parameter and its shard, and `default_causal` is the
    attention mask the family uses when neither the workflow nor the config says otherwise.
    """

    kind = "model"
    Params: ClassVar[type[Params]] = ModelParams
    checkpoint_prefixes: ClassVar[tuple[str, ...]] = ()
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {}
    default_causal: ClassVar[bool] = False

    def __init__(self, params: ModelParams, ctx: BuildContext) -> None:
        nn.Module.__init__(self)
        self.params = params
        self.config = ctx.source.hf_config
        self.device = resolve_device(params.device)
        self.dtype = resolve_dtype(params.dtype, self.device)
        if params.dtype == "auto":  # an explicit float32 is the user's choice: no hint then
            suggest_cpu_bf16(self.device, self.dtype)
        self.attn_backend: AttentionBackend = ctx.attention
        self.causal = self.attn_backend.resolve_causal(self.default_causal)
        with torch.device(self.device), _default_dtype(self.dtype):
            self.build(self.config)
        self.eval()
        try:
            load_weights(self, ctx.source.iter_weights(), self.checkpoint_prefixes, self.packed_modules_mapping)
        except ModelLoadError as e:
            raise ModelLoadError(f"{type(self).__name__} cannot load {ctx.source.path}: {e}") from None
        self.linear_backend = resolve_cpu_linear(params.cpu_linear, self.device, self.dtype)
        """"torch" or "onednn": the path this model's linear layers take."""
        if self.linear_backend == "onednn":
            scheduler = ctx.components.get("scheduler")
            pack_linears(self, int(getattr(scheduler, "token_budget", 2048)))

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def build(self, config: object) -> None:
        raise NotImplementedError

    def forward(self, batch: ModelInput) -> torch.Tensor:
        """Hidden states of the last layer, packed: [tokens, hidden]."""
        raise NotImplementedError
