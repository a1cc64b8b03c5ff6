"""Rotary position embeddings (RoPE) for packed q/k.

Packed tokens carry their own 0-based position within their sequence (`ModelInput.positions`), so the cos/sin
tables are looked up per token, once per batch, and broadcast over heads: q and k are `[tokens, heads, head_dim]`.

Two layouts of the rotated pairs exist in checkpoints, and a model must use the one it was trained with:

- **half-split** (GPT-NeoX, Llama, Qwen, NomicBERT, GTE, EuroBERT; `interleaved=False`): feature `i` pairs with
  feature `i + rotary_dim / 2`;
- **interleaved** (GPT-J, the original flash-attn `interleaved=True`): features `2i` and `2i + 1` pair.

With `rotary_dim < head_dim` (partial rotary, GPT-NeoX's `rotary_pct`, GPT-J's `rotary_dim`) only the first
`rotary_dim` features of each head rotate; the rest pass through. One instance has one theta: a model whose layers
use different thetas (local and global layers) makes one instance per distinct theta and computes each table once
per batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from wde.errors import ModelLoadError

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""RoPE variants whose frequencies do not depend on the sequence length (dynamic/longrope ones do)."""


class RotaryEmbedding(nn.Module):
    """The cos/sin tables of rotary position embeddings, per packed token, and how to apply them.

    :param head_dim: per-head width of q and k.
    :param theta: the base of the frequencies (`rope_theta`).
    :param rotary_dim: how many leading features of each head rotate (even, at most `head_dim`); default all.
    :param interleaved: rotate adjacent pairs (GPT-J) instead of the two halves (GPT-NeoX / Llama).
    :param inv_freq: ready inverse frequencies (`rotary_dim / 2` of them) instead of `theta`'s, e.g. from a
        scaled RoPE; `attention_scaling` then multiplies cos and sin (YaRN).

    Call it as `rotary(positions, dtype) -> (cos, sin)`, each `[tokens, 1, rotary_dim]`, once per batch, then
    `rotary.apply(x, cos, sin)` on q and on k. `RotaryEmbedding.from_config(cfg, head_dim)` reads a Hugging Face
    config's `rope_parameters` (or `rope_theta`).
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, *, rotary_dim: int | None = None,
                 interleaved: bool = False, inv_freq: torch.Tensor | None = None,
                 attention_scaling: float = 1.0) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else int(rotary_dim)
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ModelLoadError(f"rotary_dim must be an even number in 2..head_dim ({head_dim}), got {rotary_dim}")
        if inv_freq is None:
            if not theta > 0:
                raise ModelLoadError(f"rope theta must be positive, got {theta!r}")
            inv_freq = 1.0 / (float(theta) ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        if inv_freq.shape != (rotary_dim // 2,):
            raise ModelLoadError(f"inv_freq has shape {tuple(inv_freq.shape)}, rotary_dim {rotary_dim} needs"
                                 f" ({rotary_dim // 2},)")
        self.head_dim = int(head_dim)
        self.rotary_dim = rotary_dim
        self.theta = float(theta)
        self.interleaved = bool(interleaved)
        self.attention_scaling = float(attention_scaling)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    @classmethod
    def from_config(cls, cfg: Any, head_dim: int, *, theta: float | None = None, rotary_dim: int | None = None,
                    interleaved: bool = False, layer_type: str | None = None) -> "RotaryEmbedding":
        """The rotary embedding a Hugging Face config describes: `rope_parameters` (transformers 5; per layer type
        when nested, pick one with `layer_type`) or `rope_theta`; `theta` overrides the config's. Scaled variants
        whose frequencies are fixed (linear, llama3, yarn) come from transformers' own `ROPE_INIT_FUNCTIONS`; any
        other `rope_type` (dynamic, longrope, ntk, ...) is refused by name."""
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        if rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type (Gemma 3, ModernBERT)
            if layer_type is None or layer_type not in rope:
                raise ModelLoadError(f"rope_parameters are given per layer type ({', '.join(rope)}); pass"
                                     f" layer_type= one of them, got {layer_type!r}")
            rope = dict(rope[layer_type])
        elif layer_type is not None and rope:
            layer_type = None  # one set of parameters for every layer
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in STATIC_ROPE_TYPES:
            raise ModelLoadError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}")
        if rope_type == "default":
            if theta is None:
                theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", None) or 10000.0))
            return cls(head_dim, theta, rotary_dim=rotary_dim, interleaved=interleaved)
        if theta is not None:
            raise ModelLoadError(f"a theta override applies to the default RoPE only; the config's is {rope_type!r}")
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        kwargs = {"layer_type": layer_type} if layer_type is not None else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, **kwargs)
        dim = rotary_dim if rotary_dim is not None else 2 * inv_freq.shape[0]
        return cls(head_dim, float(rope.get("rope_theta", 10000.0)), rotary_dim=dim, interleaved=interleaved,
                   inv_freq=inv_freq, attention_scaling=scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [tokens, 1, rotary_dim] (float32 angles, then cast to `dtype`)."""
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]
        if self.interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)[:, None, :]
        else:
            emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`x` ([tokens, heads, head_dim]) rotated by this embedding's tables, in its layout."""
        return apply_rotary(x, cos, sin, interleaved=self.interleaved)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, theta={self.theta:g},"
                f" {'interleaved' if self.interleaved else 'half-split'}")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate `x` ([tokens, heads, head_dim]) by per-token angles (`cos`/`sin`: [tokens, 1, rotary_dim]).

    Half-split by default (feature i pairs with i + rotary_dim/2), adjacent pairs with `interleaved`. When
    `rotary_dim < head_dim` only the first `rotary_dim` features rotate; the others are returned unchanged.
    """
    d = cos.shape[-1]
    if not interleaved and cos.dtype == x.dtype:  # one pass instead of six (kernels/cpu_ops.cpp), the same roundings
        rotated = _kernel_norm_rotary(x, None, 0.0, cos, sin, x.dtype)
        if rotated is not None:
            return rotated
    if d < x.shape[-1]:
        return torch.cat((_rotate(x[..., :d], cos, sin, interleaved), x[..., d:]), dim=-1)
    return _rotate(x, cos, sin, interleaved)


def norm_rotary(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """q or k ([tokens, heads, head_dim]) made ready for attention: RMSNorm over each head with `weight` (Qwen3's
    `q_norm` / `k_norm`; none: no norm), the half-split rotary embedding by the full-width tables `cos` / `sin`, then
    cast to `dtype` (the attention's). On CPU one C++ pass over each head's row computes what those three steps do
    in turn, the roundings included (in a mixed-precision model x is bfloat16 and the norm weight and tables
    float32: the steps run in float32 and only the result is rounded); elsewhere the three steps run."""
    rotated = _kernel_norm_rotary(x, weight, eps, cos, sin, dtype)
    if rotated is not None:
        return rotated
    if weight is not None:
        from wde.components.models.fused import add_rms_norm

        x = add_rms_norm(x, None, weight, eps)[0]
    return apply_rotary(x, cos, sin).to(dtype)


def _kernel_norm_rotary(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                        sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """`norm_rotary` through the C++ kernel, or None where it does not take the call or is not built."""
    if not _cpu_norm_rotary_fits(x, weight, cos, sin, dtype):
        return None
    from wde.kernels.cpp_build import cpu_ops

    kernel = cpu_ops()
    if kernel is None:
        return None
    d = x.shape[-1]
    return kernel.norm_rotary(x, weight, eps, cos.reshape(cos.shape[0], d), sin.reshape(sin.shape[0], d), dtype)


def _cpu_norm_rotary_fits(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                          dtype: torch.dtype) -> bool:
    """Whether `norm_rotary`'s C++ kernel takes this call: CPU, x [tokens, heads, d] with its last dimension
    contiguous, cos and sin [tokens, 1, d] of one dtype, the weight [d], every dtype float32 or bfloat16, the result
    in the promoted dtype or bfloat16 (inference)."""
    lowp = (torch.float32, torch.bfloat16)
    promoted = torch.bfloat16 if {x.dtype, cos.dtype, *(() if weight is None else (weight.dtype,))} == {
        torch.bfloat16} else torch.float32
    return (x.device.type == "cpu" and x.dim() == 3 and x.stride(-1) == 1 and x.dtype in lowp and cos.dtype in lowp
            and dtype in (promoted, torch.bfloat16) and sin.dtype == cos.dtype and cos.dim() == 3 and cos.shape[1] == 1
            and cos.shape == sin.shape and cos.shape[0] == x.shape[0] and cos.shape[-1] == x.shape[-1]
            and x.shape[-1] % 2 == 0 and cos.stride(-1) == 1 and sin.stride(-1) == 1
            and (weight is None or (weight.dtype in lowp and weight.shape == (x.shape[-1],) and weight.is_contiguous()))
            and not (torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad))))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
