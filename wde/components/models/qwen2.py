"""Qwen2 decoders over packed tokens (gte-Qwen2 and other Qwen2-based embedders)."""

from __future__ import annotations

from wde.components.models.decoder_layers import DecoderModel


class Qwen2Model(DecoderModel):
    """Qwen2: the Llama stack with biases on q/k/v, grouped-query attention and RoPE theta from the config.

    Causal by default; `attention.params.causal` or a config stating `is_causal` / `bidirectional` (as
    gte-Qwen2 checkpoints trained bidirectionally do) picks the mask.
    """

    name = "qwen2"
    model_types = ("qwen2",)

    def attention_biases(self, cfg: object) -> tuple[bool, bool]:
        return True, False
