"""Post-norm BERT-style encoders with rotary positions over packed tokens: NomicBERT and GTE (gte-multilingual).

Both are BERT's layout with the absolute position table replaced by RoPE on q/k and the MLP replaced by a gated
one: embeddings (word + token type) → LayerNorm, then per layer `x = LN(x + attn(x))`, `x = LN(x + mlp(x))`, and
no final norm. They differ in biases, activation and checkpoint names, which the subclasses give as data. q|k|v
and gate|up are fused projections (one GEMM each); both the transformers-native checkpoint names and the original
remote-code ones (`attn.Wqkv`/`fc11`/`fc12`, `attention.qkv_proj`/`up_gate_proj`) load.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

import torch
from torch import nn

from wde.components.attention.base import AttentionBackend, AttentionMetadata
from wde.components.base import BuildContext
from wde.components.model_input_builder import ModelInput
from wde.components.models.activations import activation
from wde.components.models.base import PrefillModel
from wde.components.models.bert import BertEmbeddings
from wde.components.models.decoder_layers import DecoderAttention, DecoderModel
from wde.components.models.fused import add_layer_norm
from wde.components.models.loader import fused_linear
from wde.components.models.rotary import RotaryEmbedding
from wde.errors import ModelLoadError


class EncoderGatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))` with gate and up fused into one projection: `gate_up_proj` (gate rows first)
    or, with `up_first`, `up_gate_proj` (up rows first: GTE's original checkpoint layout, so it loads whole)."""

    def __init__(self, cfg: Any, *, gate_up_bias: bool, down_bias: bool, up_first: bool = False) -> None:
        super().__init__()
        self.size = int(cfg.intermediate_size)
        self.up_first = up_first
        self._fused = "up_gate_proj" if up_first else "gate_up_proj"
        setattr(self, self._fused, fused_linear(cfg.hidden_size, [self.size] * 2, bias=gate_up_bias))
        self.down_proj = nn.Linear(self.size, cfg.hidden_size, bias=down_bias)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = getattr(self, self._fused)(x).split(self.size, dim=-1)
        gate, up = (b, a) if self.up_first else (a, b)
        return self.down_proj(self.act(gate) * up)


class RotaryEncoderLayer(nn.Module):
    """Post-norm block: `x = LN(x + attn(x))`, then `LN(x + mlp(x))` (each add + norm one kernel on CUDA)."""

    def __init__(self, cfg: Any, backend: AttentionBackend, *, qkv_bias: bool, o_bias: bool, gate_up_bias: bool,
                 down_bias: bool, up_first: bool = False) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, backend, qkv_bias, o_bias)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = EncoderGatedMLP(cfg, gate_up_bias=gate_up_bias, down_bias=down_bias, up_first=up_first)
        self.post_mlp_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = add_layer_norm(self.self_attn(x, cos, sin, meta), x, self.post_attention_layernorm)
        return add_layer_norm(self.mlp(x), x, self.post_mlp_layernorm)


def refuse_settings(raw: dict, supported: dict[str, tuple], where: str) -> None:
    """Refuse, by name, every key of the raw `config.json` whose value is not one WDE implements (a key that is
    absent takes the reference's default, which is supported)."""
    for key, allowed in supported.items():
        if key in raw and raw[key] not in allowed:
            shown = " or ".join(repr(a) for a in allowed)
            raise ModelLoadError(f"{where}: config sets {key}={raw[key]!r}, which WDE does not implement (supported:"
                                 f" {shown})")


class RotaryEncoderModel(PrefillModel):
    """The shared stack: embeddings (+ LayerNorm), post-norm rotary layers, no final norm; bidirectional.

    Subclasses name the config `model_types` they serve, the biases of their projections, and `spec(cfg, raw)`:
    the config normalized to the names the blocks read (`hidden_size`, `num_attention_heads`, `head_dim`,
    `intermediate_size`, `hidden_act`, `layer_norm_eps`, `type_vocab_size`, `vocab_size`, `rope`: the
    `RotaryEmbedding`), refusing what is not implemented.
    """

    uses_cpu_ops = True  # RotaryEncoderLayer's add_layer_norm
    biases: ClassVar[dict[str, bool]] = {}
    """`qkv_bias`, `o_bias`, `gate_up_bias`, `down_bias` of every layer."""
    up_first: ClassVar[bool] = False

    def read_config(self, ctx: BuildContext) -> None:
        self.spec = self.read_spec(ctx.source.hf_config, ctx.source.read_json("config.json") or {},
                                   str(ctx.source.path / "config.json"))

    def read_spec(self, cfg: Any, raw: dict, where: str) -> SimpleNamespace:
        raise NotImplementedError

    @property
    def hidden_size(self) -> int:
        return int(self.spec.hidden_size)

    def build(self, cfg: Any) -> None:
        spec = self.spec
        self.embeddings = BertEmbeddings(spec, positions=False, token_types=spec.type_vocab_size > 0, layer_norm=True)
        self.layers = nn.ModuleList(
            RotaryEncoderLayer(spec, self.attn_backend, up_first=self.up_first, **self.biases)
            for _ in range(spec.num_hidden_layers))
        self.rotary_emb = spec.rope()

    def forward(self, batch: ModelInput) -> torch.Tensor:
        meta = self.attention_metadata(batch)
        x = self.embeddings(batch)
        cos, sin = self.rotary_emb(batch.positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, meta)
        return x


def _head_dim(cfg: Any, hidden: int, heads: int) -> int:
    return int(getattr(cfg, "head_dim", None) or hidden // heads)


NOMIC_ORIGINAL_SETTINGS: dict[str, tuple] = {
    # the original (remote-code, contrastors) config keys and the values the released checkpoints use, which is
    # what transformers' NomicBertModel computes; anything else changes the math and is refused by name
    "activation_function": ("swiglu",),
    "rotary_emb_fraction": (1.0, 1),
    "rotary_emb_interleaved": (False,),
    "rotary_scaling_factor": (None,),
    "rotary_emb_scale_base": (None,),
    "prenorm": (False,),
    "use_rms_norm": (False,),
    "qkv_proj_bias": (False,),
    "mlp_fc1_bias": (False,),
    "mlp_fc2_bias": (False,),
    "causal": (False,),
    "parallel_block": (False,),
    "scale_attn_weights": (True,),
    "scale_attn_by_inverse_layer_idx": (False,),
    "moe_every_n_layers": (0, None),
    "num_experts": (0, 1, None),
}


class NomicBertModel(RotaryEncoderModel):
    """NomicBERT (nomic-embed-text-v1 / v1.5): bias-free projections, SwiGLU MLP (`fc11` up, `fc12` gate),
    half-split RoPE over whole heads (theta 1000 by default), post-norm LayerNorms.

    Reads transformers' `NomicBertConfig` names (`hidden_size`, `rope_parameters`, ...) and the original
    remote-code ones the hub folders ship (`n_embd`, `n_layer`, `n_head`, `n_inner`, `rotary_emb_base`,
    `layer_norm_epsilon`); original settings other than the released models' (interleaved or partial rotary,
    rotary scaling, pre-norm, RMSNorm, biases, MoE layers) are refused by name.
    """

    name = "nomic_bert"
    model_types = ("nomic_bert",)
    checkpoint_prefixes = ("nomic_bert.", "bert.")
    checkpoint_name_mapping = {
        "encoder.layers": "layers",
        "emb_ln": "embeddings.LayerNorm",
        "attn.Wqkv": "self_attn.qkv_proj",
        "attn.out_proj": "self_attn.o_proj",
        "mlp.fc11": "mlp.up_proj",
        "mlp.fc12": "mlp.gate_proj",
        "mlp.fc2": "mlp.down_proj",
        "norm1": "post_attention_layernorm",
        "norm2": "post_mlp_layernorm",
    }
    packed_modules_mapping = DecoderModel.packed_modules_mapping  # the same fused q|k|v and gate|up
    biases = {"qkv_bias": False, "o_bias": False, "gate_up_bias": False, "down_bias": False}

    def read_spec(self, cfg: Any, raw: dict, where: str) -> SimpleNamespace:
        refuse_settings(raw, NOMIC_ORIGINAL_SETTINGS, where)

        def value(hf_key: str, original_key: str) -> Any:
            """transformers' key when the file has it, else the original key, else transformers' default."""
            if hf_key in raw or original_key not in raw:
                return getattr(cfg, hf_key, None)
            return raw[original_key]

        original = "n_embd" in raw and "hidden_size" not in raw
        hidden = int(value("hidden_size", "n_embd"))
        heads = int(value("num_attention_heads", "n_head"))
        inner = value("intermediate_size", "n_inner")
        if inner is None:
            raise ModelLoadError(f"{where}: n_inner is not set; WDE needs the MLP width")
        act = getattr(cfg, "hidden_act", "silu") if not original else "silu"  # original: swiglu = silu-gated
        eps = float(value("layer_norm_eps", "layer_norm_epsilon"))
        head_dim = _head_dim(cfg, hidden, heads) if not original else hidden // heads
        spec = SimpleNamespace(
            vocab_size=int(cfg.vocab_size), hidden_size=hidden,
            num_hidden_layers=int(value("num_hidden_layers", "n_layer")), num_attention_heads=heads,
            num_key_value_heads=heads, head_dim=head_dim, intermediate_size=int(inner), hidden_act=act,
            layer_norm_eps=eps, type_vocab_size=int(getattr(cfg, "type_vocab_size", 2) or 0))
        has_rope = any(k in raw for k in ("rope_parameters", "rope_theta", "rope_scaling"))
        if "rotary_emb_base" in raw and not has_rope:
            theta = float(raw["rotary_emb_base"])
            spec.rope = lambda: RotaryEmbedding(head_dim, theta)
        else:
            spec.rope = lambda: RotaryEmbedding.from_config(cfg, head_dim)
        return spec


GTE_ORIGINAL_SETTINGS: dict[str, tuple] = {
    # keys of the original (remote-code "new") config that change the math when not these values
    "position_embedding_type": ("rope",),
    "layer_norm_type": ("layer_norm",),
    "logn_attention_scale": (False,),
    "logn_attention_clip1": (False,),
}


class GteModel(RotaryEncoderModel):
    """GTE v1.5 / gte-multilingual (transformers' `GteModel`): biases on q|k|v, o and down but not on gate|up,
    gated MLP (`up_gate_proj`: up rows first), half-split RoPE (theta 160000 by default), token types when
    `type_vocab_size` > 0, post-norm LayerNorms (`layer_norm_eps`).

    Loads transformers-native names and the original ones (`new.` prefix, `encoder.layer`, `attention.qkv_proj`,
    `mlp.up_gate_proj`, `attn_ln`, `mlp_ln`); NTK / dynamic RoPE scaling and log-n attention scaling are refused.
    """

    name = "gte"
    model_types = ("gte",)
    checkpoint_prefixes = ("gte.", "new.")
    checkpoint_name_mapping = {
        "encoder.layer": "layers",
        "attention.qkv_proj": "self_attn.qkv_proj",
        "attention.o_proj": "self_attn.o_proj",
        "attn_ln": "post_attention_layernorm",
        "mlp_ln": "post_mlp_layernorm",
    }
    packed_modules_mapping = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", 1),
        "self_attn.v_proj": ("self_attn.qkv_proj", 2),
        "mlp.up_proj": ("mlp.up_gate_proj", 0),
        "mlp.gate_proj": ("mlp.up_gate_proj", 1),
    }
    biases = {"qkv_bias": True, "o_bias": True, "gate_up_bias": False, "down_bias": True}
    up_first = True

    def read_spec(self, cfg: Any, raw: dict, where: str) -> SimpleNamespace:
        refuse_settings(raw, GTE_ORIGINAL_SETTINGS, where)
        hidden, heads = int(cfg.hidden_size), int(cfg.num_attention_heads)
        head_dim = _head_dim(cfg, hidden, heads)
        return SimpleNamespace(
            vocab_size=int(cfg.vocab_size), hidden_size=hidden, num_hidden_layers=int(cfg.num_hidden_layers),
            num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
            intermediate_size=int(cfg.intermediate_size), hidden_act=cfg.hidden_act,
            layer_norm_eps=float(cfg.layer_norm_eps), type_vocab_size=int(getattr(cfg, "type_vocab_size", 0) or 0),
            rope=lambda: RotaryEmbedding.from_config(cfg, head_dim))
