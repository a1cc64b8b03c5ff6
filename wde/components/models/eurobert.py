"""EuroBERT encoders over packed tokens: the Llama stack, attending both ways."""

from __future__ import annotations

from wde.components.models.decoder_layers import DecoderModel


class EuroBertModel(DecoderModel):
    """EuroBERT (EuroBERT-210m / 610m / 2.1B and models fine-tuned from them): Llama's pre-norm RMSNorm layers,
    grouped-query attention, SwiGLU MLP and half-split RoPE, with a bidirectional mask and a final RMSNorm.

    transformers' `EuroBertModel` is exactly `DecoderModel` with `causal=False`: biases follow `attention_bias`
    (q/k/v and o) and `mlp_bias`; RoPE types with sequence-dependent frequencies are refused by name. Serves
    `EuroBertModel` and `EuroBertForMaskedLM` checkpoints alike (`model.` is stripped, the LM head skipped).
    """

    name = "eurobert"
    model_types = ("eurobert",)
    default_causal = False
