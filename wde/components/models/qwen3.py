"""Qwen3 decoders over packed tokens (Qwen3-Embedding, and the backbone of Qwen3-Reranker)."""

from __future__ import annotations

from wde.components.attention.base import AttentionBackend
from wde.components.models.decoder_layers import DecoderAttention, DecoderLayer, DecoderModel, RMSNorm


class Qwen3Attention(DecoderAttention):
    """Grouped-query attention with an RMSNorm over each head's q and k (`q_norm`, `k_norm`) before RoPE."""

    def __init__(self, cfg: object, backend: AttentionBackend, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__(cfg, backend, qkv_bias, o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)  # type: ignore[attr-defined]
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)  # type: ignore[attr-defined]

    def qk_norms(self) -> tuple[RMSNorm | None, RMSNorm | None]:
        return self.q_norm, self.k_norm


class Qwen3DecoderLayer(DecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(DecoderModel):
    """Qwen3: the Llama stack with per-head q/k RMSNorm, an explicit `head_dim` (not hidden / heads) and biases on
    the attention projections only when the config sets `attention_bias`. Causal by default.

    Serves `Qwen3Model` and `Qwen3ForCausalLM` checkpoints alike: the loader strips `model.` and skips `lm_head`
    (the yes/no reranker head reads the two rows it needs itself).
    """

    name = "qwen3"
    model_types = ("qwen3",)
    layer_cls = Qwen3DecoderLayer
