"""The attention backend interface shared by every backend."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from wde.components.base import BuildContext
from wde.components.kinds import Attention
from wde.components.model_input_builder import ModelInput
from wde.components.params import AttentionParams  # torch-free, so validating a workflow needs no torch


@dataclass
class AttentionMetadata:
    """Per-batch data a backend needs, built once per forward and shared by every layer.

    `bias`, when set, is an additive attention bias (see `check_bias`); only a backend whose class sets
    `supports_bias = True` is ever handed one. `window`, when set, is local attention (see `check_window`); only a
    backend with `supports_window = True` is handed one. `key_mask`, when set, is the batch's `ModelInput.key_mask`
    (see `check_key_mask`); only a backend with `supports_key_mask = True` is handed one. A model whose layers
    differ (local and global layers) builds one metadata per distinct kind, once per batch
    (`PrefillModel.attention_metadata`).
    """

    cu_seqlens: torch.Tensor
    seq_lens: list[int]
    max_seqlen: int
    causal: bool
    extra: Any = None
    bias: torch.Tensor | None = None
    window: tuple[int, int] | None = None
    positions: torch.Tensor | None = None
    """Each packed token's position within its sequence (the batch's `positions`), for rotary embeddings."""
    key_mask: torch.Tensor | None = None
    """Boolean [tokens]: which tokens may be attended to as keys (the batch's `key_mask`); None: all of them."""
    memo: dict = field(default_factory=dict, repr=False)
    """Values layers compute once per batch and share (e.g. rotary cos/sin); see `cached`."""

    def cached(self, key: Any, compute: Callable[[], Any]) -> Any:
        """`compute()` the first time `key` is asked for in this batch, the same value after that."""
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]


Window = tuple[int, int]
"""Local attention as (left, right): the query at position i attends the keys at positions i - left .. i + right
of its own sequence (both ends included). With `causal`, keys after i stay masked whatever `right` says."""


def check_window(window: Window) -> None:
    """Validate a local-attention window (see `Window`)."""
    if (not isinstance(window, tuple) or len(window) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in window)):
        raise ValueError(f"attention window must be (left, right) with two integers >= 0, got {window!r}")


def window_keys(n: int, window: Window | None, causal: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean [n, n]: which key j the query i of an n-token sequence may attend (the window and the causal mask)."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    keep = torch.ones(n, n, dtype=torch.bool, device=device)
    if window is not None:
        keep = (j >= i - window[0]) & (j <= i + window[1])
    if causal:
        keep = keep & (j <= i)
    return keep


def check_key_mask(key_mask: torch.Tensor, num_tokens: int) -> None:
    """Validate a key mask for a packed batch: boolean, one entry per token (True: the token may be attended to).

    Masked keys combine with the causal mask, a window and an additive bias: a query attends the keys all of them
    allow. A query left with no key to attend (say every key of its sequence is masked, or its only causal key)
    outputs zeros on every backend (there is nothing to average), never NaN."""
    if key_mask.dtype != torch.bool:
        raise ValueError(f"attention key mask must be a boolean tensor, got {key_mask.dtype}")
    if key_mask.dim() != 1 or key_mask.shape[0] != num_tokens:
        raise ValueError(f"attention key mask must be [tokens] = [{num_tokens}], got {tuple(key_mask.shape)}")


def check_bias(bias: torch.Tensor, num_seqs: int, max_seqlen: int) -> None:
    """Validate an additive attention bias for a packed batch.

    The bias is added to the (already scaled) score of the query at position i and the key at position j of the
    same sequence, positions counted from each sequence's first token. Two shapes are accepted:

    - `[heads, L, L]`: one bias shared by every sequence (a relative position bias, as in T5);
    - `[num_seqs, heads, L, L]`: one bias per sequence.

    `heads` is the number of query heads and `L >= max_seqlen` (a sequence of length n uses `[..., :n, :n]`).
    The causal mask, when on, still applies on top of it.
    """
    if bias.dim() not in (3, 4):
        raise ValueError(f"attention bias must be [heads, L, L] or [num_seqs, heads, L, L], got {tuple(bias.shape)}")
    if bias.dim() == 4 and bias.shape[0] != num_seqs:
        raise ValueError(f"per-sequence attention bias has {bias.shape[0]} rows for {num_seqs} sequences")
    if bias.shape[-1] < max_seqlen or bias.shape[-2] < max_seqlen:
        raise ValueError(f"attention bias covers {tuple(bias.shape[-2:])} positions, the batch needs {max_seqlen}")
    if not bias.is_floating_point():
        raise ValueError(f"attention bias must be a floating-point tensor, got {bias.dtype}")


class AttentionBackend(Attention):
    """Computes attention for packed q/k/v of shape [tokens, heads, head_dim]; k/v may have fewer heads (GQA)."""

    kind = "attention"
    Params = AttentionParams
    supports_bias: ClassVar[bool] = False
    """Whether `build_metadata` accepts an additive `bias` (see `check_bias`). A backend that leaves it False is
    never given one: models that need a bias refuse to build with it, and `auto` must not route a biased batch
    to it."""
    supports_window: ClassVar[bool] = False
    """Whether `build_metadata` accepts a local-attention `window` (see `Window`), under the same rules."""
    supports_key_mask: ClassVar[bool] = False
    """Whether the backend honours a batch's `key_mask` (see `check_key_mask`). The mask comes with the batch, not
    the model, so a backend that leaves it False refuses such a batch in `build_metadata` (by name) rather than
    attend the masked keys; `auto` must not route a masked batch to it."""
    bf16_products: bool = False
    """Whether float32 q/k/v take bfloat16 dot products (an instance's, once `use_bf16_products` turns it on)."""

    def __init__(self, params: AttentionParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self._config_causal = self._causal_from_config(ctx.source.hf_config)

    def use_bf16_products(self) -> bool:
        """Let float32 q/k/v take bfloat16 dot products from now on (rounded to bf16 as they are read; the softmax
        and the output stay float32), where the backend has such a path; returns whether it has. A float32 model
        never asks: an int8 model does (`PrefillModel._quantize`), before its fidelity gate measures what it
        serves. Only `cpu_flash_varlen` has one (and `auto`, for the batches it sends there)."""
        return False

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

    def build_metadata(self, batch: ModelInput, causal: bool, bias: torch.Tensor | None = None,
                       window: Window | None = None) -> AttentionMetadata:
        """The batch's metadata, built once per forward (per layer kind). `bias` is passed only to backends with
        `supports_bias`, `window` only to backends with `supports_window`; the batch's `key_mask` is refused
        here unless the backend has `supports_key_mask`."""
        key_mask = batch.key_mask
        if key_mask is not None:
            if not self.supports_key_mask:
                raise ValueError(f"attention backend {self.name!r} does not support a key mask (ModelInput.key_mask)")
            check_key_mask(key_mask, batch.num_tokens)
        if bias is not None:
            if not self.supports_bias:
                raise ValueError(f"attention backend {self.name!r} does not support an attention bias")
            check_bias(bias, batch.num_seqs, batch.max_seqlen)
        if window is not None:
            if not self.supports_window:
                raise ValueError(f"attention backend {self.name!r} does not support local (windowed) attention")
            check_window(window)
        return AttentionMetadata(batch.cu_seqlens, batch.seq_lens, batch.max_seqlen, causal, bias=bias, window=window,
                                 positions=batch.positions, key_mask=key_mask)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """Attention output of shape [tokens, q_heads, head_dim]."""
        raise NotImplementedError
