"""DistilBERT encoders (`DistilBertModel`, and the encoder of `DistilBertForSequenceClassification`).

DistilBERT is BERT's post-norm layer under other names: `transformer.layer.N.attention.q_lin/k_lin/v_lin/out_lin`,
`sa_layer_norm`, `ffn.lin1/lin2`, `output_layer_norm`; word + absolute position embeddings with no token types
(a pair's segment ids are ignored, as transformers ignores them); every LayerNorm's epsilon is 1e-12 whatever
the config says. The config names its sizes differently (`dim`, `n_heads`, `n_layers`, `hidden_dim`,
`activation`), so the BERT blocks see it through a view with BERT's names.

`sinusoidal_pos_embds: true` needs nothing of its own: transformers writes the sinusoidal table into the
checkpoint as `embeddings.position_embeddings.weight` and reads it back from there, so it loads as a learned table
would (a checkpoint without it is refused by the loader, naming the parameter).
"""

from __future__ import annotations


from torch import nn

from wde.components.models.bert import BertEmbeddings, BertModel
from wde.errors import ModelLoadError
from wde.components.models.config_view import ConfigView

LAYER_NORM_EPS = 1e-12
"""transformers' DistilBERT hard-codes it in every LayerNorm."""


def bert_view(cfg: object) -> ConfigView:
    """A DistilBertConfig as the BERT blocks read a config."""
    return ConfigView(cfg, hidden_size=cfg.dim, num_attention_heads=cfg.n_heads, num_hidden_layers=cfg.n_layers,
                           intermediate_size=cfg.hidden_dim, hidden_act=cfg.activation, layer_norm_eps=LAYER_NORM_EPS,
                           type_vocab_size=0)


class DistilBertModel(BertModel):
    """DistilBERT: BERT's layers under DistilBERT's checkpoint names, no token type embeddings."""

    name = "distilbert"
    model_types = ("distilbert",)
    checkpoint_prefixes = ("distilbert.",)  # DistilBertFor* checkpoints; a bare DistilBertModel has none
    checkpoint_name_mapping = {
        "transformer.layer": "encoder.layer",
        "attention.out_lin": "attention.output.dense",
        "sa_layer_norm": "attention.output.LayerNorm",
        "ffn.lin1": "intermediate.dense",
        "ffn.lin2": "output.dense",
        "output_layer_norm": "output.LayerNorm",
    }
    packed_modules_mapping = {
        "attention.q_lin": ("attention.qkv", 0),
        "attention.k_lin": ("attention.qkv", 1),
        "attention.v_lin": ("attention.qkv", 2),
    }

    def build(self, cfg: object) -> None:
        if cfg.dim % cfg.n_heads:
            raise ModelLoadError(f"DistilBERT config: n_heads {cfg.n_heads} does not divide dim {cfg.dim}")
        super().build(bert_view(cfg))

    def build_embeddings(self, cfg: object) -> nn.Module:
        return BertEmbeddings(cfg, self.position_offset_for(cfg), token_types=False)
