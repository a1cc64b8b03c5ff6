"""BERT with its masked-LM head (`BertForMaskedLM`): the encoder of SPLADE models, whose vocabulary logits the
`splade` pooler turns into sparse weights.

`forward` returns the encoder's last hidden states like every model (so per-token poolers still work); the head
runs on request, on the tokens a pooler passes to `mlm_logits`, in chunks it chooses (a batch's full
[tokens, vocabulary] logits would be 1 GB at 8k tokens and BERT's 30k words).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from wde.components.models.activations import activation
from wde.components.models.bert import BertModel


class BertPredictionHeadTransform(nn.Module):
    """`LayerNorm(act(dense(x)))` (`cls.predictions.transform`)."""

    def __init__(self, cfg: object) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.transform_act_fn = activation(cfg.hidden_act)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.transform_act_fn(self.dense(x))
        return self.LayerNorm(x.to(self.LayerNorm.weight.dtype))  # mixed precision: the norm is float32


class BertLMPredictionHead(nn.Module):
    """`cls.predictions`: the transform, then the decoder (the word embeddings when tied, as every SPLADE
    checkpoint is) plus `bias`."""

    def __init__(self, cfg: object, tied: bool) -> None:
        super().__init__()
        self.transform = BertPredictionHeadTransform(cfg)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        if not tied:
            self.decoder = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


class BertMLMHead(nn.Module):
    """Holds `predictions` so parameter names match the checkpoint's `cls.predictions.*`."""

    def __init__(self, cfg: object, tied: bool) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(cfg, tied)


class BertForMaskedLM(BertModel):
    """BertForMaskedLM checkpoints (`bert.` encoder + `cls.predictions` head). The decoder bias loads from
    `cls.predictions.bias` (or `cls.predictions.decoder.bias` in older saves); a tied decoder weight is the word
    embeddings, an untied one (`tie_word_embeddings: false`) loads from `cls.predictions.decoder.weight`."""

    name = "bert_mlm"
    has_mlm_head = True
    checkpoint_prefixes = ("bert.",)
    checkpoint_name_mapping = {"predictions.decoder.bias": "predictions.bias"}

    def build(self, cfg: object) -> None:
        super().build(cfg)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", True))
        self.cls = BertMLMHead(cfg, self.tied)

    @property
    def mlm_vocab_size(self) -> int:
        """Width of `mlm_logits`."""
        return int(self.cls.predictions.bias.shape[0])

    def mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[tokens, vocab] masked-LM logits of final hidden states [tokens, hidden] (any subset of a batch's)."""
        head = self.cls.predictions
        x = head.transform(hidden)
        if not self.tied:
            logits = head.decoder(x)  # an nn.Linear (or its packed / mixed-precision replacement)
            return logits + head.bias.to(logits.dtype)
        weight = self.embeddings.word_embeddings.weight
        return F.linear(x.to(weight.dtype), weight, head.bias.to(weight.dtype))
