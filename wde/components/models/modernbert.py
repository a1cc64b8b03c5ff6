"""ModernBERT (answerdotai/ModernBERT-base/large, gte-modernbert, modernbert-embed, ModernBERT rerankers):
a pre-norm encoder with rotary positions, GeGLU MLPs, bias-free LayerNorms, and local attention (a window of
`local_attention` tokens) in every layer but each `global_attn_every_n_layers`-th one.

Built on BERT's blocks through the public seams: `BertAttention` with a `rotary` (one `RotaryEmbedding` per layer
kind: the global layers' theta and the local layers' differ), layers with an `attention_window` (the model builds
one attention metadata per window kind, once per batch, and every backend computes only the keys in the window),
LayerNorm without bias. Checkpoint names are ModernBERT's; `checkpoint_name_mapping` maps the attention ones.
"""

from __future__ import annotations

import torch
from torch import nn

from wde.components.attention.base import AttentionBackend, AttentionMetadata, Window
from wde.components.model_input_builder import ModelInput
from wde.components.models.activations import activation
from wde.components.models.bert import BertAttention, BertModel
from wde.components.models.loader import fused_linear
from wde.components.models.rotary import RotaryEmbedding
from wde.errors import ModelLoadError

LAYER_KINDS = ("full_attention", "sliding_attention")


class ModernBertEmbeddings(nn.Module):
    """Token embeddings then LayerNorm: ModernBERT has no position or token type tables."""

    def __init__(self, cfg: object) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)

    def forward(self, batch: ModelInput) -> torch.Tensor:
        return self.norm(self.tok_embeddings(batch.input_ids))


class ModernBertMLP(nn.Module):
    """GeGLU: `Wo(act(input) * gate)` where `input | gate = Wi(x)`."""

    def __init__(self, cfg: object) -> None:
        super().__init__()
        self.size = int(cfg.intermediate_size)
        self.Wi = fused_linear(cfg.hidden_size, [self.size] * 2, bias=cfg.mlp_bias)
        self.act = activation(cfg.hidden_activation)
        self.Wo = nn.Linear(self.size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.Wi(x).split(self.size, dim=-1)
        return self.Wo(self.act(value) * gate)


class ModernBertLayer(nn.Module):
    """`x + attn(attn_norm(x))`, then `x + mlp(mlp_norm(x))`; layer 0 has no `attn_norm` (the embeddings' norm
    precedes it)."""

    def __init__(self, cfg: object, backend: AttentionBackend, index: int, rotary: RotaryEmbedding,
                 window: Window | None) -> None:
        super().__init__()
        self.attn_norm = nn.Identity() if index == 0 else nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps,
                                                                          bias=cfg.norm_bias)
        self.attn = BertAttention(cfg, backend, bias=cfg.attention_bias, post_norm=False, rotary=rotary)
        self.mlp_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.mlp = ModernBertMLP(cfg)
        self.attention_window = window

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.attn(self.attn_norm(x), meta, residual=x)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertModel(BertModel):
    """ModernBertModel (and the encoder of ModernBertForSequenceClassification / ForMaskedLM)."""

    name = "modernbert"
    model_types = ("modernbert",)
    checkpoint_prefixes = ("model.",)
    checkpoint_name_mapping = {"layers": "encoder.layer", "attn.Wqkv": "attn.qkv", "attn.Wo": "attn.output.dense",
                               "final_norm": "norm"}
    packed_modules_mapping: dict[str, tuple[str, int]] = {}
    lora_embedding_modules = ("embeddings.tok_embeddings",)
    uses_attention_window = True

    def build(self, cfg: object) -> None:
        kinds = list(cfg.layer_types)
        unknown = sorted(set(kinds) - set(LAYER_KINDS))
        if unknown or len(kinds) != cfg.num_hidden_layers:
            raise ModelLoadError(f"layer_types {kinds} must name {cfg.num_hidden_layers} layers among {LAYER_KINDS}")
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.rotary = nn.ModuleDict({kind: RotaryEmbedding.from_config(cfg, head_dim, layer_type=kind)
                                     for kind in dict.fromkeys(kinds)})
        half = int(cfg.local_attention) // 2  # |i - j| <= local_attention / 2, as ModernBERT's flash attention
        super().build(cfg)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)
        for layer, kind in zip(self.encoder.layer, kinds):
            layer.attention_window = (half, half) if kind == "sliding_attention" else None

    def build_embeddings(self, cfg: object) -> nn.Module:
        return ModernBertEmbeddings(cfg)

    def build_layer(self, cfg: object, index: int = 0) -> nn.Module:
        kind = cfg.layer_types[index]
        return ModernBertLayer(cfg, self.attn_backend, index, self.rotary[kind], None)

    def position_table_size(self, cfg: object) -> int | None:
        return None  # rotary: no table to overrun

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)
