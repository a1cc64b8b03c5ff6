"""BERT-family encoders over packed tokens (BERT, and by subclass RoBERTa / XLM-RoBERTa).

Parameter names follow the Hugging Face checkpoint, except that query/key/value are fused into one
`qkv` projection (one GEMM per layer instead of three).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from wde.components.attention.base import AttentionBackend, AttentionMetadata
from wde.components.model_input_builder import ModelInput
from wde.components.models.base import PrefillModel
from wde.components.models.fused import add_layer_norm
from wde.components.models.loader import fused_linear
from wde.errors import ModelLoadError


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: object, position_offset: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(cfg.type_vocab_size, 1), cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.position_offset = position_offset

    def forward(self, batch: ModelInput) -> torch.Tensor:
        x = self.word_embeddings(batch.input_ids) + self.position_embeddings(batch.positions + self.position_offset)
        if batch.token_type_ids is not None:
            x = x + self.token_type_embeddings(batch.token_type_ids)
        else:
            x = x + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class BertSelfOutput(nn.Module):
    def __init__(self, cfg: object, in_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return add_layer_norm(self.dense(x), residual, self.LayerNorm)


class BertAttention(nn.Module):
    def __init__(self, cfg: object, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = fused_linear(cfg.hidden_size, [cfg.hidden_size] * 3, bias=True)
        self.output = BertSelfOutput(cfg, cfg.hidden_size)
        self.backend = backend

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        attn = self.backend.forward(q, k, v, meta, self.scale)
        return self.output(attn.reshape(x.shape[0], -1), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: object) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, cfg: object, backend: AttentionBackend) -> None:
        super().__init__()
        self.attention = BertAttention(cfg, backend)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertSelfOutput(cfg, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.attention(x, meta)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: object, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, backend) for _ in range(cfg.num_hidden_layers))


class BertModel(PrefillModel):
    """Bidirectional BERT encoder; returns the last hidden states of every packed token."""

    name = "bert"
    checkpoint_prefixes = ("bert.",)
    packed_modules_mapping = {
        "attention.self.query": ("attention.qkv", 0),
        "attention.self.key": ("attention.qkv", 1),
        "attention.self.value": ("attention.qkv", 2),
    }
    position_offset = 0

    def build(self, cfg: object) -> None:
        kind = getattr(cfg, "position_embedding_type", "absolute") or "absolute"
        if kind != "absolute":
            raise ModelLoadError(f"{type(self).__name__} supports absolute position embeddings only, config has {kind!r}")
        self.embeddings = BertEmbeddings(cfg, self.position_offset_for(cfg))
        self.encoder = BertEncoder(cfg, self.attn_backend)

    def position_offset_for(self, cfg: object) -> int:
        return self.position_offset

    def forward(self, batch: ModelInput) -> torch.Tensor:
        meta = self.attn_backend.build_metadata(batch, self.causal)
        x = self.embeddings(batch)
        for layer in self.encoder.layer:
            x = layer(x, meta)
        return x


class XLMRobertaModel(BertModel):
    """XLM-RoBERTa / RoBERTa: BERT's layers, positions numbered from `pad_token_id + 1`."""

    name = "xlm_roberta"
    checkpoint_prefixes = ("roberta.",)

    def position_offset_for(self, cfg: object) -> int:
        return int(getattr(cfg, "pad_token_id", 1)) + 1
