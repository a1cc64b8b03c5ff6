"""BERT-family encoders over packed tokens (BERT, and by subclass RoBERTa / XLM-RoBERTa).

Parameter names follow the Hugging Face checkpoint, except that query/key/value are fused into one
`qkv` projection (one GEMM per layer instead of three).
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
from torch import nn

from wde.components.attention.base import AttentionBackend, AttentionMetadata, Window
from wde.components.model_input_builder import ModelInput
from wde.components.models.activations import activation
from wde.components.models.base import PrefillModel
from wde.components.models.decoder_layers import RMSNorm
from wde.components.models.fused import linear_add_layer_norm
from wde.components.models.loader import fused_linear
from wde.errors import ModelLoadError


class BertEmbeddings(nn.Module):
    """Token (+ absolute position) (+ token type) embeddings (+ LayerNorm), each part switchable.

    :param position_offset: index of position 0 in the position table (RoBERTa: `pad_token_id + 1`).
    :param positions: add absolute position embeddings (off for rotary or relative-position models).
    :param token_types: add token type embeddings (row 0 when the batch has none).
    :param layer_norm: finish with LayerNorm (`cfg.layer_norm_eps`); off for pre-norm models.
    :param norm_bias: whether that LayerNorm has a bias (ModernBERT's have none).
    """

    def __init__(self, cfg: object, position_offset: int = 0, *, positions: bool = True, token_types: bool = True,
                 layer_norm: bool = True, norm_bias: bool = True) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if positions:
            self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        if token_types:
            self.token_type_embeddings = nn.Embedding(max(cfg.type_vocab_size, 1), cfg.hidden_size)
        if layer_norm:
            self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=norm_bias)
        self.position_offset = position_offset

    def forward(self, batch: ModelInput) -> torch.Tensor:
        x = self.word_embeddings(batch.input_ids)
        if hasattr(self, "position_embeddings"):
            x = x + self.position_embeddings(batch.positions + self.position_offset)
        if hasattr(self, "token_type_embeddings"):
            if batch.token_type_ids is not None:
                x = x + self.token_type_embeddings(batch.token_type_ids)
            else:
                x = x + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x) if hasattr(self, "LayerNorm") else x


class BertSelfOutput(nn.Module):
    """`dense(x) + residual`, then LayerNorm when `norm` (BERT's post-norm); `norm=False` for pre-norm blocks.
    `norm_bias=False`: a LayerNorm without bias."""

    def __init__(self, cfg: object, in_features: int, *, bias: bool = True, norm: bool = True,
                 norm_bias: bool = True) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, cfg.hidden_size, bias=bias)
        if norm:
            self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=norm_bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "LayerNorm"):
            return linear_add_layer_norm(self.dense, x, residual, self.LayerNorm)
        return self.dense(x) + residual


class BertAttention(nn.Module):
    """Self-attention with one fused q|k|v projection (`qkv`, shards 0/1/2) and an output projection.

    :param bias: whether the projections have biases (T5: none).
    :param head_dim: per-head width; default `hidden_size // num_attention_heads` (T5: `d_kv`).
    :param scale: score scale; default `head_dim ** -0.5` (T5: 1.0).
    :param post_norm: add the residual and LayerNorm (BERT); False: only add the residual (pre-norm blocks).
    :param rotary: rotary position embeddings applied to q and k: a module called as `rotary(positions, dtype)`
        giving (cos, sin) (computed once per batch and module, see `AttentionMetadata.cached`) with an
        `apply(x, cos, sin)` method (e.g. `wde.api.RotaryEmbedding`); None for absolute or relative positions.
    :param qk_transform: any other change of q and k before attention, called as `qk_transform(q, k, meta)`
        and returning (q, k), e.g. per-head norms.
    """

    def __init__(self, cfg: object, backend: AttentionBackend, *, bias: bool = True, head_dim: int | None = None,
                 scale: float | None = None, post_norm: bool = True, norm_bias: bool = True,
                 rotary: nn.Module | None = None,
                 qk_transform: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata],
                                        tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = head_dim or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5 if scale is None else scale
        inner = self.num_heads * self.head_dim
        self.qkv = fused_linear(cfg.hidden_size, [inner] * 3, bias=bias)
        self.output = BertSelfOutput(cfg, inner, bias=bias, norm=post_norm, norm_bias=norm_bias)
        self.backend = backend
        self.rotary = rotary
        self.qk_transform = qk_transform

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over `x` plus `residual` (default: `x` itself)."""
        q, k, v = self.qkv(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        if self.rotary is not None:
            rotary = self.rotary
            cos, sin = meta.cached(("rotary", id(rotary), x.dtype), lambda: rotary(meta.positions, x.dtype))
            q, k = rotary.apply(q, cos, sin), rotary.apply(k, cos, sin)
        if self.qk_transform is not None:
            q, k = self.qk_transform(q, k, meta)
        attn = self.backend.forward(q.to(v.dtype), k.to(v.dtype), v, meta, self.scale)
        return self.output(attn.reshape(x.shape[0], -1), x if residual is None else residual)


class BertIntermediate(nn.Module):
    """`act(dense(x))`, or with `gated` `act(gate(x)) * up(x)` from one fused `dense` (shards 0 = gate, 1 = up).

    :param size: width; default `cfg.intermediate_size`. :param act: activation name; default `cfg.hidden_act`.
    """

    def __init__(self, cfg: object, *, bias: bool = True, size: int | None = None, act: str | None = None,
                 gated: bool = False) -> None:
        super().__init__()
        self.size = size or cfg.intermediate_size
        self.gated = gated
        if gated:
            self.dense = fused_linear(cfg.hidden_size, [self.size] * 2, bias=bias)
        else:
            self.dense = nn.Linear(cfg.hidden_size, self.size, bias=bias)
        self.act = activation(act or cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = self.dense(x).split(self.size, dim=-1)
            return self.act(gate) * up
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    """One encoder block: attention then MLP, each with a residual.

    Post-norm (BERT, default): LayerNorm after each residual add. With `pre_norm_eps` (T5-style): RMSNorm
    (`attention_norm`, `mlp_norm`) before attention and MLP, no norm after. The other keyword arguments go to
    `BertAttention` (`bias`, `head_dim`, `scale`, `rotary`, `qk_transform`), `BertIntermediate` (`bias`,
    `intermediate_size`, `act`, `gated`) and the LayerNorms (`norm_bias`). `window` makes it a local-attention
    layer (see `wde.api.Window`): the model builds one attention metadata per distinct `attention_window` of its
    layers, once per batch.
    """

    def __init__(self, cfg: object, backend: AttentionBackend, *, bias: bool = True, head_dim: int | None = None,
                 scale: float | None = None, intermediate_size: int | None = None, act: str | None = None,
                 gated: bool = False, pre_norm_eps: float | None = None, norm_bias: bool = True,
                 rotary: nn.Module | None = None, window: Window | None = None) -> None:
        super().__init__()
        post_norm = pre_norm_eps is None
        self.attention = BertAttention(cfg, backend, bias=bias, head_dim=head_dim, scale=scale, post_norm=post_norm,
                                       norm_bias=norm_bias, rotary=rotary)
        self.intermediate = BertIntermediate(cfg, bias=bias, size=intermediate_size, act=act, gated=gated)
        self.output = BertSelfOutput(cfg, self.intermediate.size, bias=bias, norm=post_norm, norm_bias=norm_bias)
        self.attention_window = window
        if not post_norm:
            self.attention_norm = RMSNorm(cfg.hidden_size, pre_norm_eps)
            self.mlp_norm = RMSNorm(cfg.hidden_size, pre_norm_eps)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if hasattr(self, "attention_norm"):
            x = self.attention(self.attention_norm(x)[0], meta, residual=x)
            return self.output(self.intermediate(self.mlp_norm(x)[0]), x)
        x = self.attention(x, meta)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    """`cfg.num_hidden_layers` layers made by `make_layer(index)` (or `make_layer()`; default:
    `BertLayer(cfg, backend)`)."""

    def __init__(self, cfg: object, backend: AttentionBackend,
                 make_layer: Callable[[int], nn.Module] | Callable[[], nn.Module] | None = None) -> None:
        super().__init__()
        make_layer = make_layer or (lambda i: BertLayer(cfg, backend))
        with_index = _takes_args(make_layer, 1)
        self.layer = nn.ModuleList(make_layer(i) if with_index else make_layer()  # type: ignore[call-arg]
                                   for i in range(cfg.num_hidden_layers))


def _takes_args(fn: Callable, n: int) -> bool:
    """Whether `fn` can be called with `n` positional arguments (hooks written before an argument was added)."""
    try:
        inspect.signature(fn).bind(*range(n))
    except TypeError:
        return False
    return True


class BertModel(PrefillModel):
    """Bidirectional BERT encoder; returns the last hidden states of every packed token.

    Subclasses change one part through the hooks: `build_embeddings`, `build_layer(cfg, index)`, `attention_bias`
    (per batch, computed once and shared by every layer) and `final_norm`; `forward` stays the same loop. Layers
    with an `attention_window` (local attention) get the metadata of their window, built once per batch and
    window; a model with such layers sets `uses_attention_window = True`.
    """

    name = "bert"
    uses_cpu_ops = True  # BertSelfOutput's add_layer_norm (post-norm blocks)
    checkpoint_prefixes = ("bert.",)
    packed_modules_mapping = {
        "attention.self.query": ("attention.qkv", 0),
        "attention.self.key": ("attention.qkv", 1),
        "attention.self.value": ("attention.qkv", 2),
    }
    position_offset = 0
    lora_skipped_modules = ("pooler.dense",)  # the bare BertModel's pooler, which no WDE output reads
    lora_embedding_modules = ("embeddings.word_embeddings",)

    def build(self, cfg: object) -> None:
        self.embeddings = self.build_embeddings(cfg)
        with_index = _takes_args(self.build_layer, 2)
        self.encoder = BertEncoder(cfg, self.attn_backend,
                                   lambda i: self.build_layer(cfg, i) if with_index else self.build_layer(cfg))

    def build_embeddings(self, cfg: object) -> nn.Module:
        """The module mapping a `ModelInput` to the first hidden states [tokens, hidden]."""
        kind = getattr(cfg, "position_embedding_type", "absolute") or "absolute"
        if kind != "absolute":
            raise ModelLoadError(f"{type(self).__name__} supports absolute position embeddings only, config has {kind!r}")
        return BertEmbeddings(cfg, self.position_offset_for(cfg))

    def build_layer(self, cfg: object, index: int = 0) -> nn.Module:
        """Layer `index`: a module called as `layer(hidden, meta)`, with an optional `attention_window`."""
        return BertLayer(cfg, self.attn_backend)

    def position_offset_for(self, cfg: object) -> int:
        return self.position_offset

    def position_table_size(self, cfg: object) -> int | None:
        return getattr(cfg, "max_position_embeddings", None)

    def attention_bias(self, batch: ModelInput) -> torch.Tensor | None:
        """An additive attention bias for this batch (see `check_bias`), or None; BERT has none."""
        return None

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """Applied to the last layer's output (pre-norm models normalize here); BERT: identity."""
        return x

    def forward(self, batch: ModelInput) -> torch.Tensor:
        bias = self.attention_bias(batch)
        windows = [getattr(layer, "attention_window", None) for layer in self.encoder.layer]
        metas = {w: self.attention_metadata(batch, bias, w) for w in dict.fromkeys(windows)}
        x = self.embeddings(batch)
        for layer, window in zip(self.encoder.layer, windows):
            x = layer(x, metas[window])
        return self.final_norm(x)


class XLMRobertaModel(BertModel):
    """XLM-RoBERTa / RoBERTa: BERT's layers, positions numbered from `pad_token_id + 1`."""

    name = "xlm_roberta"
    checkpoint_prefixes = ("roberta.",)

    def position_offset_for(self, cfg: object) -> int:
        return int(getattr(cfg, "pad_token_id", 1)) + 1
