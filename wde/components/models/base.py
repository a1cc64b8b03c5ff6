"""What a model component is: an `nn.Module` over packed tokens that loads its own checkpoint."""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar, Iterator, Mapping

import torch
from torch import nn

from wde.components.attention.base import AttentionBackend, AttentionMetadata, Window
from wde.components.base import BuildContext, Params as ComponentParams
from wde.components.kinds import Model
from wde.components.lora import ADAPTER_OPTION, NO_ADAPTER, LoraSet
from wde.components.model_input_builder import ModelInput
from wde.components.models.cpu_linear import pack_linears, resolve_cpu_linear
from wde.components.models.loader import load_weights
from wde.components.models.cpu_kernels import Float32Attention, attention_dtype, linear_dtype
from wde.components.models.mixed_precision import cast_linears, float32_outside_linears, resolve_mixed_precision
from wde.components.params import ModelParams  # torch-free, so validating a workflow needs no torch
from wde.device import default_device, suggest_cpu_bf16, warn_emulated_cpu_bf16
from wde.errors import ModelLoadError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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


def _cast_output(model: "PrefillModel", args: object, hidden: torch.Tensor) -> torch.Tensor:
    return hidden.to(model.dtype)


def check_model_type(model: Any, ctx: BuildContext) -> None:
    """Refuse a folder whose config `model_type` is not one of `model.model_types` (the families a class serves)."""
    model_type = getattr(ctx.source.hf_config, "model_type", None)
    if model_type not in model.model_types:
        served = " or ".join(repr(t) for t in model.model_types)
        raise ModelLoadError(f"model {model.name!r} serves config model_type {served}; {ctx.source.path} is"
                             f" {model_type!r}")


class PrefillModel(nn.Module, Model):
    """A model over packed tokens. Subclasses build their layers in `build(config)` and implement `forward`.

    Class attributes describe the checkpoint so the loader stays generic (nano-vllm's habit):
    `checkpoint_prefixes` are stripped from checkpoint names, `checkpoint_name_mapping` renames dotted name
    parts (applied in order, e.g. `{"block": "encoder.layer"}`), `packed_modules_mapping` maps separate
    checkpoint projections (q, k, v) onto one fused parameter and its shard, and `default_causal` is the
    attention mask the family uses when neither the workflow nor the config says otherwise.
    `uses_attention_bias` says the model passes an additive bias to its attention backend, so the model refuses
    to build with a backend that lacks `supports_bias`; `uses_attention_window` likewise for local attention
    windows and `supports_window`. `model_types`, when set, are the config `model_type`s the class serves: any
    other folder is refused by name before anything reads its config.

    Set before `build` runs: `config` (the Hugging Face config), `device`, `dtype`, `causal`, `attn_backend`,
    `mixed_precision` (then everything but the `nn.Linear` layers is moved to float32 before loading).
    """

    kind = "model"
    Params: ClassVar[type[Params]] = ModelParams
    checkpoint_prefixes: ClassVar[tuple[str, ...]] = ()
    checkpoint_name_mapping: ClassVar[Mapping[str, str]] = {}
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {}
    default_causal: ClassVar[bool] = False
    uses_attention_bias: ClassVar[bool] = False
    uses_attention_window: ClassVar[bool] = False
    pools: ClassVar[bool] = False
    """True for a model whose `forward` returns one pooled embedding per sequence ([num_seqs, dim]) instead of token
    states, with its width as `embedding_size` (two-tower CLIP / SigLIP; the `projected` pooler takes it)."""
    uses_cpu_ops: ClassVar[bool] = False
    """True for a model whose forward calls the host-compiled CPU kernels of `wde.kernels.cpp_build.cpu_ops` (the
    post-norm blocks' `add_layer_norm`): on CPU they are built (or loaded from the cache) at load, so that no batch
    waits ~25 s for a first compile (`cpu_kernels` names them, so the engine starts that build first thing); other
    models never compile them (int8 does, at its gate)."""
    lora_skipped_modules: ClassVar[tuple[str, ...]] = ()
    """Checkpoint module names (as a PEFT adapter names them) whose LoRA weights are skipped: layers of the
    reference model that no output of this model reads (BERT's pooler); any other layer the model lacks is refused."""
    lora_embedding_modules: ClassVar[tuple[str, ...]] = ()
    """The token embedding modules that take LoRA adapters (PEFT's embedding LoRA), e.g. BERT's
    `embeddings.word_embeddings`; any other embedding an adapter targets is refused."""
    model_types: ClassVar[tuple[str, ...]] = ()
    """Config `model_type`s this class serves (checked first, by `check_model_type`); empty: not checked."""

    def __init__(self, params: ModelParams, ctx: BuildContext) -> None:
        if self.model_types:
            check_model_type(self, ctx)
        self.read_config(ctx)
        nn.Module.__init__(self)
        self.params = params
        self.config = ctx.source.hf_config
        self.device = resolve_device(params.device)
        self.dtype = resolve_dtype(params.dtype, self.device)
        if params.dtype == "auto":  # an explicit float32 is the user's choice: no hint then
            suggest_cpu_bf16(self.device, self.dtype)
        warn_emulated_cpu_bf16(self.device, self.dtype)
        self.attn_backend: AttentionBackend = ctx.attention
        if self.uses_attention_bias and not self.attn_backend.supports_bias:
            raise ModelLoadError(
                f"model {self.name!r} adds an attention bias, which attention {self.attn_backend.name!r} does not"
                " support; use attention: {name: torch_sdpa} or {name: triton_varlen}")
        if self.uses_attention_window and not self.attn_backend.supports_window:
            raise ModelLoadError(
                f"model {self.name!r} uses local (windowed) attention, which attention {self.attn_backend.name!r}"
                " does not support; use attention: {name: auto}, torch_sdpa, cpu_varlen or triton_varlen")
        self.causal = self.attn_backend.resolve_causal(self.default_causal)
        self.mixed_precision = resolve_mixed_precision(params.mixed_precision, self.device, self.dtype)
        """Linear layers in `dtype`, everything else in float32 (wde/components/models/mixed_precision.py)."""
        self.linear_dtype = self.dtype
        """The dtype the linear layers run in: `dtype`, or float32 in mixed precision where this CPU runs float32
        faster (wde/components/models/cpu_kernels.py)."""
        self.attention_dtype = self.dtype
        if self.mixed_precision:
            self.attention_dtype = self._mixed_attention_dtype(params)
            if self.attention_dtype == torch.float32:
                self.attn_backend = Float32Attention(self.attn_backend)  # type: ignore[assignment]
        self._check_position_table(ctx)
        with torch.device(self.device), _default_dtype(self.dtype):
            self.build(self.config)
        if self.mixed_precision:
            self.linear_dtype = linear_dtype(params.mixed_precision_kernels, self, self.dtype)
            if self.linear_dtype == torch.float32:
                self.float()  # a float32 model that hands `dtype` to its pooler; weights load as float32
            else:
                float32_outside_linears(self)  # embeddings and norms load as float32
        self.eval()
        try:
            load_weights(self, ctx.source.iter_weights(), self.checkpoint_prefixes, self.packed_modules_mapping,
                         self.checkpoint_name_mapping)
        except ModelLoadError as e:
            raise ModelLoadError(f"{type(self).__name__} cannot load {ctx.source.path}: {e}") from None
        if self.mixed_precision:
            cast_linears(self, self.linear_dtype)  # inputs cast to the linear dtype, whatever a model hands them
            self.register_forward_hook(_cast_output)  # poolers and heads get `dtype`, as from a pure model
        self.lora: LoraSet | None = None
        """The model's LoRA adapters (wde/components/lora.py), when it takes any."""
        self.before_packing(ctx)
        self.quantization = self._quantize(params, ctx) if isinstance(params, ModelParams) else "none"
        """"none" or "int8": whether the blocks' linear layers run in int8 (wde/components/models/int8_linear.py)."""
        self.linear_backend = resolve_cpu_linear(params.cpu_linear, self.device, self.linear_dtype)
        """"torch" or "onednn": the path this model's linear layers take."""
        if self.linear_backend == "onednn":
            pack_linears(self, ctx.scheduler.token_budget)
        if self.device.type == "cpu" and self.uses_cpu_ops:  # now: a first build inside a batch would hold it
            from wde.kernels.cpp_build import cpu_ops

            cpu_ops()

    @classmethod
    def cpu_kernels(cls, params: ComponentParams) -> tuple[str, ...]:
        int8 = isinstance(params, ModelParams) and params.quantization == "int8"
        return ("cpu_ops",) if cls.uses_cpu_ops or int8 else ()

    def _quantize(self, params: ModelParams, ctx: BuildContext) -> str:
        """Quantize the blocks' linear layers to int8 behind the fidelity gate (`quantization: int8`), or refuse by
        name what int8 does not cover; the float layers left are packed as usual afterwards."""
        if params.quantization == "none":
            return "none"
        from wde.components.models.int8_gate import run_gate
        from wde.components.models import int8_linear
        from wde.components.models.int8_linear import block_linears, int8_unsupported

        if self.device.type != "cpu" or self.dtype != torch.float32:
            raise ModelLoadError(f"quantization=int8 runs on CPU from a float32 model; this one is {self.dtype} on"
                                 f" {self.device} (set model.params.dtype: float32 and device: cpu)")
        if self.lora is not None:
            raise ModelLoadError("quantization=int8 does not combine with LoRA adapters (model.params.lora);"
                                 " use one or the other")
        unsupported = int8_unsupported()
        if unsupported is not None:
            raise ModelLoadError(f"quantization=int8: {unsupported}; use quantization: none")
        if (note := int8_linear.fallback_note()) is not None:
            int8_linear.log.warning(note)
        if not block_linears(self):
            raise ModelLoadError(f"quantization=int8: model {self.name!r} has no linear layers in repeated blocks")
        # attention's products in bf16 where bf16 is native; the gate measures them (and keys its verdict on them)
        bf16_attention = int8_linear.bf16_pays() and self.attn_backend.use_bf16_products()
        run_gate(self, ctx.tokenizer, ctx.source.path, ctx.scheduler.token_budget, params.min_cosine,
                 params.min_mean_cosine, params.calibration, pools=self.pools,
                 variant=f"attention bf16 products {bf16_attention}, bf16 q/k/v", attention=self.attn_backend)
        return "int8"

    def before_packing(self, ctx: BuildContext) -> None:
        """Runs once the checkpoint is loaded (and, in mixed precision, the linear layers cast), before the CPU
        packs the linear layers for oneDNN and fuses activations into them: the place to rewrite modules or
        weights, e.g. wrap linear layers (a wrapped layer is packed inside its wrapper and never fused with the
        activation after it). The default sets up the LoRA adapters of `params.lora` (`use_lora`); a subclass that
        overrides it calls `super().before_packing(ctx)`."""
        lora = self.params.lora if isinstance(self.params, ModelParams) else None
        if lora is not None and (lora.modules or lora.enable):
            self.use_lora(ctx, max_adapters=lora.max_adapters)
            for name, path in lora.modules.items():
                self.lora.load_peft(name, path)  # type: ignore[union-attr]

    def use_lora(self, ctx: BuildContext, option: str = ADAPTER_OPTION, default: str = NO_ADAPTER,
                 max_adapters: int = 8) -> LoraSet:
        """Make this model take LoRA adapters, chosen per request by `option` (`default`: none), and have the model
        input builder pack each token's adapter; call it from `before_packing`. Returns the (empty) `LoraSet`."""
        from wde.components.model_input_builder import PackedInputBuilder

        builder = ctx.components.get("model_input_builder")
        if not isinstance(builder, PackedInputBuilder):
            raise ModelLoadError(f"LoRA adapters need a model input builder that packs adapter ids (packed or a"
                                 f" subclass of PackedInputBuilder), not {type(builder).__name__}")
        self.lora = LoraSet(self, option, default, max_adapters)
        builder.use_adapters(self.lora.table)
        return self.lora

    def request_options(self) -> dict[str, tuple[str, ...]]:
        """The adapter option (with the loaded adapters' names) when the model takes adapters; none otherwise."""
        return self.lora.request_options() if self.lora is not None else {}

    def read_config(self, ctx: BuildContext) -> None:
        """First thing `__init__` runs after the `model_types` check, before anything is built: a subclass refuses
        config settings it does not implement, or reads what it needs before `build` (nothing here)."""

    def _mixed_attention_dtype(self, params: ModelParams) -> torch.dtype:
        """The dtype attention runs in under mixed precision: the low dtype or float32 (cpu_kernels.py), the
        model's attention backend timed at the config's heads and head size (the low dtype when the config names
        neither)."""
        cfg = self.config
        heads = getattr(cfg, "num_attention_heads", None)
        hidden = getattr(cfg, "hidden_size", None)
        head_dim = getattr(cfg, "head_dim", None) or (hidden // heads if heads and hidden else None)
        if params.mixed_precision_kernels == "auto" and not (isinstance(heads, int) and isinstance(head_dim, int)):
            return self.dtype
        return attention_dtype(params.mixed_precision_kernels, heads or 0, head_dim or 0, self.dtype,
                               backend=self.attn_backend, causal=self.causal)

    @property
    def linear_input_dtype(self) -> torch.dtype | None:
        """The dtype every linear layer of the blocks casts its input to, where a norm may write its output in it
        (the values the cast would give, without the cast's pass): the low dtype of a mixed-precision model whose
        linear layers run in it, without adapters or int8; else None (a norm's output goes as it is)."""
        if (self.mixed_precision and self.linear_dtype != torch.float32 and self.lora is None
                and self.quantization == "none"):
            return self.linear_dtype
        return None

    @property
    def hidden_size(self) -> int:
        """Width of the hidden states `forward` returns (poolers size their output from it)."""
        return int(self.config.hidden_size)

    def position_offset_for(self, cfg: object) -> int:
        """Index of position 0 in the model's position table (RoBERTa: `pad_token_id + 1`); 0 by default."""
        return 0

    def position_table_size(self, cfg: object) -> int | None:
        """Rows of the absolute position table, or None when the model has none (rotary, relative)."""
        return None

    def _check_position_table(self, ctx: BuildContext) -> None:
        """Refuse a tokenizer that lets inputs overrun the position table (which would fail mid-batch)."""
        table = self.position_table_size(self.config)
        limit = ctx.tokenizer.max_length
        if table is None or not isinstance(limit, int):
            return
        offset = self.position_offset_for(self.config)
        if limit + offset > table:
            raise ModelLoadError(
                f"inputs of up to {limit} tokens are allowed (tokenizer max_length) but the position table holds"
                f" {table} positions from offset {offset}; set tokenizer.params.max_length <= {table - offset}"
                f" (or tokenizer.params.position_offset: {offset})")

    def attention_metadata(self, batch: ModelInput, bias: torch.Tensor | None = None,
                           window: Window | None = None) -> AttentionMetadata:
        """The batch's attention metadata (built once per forward and layer kind, shared by the layers of that
        kind), with this model's causal setting, an optional additive bias (see `check_bias`) and an optional
        local-attention window (see `Window`)."""
        kwargs: dict = {}
        if bias is not None:
            kwargs["bias"] = bias
        if window is not None:
            kwargs["window"] = window
        return self.attn_backend.build_metadata(batch, self.causal, **kwargs)

    def build(self, config: object) -> None:
        raise NotImplementedError

    def forward(self, batch: ModelInput) -> torch.Tensor:
        """Hidden states of the last layer, packed: [tokens, hidden]."""
        raise NotImplementedError
