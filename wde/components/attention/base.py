"""The attention backend interface shared by every backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from wde.components.base import BuildContext, Component, Params
from wde.components.model_input_builder import ModelInput


class AttentionParams(Params):
    causal: bool | None = None
    """True: causal mask; False: bidirectional; None: what the model config states, else the model's default."""


@dataclass
class AttentionMetadata:
    """Per-batch data a backend needs, built once per forward and shared by every layer."""

    cu_seqlens: torch.Tensor
    seq_lens: list[int]
    max_seqlen: int
    causal: bool
    extra: Any = None


class AttentionBackend(Component):
    """Computes attention for packed q/k/v of shape [tokens, heads, head_dim]; k/v may have fewer heads (GQA)."""

    kind = "attention"
    Params = AttentionParams

    def __init__(self, params: AttentionParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self._config_causal = self._causal_from_config(ctx.source.hf_config)

    @staticmethod
    def _causal_from_config(cfg: Any) -> bool | None:
        """Configs that state it (LLM2Vec-style `is_causal`, `bidirectional`) decide the mask."""
        if getattr(cfg, "is_causal", None) is not None:
            return bool(cfg.is_causal)
        if getattr(cfg, "bidirectional", None) is not None:
            return not bool(cfg.bidirectional)
        return None

    def resolve_causal(self, model_default: bool) -> bool:
        """The workflow param wins, then the model config, then the model family's default."""
        if self.params.causal is not None:
            return self.params.causal
        if self._config_causal is not None:
            return self._config_causal
        return model_default

    def build_metadata(self, batch: ModelInput, causal: bool) -> AttentionMetadata:
        return AttentionMetadata(batch.cu_seqlens, batch.seq_lens, batch.max_seqlen, causal)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """Attention output of shape [tokens, q_heads, head_dim]."""
        raise NotImplementedError
