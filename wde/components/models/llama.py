"""Llama and Mistral decoders over packed tokens (e5-mistral, LLM2Vec and plain decoder features)."""

from __future__ import annotations

from wde.components.models.decoder_layers import DecoderModel


class LlamaModel(DecoderModel):
    """Llama: bias-free projections unless the config sets `attention_bias` (q/k/v and o) / `mlp_bias`.

    Mistral checkpoints are the same stack (their sliding window is checked by `DecoderModel`), so this
    component serves both.
    """

    name = "llama"
    model_types = ("llama", "mistral")


class MistralModel(LlamaModel):
    """Mistral: Llama's layers with grouped-query attention; `sliding_window` bounds the accepted input length."""

    name = "mistral"
    model_types = ("mistral",)
