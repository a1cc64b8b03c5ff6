"""MPNet encoders (`MPNetModel`; sentence-transformers/all-mpnet-base-v2, multi-qa-mpnet-base-*, ...).

MPNet is BERT's post-norm layer plus a relative position bias shared by every layer: T5-style buckets of the
key-minus-query distance (bidirectional, max distance 128) looked up in one `[buckets, heads]` table
(`encoder.relative_attention_bias`), added to the scaled scores. Absolute positions are numbered from
`padding_idx + 1` as in RoBERTa, with no token type embeddings.

Two details follow transformers' `MPNetModel` rather than the config, since that is what every checkpoint was
trained and is served with: the padding index is 1 whatever `pad_token_id` says (positions start at 2), and the
bias always uses 32 buckets (`compute_position_bias` never passes `relative_attention_num_buckets`, which only
sizes the table; a table smaller than 32 rows is refused).
"""

from __future__ import annotations

import torch
from torch import nn

from wde.components.model_input_builder import ModelInput
from wde.components.models.bert import BertEmbeddings, BertModel
from wde.components.models.relative_position import relative_position_buckets
from wde.errors import ModelLoadError


class MPNetModel(BertModel):
    """MPNet: BERT's layers, RoBERTa's positions, no token types, one relative position bias for all layers."""

    name = "mpnet"
    model_types = ("mpnet",)
    uses_attention_bias = True
    checkpoint_prefixes = ("mpnet.",)  # MPNetFor* checkpoints; a bare MPNetModel (sentence-transformers) has none
    checkpoint_name_mapping = {
        "attention.attn.o": "attention.output.dense",
        "attention.LayerNorm": "attention.output.LayerNorm",
    }
    packed_modules_mapping = {
        "attention.attn.q": ("attention.qkv", 0),
        "attention.attn.k": ("attention.qkv", 1),
        "attention.attn.v": ("attention.qkv", 2),
    }
    position_offset = 2
    """`MPNetEmbeddings.padding_idx` (1, fixed) + 1."""
    bias_buckets = 32
    """Buckets `MPNetEncoder.compute_position_bias` uses (its default; the config's count only sizes the table)."""
    bias_max_distance = 128

    def build(self, cfg: object) -> None:
        rows = int(getattr(cfg, "relative_attention_num_buckets", self.bias_buckets))
        if rows < self.bias_buckets:
            raise ModelLoadError(
                f"config relative_attention_num_buckets is {rows}, but MPNet buckets relative positions into"
                f" {self.bias_buckets} (as transformers' MPNetModel does); its table needs at least that many rows")
        super().build(cfg)
        self.encoder.relative_attention_bias = nn.Embedding(rows, cfg.num_attention_heads)
        self._buckets: dict[tuple[int, str], torch.Tensor] = {}

    def build_embeddings(self, cfg: object) -> nn.Module:
        return BertEmbeddings(cfg, self.position_offset_for(cfg), token_types=False)

    def attention_bias(self, batch: ModelInput) -> torch.Tensor:
        """[heads, L, L] relative position bias for the batch's longest sequence (shorter ones use its corner)."""
        length, device = batch.max_seqlen, batch.input_ids.device
        key = (length, str(device))
        buckets = self._buckets.get(key)
        if buckets is None:
            buckets = relative_position_buckets(length, self.bias_buckets, self.bias_max_distance, device)
            self._buckets = {key: buckets}  # keep one: batch lengths vary
        return self.encoder.relative_attention_bias(buckets).permute(2, 0, 1)
