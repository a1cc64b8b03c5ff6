"""The T5 encoder over packed tokens, assembled from WDE's BERT building blocks.

T5 differs from BERT in ways the blocks take as parameters: no absolute positions, token types or embedding
norm; pre-norm RMSNorm blocks; bias-free projections; no score scaling (scale 1.0); `d_kv`-wide heads; a relu or
gated-gelu MLP. What BERT lacks entirely is the relative position bias: layer 0's `relative_attention_bias`
table turns bucketed key-minus-query distances (`relative_position_buckets`, the bucketing T5 and MPNet share) into
one additive bias per head, computed once per batch and shared by every layer through the attention metadata.
"""

from __future__ import annotations

import torch
from torch import nn

from wde.api import (BertEmbeddings, BertLayer, BertModel, ModelInput, ModelLoadError, RMSNorm,
                     relative_position_buckets)


class T5EncoderModel(BertModel):
    """sentence-T5 / GTR-T5 encoders (`T5EncoderModel` checkpoints, relu or gated-gelu MLP)."""

    name = "t5_encoder"
    uses_attention_bias = True
    checkpoint_prefixes = ("encoder.",)
    # Checkpoint name parts -> this module's, applied in order (the first rule must run before `block` moves).
    checkpoint_name_mapping = {
        "block.0.layer.0.SelfAttention.relative_attention_bias": "relative_attention_bias",
        "block": "encoder.layer",
        "layer.0.SelfAttention.o": "attention.output.dense",
        "layer.0.layer_norm": "attention_norm",
        "layer.1.DenseReluDense.wi": "intermediate.dense",
        "layer.1.DenseReluDense.wo": "output.dense",
        "layer.1.layer_norm": "mlp_norm",
        "shared": "embeddings.word_embeddings",
        "embed_tokens": "embeddings.word_embeddings",
    }
    packed_modules_mapping = {
        "layer.0.SelfAttention.q": ("attention.qkv", 0),
        "layer.0.SelfAttention.k": ("attention.qkv", 1),
        "layer.0.SelfAttention.v": ("attention.qkv", 2),
        "layer.1.DenseReluDense.wi_0": ("intermediate.dense", 0),
        "layer.1.DenseReluDense.wi_1": ("intermediate.dense", 1),
    }

    def build(self, cfg: object) -> None:
        if getattr(cfg, "model_type", None) != "t5":
            raise ModelLoadError(f"model 't5_encoder' serves config model_type 't5', got {getattr(cfg, 'model_type', None)!r}")
        super().build(cfg)
        self.relative_attention_bias = nn.Embedding(cfg.relative_attention_num_buckets, cfg.num_heads)
        self.final_layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)
        self._buckets: dict[tuple[int, str], torch.Tensor] = {}

    def build_embeddings(self, cfg: object) -> nn.Module:
        return BertEmbeddings(cfg, positions=False, token_types=False, layer_norm=False)

    def build_layer(self, cfg: object) -> nn.Module:
        return BertLayer(cfg, self.attn_backend, bias=False, head_dim=cfg.d_kv, scale=1.0, intermediate_size=cfg.d_ff,
                         act=cfg.dense_act_fn, gated=cfg.is_gated_act, pre_norm_eps=cfg.layer_norm_epsilon)

    def position_table_size(self, cfg: object) -> int | None:
        return None  # relative positions: no table to overrun

    def attention_bias(self, batch: ModelInput) -> torch.Tensor:
        """[heads, L, L] relative position bias for the batch's longest sequence (shorter ones use its corner)."""
        length, device = batch.max_seqlen, batch.input_ids.device
        key = (length, str(device))
        buckets = self._buckets.get(key)
        if buckets is None:
            buckets = relative_position_buckets(length, self.config.relative_attention_num_buckets,
                                                self.config.relative_attention_max_distance, device)
            self._buckets = {key: buckets}  # keep one: batch lengths vary
        return self.relative_attention_bias(buckets).permute(2, 0, 1)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.final_layer_norm(x)[0]
