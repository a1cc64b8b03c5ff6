"""Decoder-only transformer layers over packed tokens (Llama, Mistral, Qwen2), and the stack they share.

Packed tokens carry their own 0-based position within their sequence (`ModelInput.positions`), so rotary
embeddings (wde/components/models/rotary.py; `RotaryEmbedding` and `apply_rotary` stay importable from here) are
looked up per token and no padding is ever made. q|k|v and gate|up are fused projections:
one GEMM each instead of three and two.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from wde.components.attention.base import AttentionBackend, AttentionMetadata
from wde.components.base import BuildContext
from wde.components.model_input_builder import ModelInput
from wde.components.models.activations import activation
from wde.components.models.base import PrefillModel
from wde.components.models.fused import add_rms_norm, silu_mul
from wde.components.models.loader import fused_linear
from wde.components.models.rotary import (  # noqa: F401 (the first three re-exported)
    STATIC_ROPE_TYPES, RotaryEmbedding, apply_rotary, norm_rotary)
from wde.errors import ModelLoadError


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as the reference models do, then scaled in the input dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), one kernel on CUDA and CPU; `out_dtype`: the dtype the linear layer
        taking the normed output casts it to (`fused.add_rms_norm`)."""
        return add_rms_norm(x, residual, self.weight, self.eps, out_dtype)


class DecoderAttention(nn.Module):
    """Grouped-query attention with rotary q/k; k/v may have fewer heads than q."""

    def __init__(self, cfg: object, backend: AttentionBackend, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads)
        self.scale = self.head_dim ** -0.5
        self.sizes = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
        self.qkv_proj = fused_linear(cfg.hidden_size, self.sizes, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=o_bias)
        self.backend = backend

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q_norm, k_norm = self.qk_norms()  # norm, rotary and the cast to v's dtype: one pass on CPU
        q = norm_rotary(q.reshape(-1, self.num_heads, self.head_dim), *_weight_eps(q_norm), cos, sin, v.dtype)
        k = norm_rotary(k.reshape(-1, self.num_kv_heads, self.head_dim), *_weight_eps(k_norm), cos, sin, v.dtype)
        return self.attend(q, k, v, meta)

    def qk_norms(self) -> tuple[RMSNorm | None, RMSNorm | None]:
        """The RMSNorms over each head's q and k before RoPE (Qwen3's `q_norm`, `k_norm`), or none."""
        return None, None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention in v's dtype, then the output projection. In a mixed-precision model v leaves its linear
        layer in the low dtype while float32 rotary tables (or q/k norms) promote q and k to float32."""
        out = self.backend.forward(q.to(v.dtype), k.to(v.dtype), v, meta, self.scale)
        return self.o_proj(out.reshape(q.shape[0], -1))


def _weight_eps(norm: RMSNorm | None) -> tuple[torch.Tensor | None, float]:
    return (None, 0.0) if norm is None else (norm.weight, norm.eps)


class GatedMLP(nn.Module):
    """SwiGLU-style MLP: down(act(gate(x)) * up(x)), with gate|up fused into one projection."""

    def __init__(self, cfg: object, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = int(cfg.intermediate_size)
        self.gate_up_proj = fused_linear(cfg.hidden_size, [self.intermediate_size] * 2, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, cfg.hidden_size, bias=bias)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x), self.act))


class DecoderLayer(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)), then h + mlp(norm(h)); the residual add and the second norm are one
    step (one kernel on CUDA). `attention_cls` lets a family swap the attention (Qwen3 adds q/k norms)."""

    attention_cls: ClassVar[type[DecoderAttention]] = DecoderAttention

    def __init__(self, cfg: object, backend: AttentionBackend, attn_biases: tuple[bool, bool], mlp_bias: bool) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(cfg, backend, *attn_biases)
        self.mlp = GatedMLP(cfg, mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, linear_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream before it): the next layer (or the final norm) adds the two in its
        norm's kernel, as vLLM's layers do, instead of a pass of its own here. `linear_dtype`: the dtype the linear
        layers cast their input to (`PrefillModel.linear_input_dtype`); the norms write their output in it."""
        normed, residual = self.input_layernorm(x, residual, linear_dtype)
        normed, residual = self.post_attention_layernorm(self.self_attn(normed, cos, sin, meta), residual,
                                                         linear_dtype)
        return self.mlp(normed), residual


def sliding_window(cfg: object) -> int | None:
    """The attention window the config applies to at least one layer, or None when every layer sees all tokens."""
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


class DecoderModel(PrefillModel):
    """The decoder stack shared by Llama, Mistral and Qwen2: embeddings, layers, final norm.

    Subclasses name the config `model_types` they serve (loading a Qwen2 checkpoint into a bias-free Llama
    would silently drop weights) and which attention projections have biases. Sliding-window attention is not implemented:
    a model whose window is shorter than the longest input the tokenizer allows is refused at build time, so
    every accepted input fits in the window and is computed exactly.
    """

    checkpoint_prefixes = ("model.",)
    packed_modules_mapping = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", 1),
        "self_attn.v_proj": ("self_attn.qkv_proj", 2),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", 1),
    }
    default_causal = True
    uses_cpu_ops = True  # add + RMSNorm, rotary and SiLU * up (kernels/cpu_ops.cpp), built at load on CPU
    lora_embedding_modules = ("embed_tokens",)
    layer_cls: ClassVar[type[DecoderLayer]] = DecoderLayer

    def read_config(self, ctx: BuildContext) -> None:
        window = sliding_window(ctx.source.hf_config)
        if window is not None and ctx.tokenizer.max_length > window:
            raise ModelLoadError(
                f"the config uses sliding-window attention (window {window} tokens), which WDE does not implement,"
                f" and inputs of up to {ctx.tokenizer.max_length} tokens are allowed; set"
                f" tokenizer.params.max_length <= {window} so every input fits in the window")

    def attention_biases(self, cfg: object) -> tuple[bool, bool]:
        """Whether the q/k/v projection and the output projection have biases."""
        bias = bool(getattr(cfg, "attention_bias", False))
        return bias, bias

    def build(self, cfg: object) -> None:
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        biases, mlp_bias = self.attention_biases(cfg), bool(getattr(cfg, "mlp_bias", False))
        self.layers = nn.ModuleList(self.layer_cls(cfg, self.attn_backend, biases, mlp_bias)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding.from_config(cfg, self.layers[0].self_attn.head_dim)

    def forward(self, batch: ModelInput) -> torch.Tensor:
        meta = self.attn_backend.build_metadata(batch, self.causal)
        x = self.embed_tokens(batch.input_ids)
        cos, sin = self.rotary_emb(batch.positions, x.dtype)
        linear_dtype, residual = self.linear_input_dtype, None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, meta, linear_dtype)
        return self.norm(x, residual)[0]
