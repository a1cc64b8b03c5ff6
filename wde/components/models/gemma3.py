"""Gemma 3 text encoders over packed tokens: EmbeddingGemma (google/embeddinggemma-300m) and any `Gemma3TextModel`.

EmbeddingGemma is transformers' `Gemma3TextModel` with `use_bidirectional_attention: true`, shipped as a
sentence-transformers folder (Transformer → Pooling(mean) → Dense → Dense → Normalize, with task prompts); the
`sentence` pooler runs everything after the Transformer. What differs from the Llama stack, all as transformers'
modeling_gemma3.py computes it:

- the token embeddings are scaled by `sqrt(hidden_size)`, the factor rounded to the embedding dtype;
- every RMSNorm scales by `1 + weight` (weights stored zero-centred), computed in float32 then cast back;
- per-head RMSNorms on q and k (`q_norm`, `k_norm`) before RoPE; scores scaled by `query_pre_attn_scalar ** -0.5`
  (not `head_dim ** -0.5`); grouped-query attention;
- four norms per layer: `input_layernorm` before attention, `post_attention_layernorm` on its output (before the
  residual add), `pre_feedforward_layernorm` / `post_feedforward_layernorm` around the GeGLU MLP
  (`gelu_pytorch_tanh`), and a final `norm`;
- `layer_types`: `sliding_attention` layers attend within a window and use the local RoPE base
  (`rope_local_base_freq`, i.e. `rope_parameters["sliding_attention"]`), `full_attention` layers attend everything
  with the global base. One `RotaryEmbedding` per layer kind and one attention metadata per window, each built
  once per batch, through the public seams (`RotaryEmbedding.from_config(..., layer_type=)`, `attention_window`).

The window: transformers' config halves `sliding_window` for a bidirectional model (`sliding_window // 2 + 1`,
"exclusive bounds"), and its bidirectional sliding mask lets query i attend key j when `|i - j| < sliding_window`
(that halved value): the window is `(sliding_window - 1, sliding_window - 1)` of the loaded config, i.e. half the
`sliding_window` written in config.json on each side. A causal Gemma 3 config keeps `sliding_window` as written and
masks `i - j < sliding_window`: the same `(sliding_window - 1, ...)` left reach, the right side masked by `causal`.
The mask is bidirectional when the config says `use_bidirectional_attention` (EmbeddingGemma), else causal; the
workflow's `attention.params.causal` overrides it.
"""

from __future__ import annotations

import torch
from torch import nn

from wde.components.attention.base import AttentionBackend, AttentionMetadata, Window
from wde.components.base import BuildContext
from wde.components.model_input_builder import ModelInput
from wde.components.models.base import PrefillModel
from wde.components.models.config_view import ConfigView
from wde.components.models.decoder_layers import DecoderModel, GatedMLP
from wde.components.models.fused import gemma_norm_add_norm, gemma_rms_norm
from wde.components.models.loader import fused_linear
from wde.components.models.rotary import RotaryEmbedding
from wde.errors import ModelLoadError

LAYER_KINDS = ("full_attention", "sliding_attention")


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: `norm(x) * (1 + weight)` in float32, cast back to the input dtype (weights are stored
    zero-centred, so a fresh norm is the identity scale)."""

    def __init__(self, dim: int, eps: float, feeds_linear: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = float(eps)
        self.feeds_linear = feeds_linear
        """Whether linear layers take this norm's output (a block's input norms; not the final norm)."""

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The norm (one C++ pass on CPU); `out_dtype` as `add_rms_norm`'s, where `feeds_linear`."""
        return gemma_rms_norm(x, self.weight, self.eps, out_dtype if self.feeds_linear else None)


class Gemma3Attention(nn.Module):
    """Grouped-query attention with fused q|k|v, per-head q/k RMSNorm, RoPE of the layer's kind, and
    `query_pre_attn_scalar ** -0.5` as the score scale."""

    def __init__(self, cfg: object, backend: AttentionBackend, head_dim: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = head_dim
        self.scale = float(cfg.query_pre_attn_scalar) ** -0.5
        bias = bool(getattr(cfg, "attention_bias", False))
        self.sizes = [self.num_heads * head_dim] + [self.num_kv_heads * head_dim] * 2
        self.qkv_proj = fused_linear(cfg.hidden_size, self.sizes, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim, cfg.rms_norm_eps)
        self.backend = backend
        self.rotary = rotary

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        rotary = self.rotary
        cos, sin = meta.cached(("rotary", id(rotary), q.dtype), lambda: rotary(meta.positions, q.dtype))
        q, k = rotary.apply(q, cos, sin), rotary.apply(k, cos, sin)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q.to(v.dtype), k.to(v.dtype), v, meta, self.scale)
        return self.o_proj(out.reshape(x.shape[0], -1))


class Gemma3Layer(nn.Module):
    """`h = x + post_attn_norm(attn(input_norm(x)))`, then `h + post_ff_norm(mlp(pre_ff_norm(h)))`; a
    `sliding_attention` layer has an `attention_window`. Computed as the sandwiches between sub-blocks (`forward`)."""

    def __init__(self, cfg: object, backend: AttentionBackend, head_dim: int, rotary: RotaryEmbedding,
                 window: Window | None) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = Gemma3Attention(cfg, backend, head_dim, rotary)
        self.mlp = GatedMLP(ConfigView(cfg, hidden_act=cfg.hidden_activation), bias=False)  # GeGLU
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, feeds_linear=True)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, feeds_linear=True)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.attention_window = window

    def forward(self, normed: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata, after: GemmaRMSNorm,
                linear_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`normed` is `input_layernorm(x)` (the block before computed it); returns (`after(out)`, `out`) for this
        block's output `out`, `after` being the next block's input norm or the final norm. Each norm after a
        sub-block, the residual add and the norm before the next one are one kernel pass (`gemma_norm_add_norm`)."""
        attn = self.self_attn(normed, meta)
        normed, h = gemma_norm_add_norm(attn, x, *_w(self.post_attention_layernorm),
                                        *_w(self.pre_feedforward_layernorm), linear_dtype)
        mlp = self.mlp(normed)
        return gemma_norm_add_norm(mlp, h, *_w(self.post_feedforward_layernorm), *_w(after),
                                   linear_dtype if after.feeds_linear else None)


def _w(norm: GemmaRMSNorm) -> tuple[torch.Tensor, float]:
    return norm.weight, norm.eps


def gemma3_window(cfg: object) -> Window:
    """The (left, right) window of a `sliding_attention` layer of this (loaded) config; see the module docstring."""
    sw = getattr(cfg, "sliding_window", None)
    if not isinstance(sw, int) or isinstance(sw, bool) or sw < 1:
        raise ModelLoadError(f"the config has sliding_attention layers but sliding_window is {sw!r}")
    return (sw - 1, sw - 1)


class Gemma3TextModel(PrefillModel):
    """Gemma 3 text stack (`Gemma3TextModel`, and the `model.` part of `Gemma3ForCausalLM`): bidirectional when
    the config says `use_bidirectional_attention` (EmbeddingGemma), else causal. Refuses `attn_logit_softcapping`
    (no backend caps scores) and layer kinds other than full / sliding attention, by name."""

    name = "gemma3"
    uses_cpu_ops = True  # RMSNorm, rotary, GELU * up (kernels/cpu_ops.cpp), built at load on CPU
    checkpoint_prefixes = ("model.",)
    packed_modules_mapping = DecoderModel.packed_modules_mapping  # the same fused q|k|v and gate|up
    uses_attention_window = True
    model_types = ("gemma3_text",)

    def read_config(self, ctx: BuildContext) -> None:
        cfg = ctx.source.hf_config
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            raise ModelLoadError(f"the config sets attn_logit_softcapping={cfg.attn_logit_softcapping}, which no WDE"
                                 " attention backend implements (EmbeddingGemma leaves it null)")
        # the family default, before PrefillModel resolves the mask (workflow param > config > this)
        self.default_causal = not bool(getattr(cfg, "use_bidirectional_attention", False))

    def build(self, cfg: object) -> None:
        kinds = list(getattr(cfg, "layer_types", None) or [])
        unknown = sorted(set(kinds) - set(LAYER_KINDS))
        if unknown or len(kinds) != cfg.num_hidden_layers:
            raise ModelLoadError(f"layer_types {kinds} must name {cfg.num_hidden_layers} layers among {LAYER_KINDS}")
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        window = gemma3_window(cfg) if "sliding_attention" in kinds else None
        self.rotary = nn.ModuleDict({kind: RotaryEmbedding.from_config(cfg, head_dim, layer_type=kind)
                                     for kind in dict.fromkeys(kinds)})
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3Layer(cfg, self.attn_backend, head_dim, self.rotary[kind],
                        window if kind == "sliding_attention" else None) for kind in kinds)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # sqrt(hidden) rounded to the model's dtype, as transformers' `embed_scale.to(weight.dtype)` does
        self.embed_scale = float(torch.tensor(cfg.hidden_size ** 0.5, dtype=self.dtype))

    def position_table_size(self, cfg: object) -> int | None:
        return None  # rotary: no table to overrun (the tokenizer still caps at max_position_embeddings)

    def forward(self, batch: ModelInput) -> torch.Tensor:
        windows = [layer.attention_window for layer in self.layers]
        metas = {w: self.attention_metadata(batch, None, w) for w in dict.fromkeys(windows)}
        x = self.embed_tokens(batch.input_ids) * self.embed_scale
        linear_dtype = self.linear_input_dtype
        norms = [layer.input_layernorm for layer in self.layers] + [self.norm]  # each block's input, then the final
        normed = norms[0](x, linear_dtype)
        for layer, window, after in zip(self.layers, windows, norms[1:]):
            normed, x = layer(normed, x, metas[window], after, linear_dtype)
        return normed
