"""Two-tower image-text embedders: CLIP (`CLIPModel`) and SigLIP (`SiglipModel`), a text tower and a vision tower in
one model, both ending in the shared embedding space.

Both towers are pre-norm transformers built from BERT's blocks (`BertAttention` with one fused q|k|v projection,
`BertIntermediate`, `BertSelfOutput` without a norm) over packed tokens, through the workflow's attention backend.
A batch may mix texts and images (`packed_multimodal` builds it, docs/images.md): `ModelInput.by_modality()` gives
each tower its own packed batch, and the embeddings are put back in batch order. An image is one sequence: its
patches (a stride-`patch_size` convolution), plus CLIP's class token, each with its learned position embedding.

- CLIP: text tower causal, pooled at the end-of-text token (the first `eos_token_id`, or where the config's
  `eos_token_id` is the legacy 2, the highest token id: transformers' two rules), final LayerNorm,
  `text_projection`; vision tower with a LayerNorm before the encoder (`pre_layrnorm`), pooled at the class token,
  `post_layernorm`, `visual_projection`. Activation `quick_gelu` by default.
- SigLIP: text tower bidirectional, pooled at the last position (padding included: the `siglip` workflow pads texts
  to the max length as SigLIP was trained), final LayerNorm, `head` (a linear layer); vision tower without a class
  token, `post_layernorm` on every patch, then the attention-pooling head (`head`: a learned probe attends to the
  image's patches, then LayerNorm + MLP with a residual). Activation `gelu_pytorch_tanh`.

`forward` returns the projected embedding of each sequence ([num_seqs, dim], `pools = True`), which the
`projected` pooler normalizes; they equal transformers' `get_text_features` / `get_image_features`
`pooler_output` (tests/test_clip_siglip.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from wde.components.attention.base import AttentionMetadata
from wde.components.base import BuildContext
from wde.components.model_input_builder import ModelInput
from wde.components.models.base import PrefillModel
from wde.components.models.bert import BertAttention, BertIntermediate, BertSelfOutput
from wde.components.params import ModelParams
from wde.components.pooler import segment_ids
from wde.errors import ModelLoadError


class TowerLayer(nn.Module):
    """`x + attn(layer_norm1(x))`, then `x + mlp(layer_norm2(x))`."""

    def __init__(self, cfg: object, backend: object) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attention = BertAttention(cfg, backend, post_norm=False)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertSelfOutput(cfg, cfg.intermediate_size, norm=False)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.attention(self.layer_norm1(x), meta, residual=x)
        return self.output(self.intermediate(self.layer_norm2(x)), x)


class TowerEncoder(nn.Module):
    def __init__(self, cfg: object, backend: object) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TowerLayer(cfg, backend) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, meta)
        return x


class TextEmbeddings(nn.Module):
    def __init__(self, cfg: object) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embedding = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)

    def forward(self, batch: ModelInput) -> torch.Tensor:
        return self.token_embedding(batch.input_ids) + self.position_embedding(batch.positions)


class TextTower(nn.Module):
    def __init__(self, cfg: object, backend: object, head: int | None = None) -> None:
        super().__init__()
        self.embeddings = TextEmbeddings(cfg)
        self.encoder = TowerEncoder(cfg, backend)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        if head is not None:
            self.head = nn.Linear(cfg.hidden_size, head)


class PatchEmbeddings(nn.Module):
    """An image's patches (a convolution with stride `patch_size`), behind a class token when `class_token`, each
    plus its position embedding: [num_images * tokens, hidden], image after image."""

    def __init__(self, cfg: object, *, class_token: bool, bias: bool) -> None:
        super().__init__()
        self.grid = cfg.image_size // cfg.patch_size
        if class_token:
            self.class_embedding = nn.Parameter(torch.empty(cfg.hidden_size))
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, kernel_size=cfg.patch_size,
                                         stride=cfg.patch_size, bias=bias)
        self.num_positions = self.grid ** 2 + int(class_token)
        self.position_embedding = nn.Embedding(self.num_positions, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.patch_embedding.weight
        x = self.patch_embedding(pixel_values.to(device=weight.device, dtype=weight.dtype))
        x = x.flatten(2).transpose(1, 2)  # [n, patches, hidden]
        if hasattr(self, "class_embedding"):
            x = torch.cat([self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1), x], dim=1)
        x = x + self.position_embedding.weight
        return x.reshape(-1, x.shape[-1])


class ProbeAttention(nn.Module):
    """`torch.nn.MultiheadAttention` of one learned query over each image's tokens (packed), with its parameter
    names (`in_proj_weight`, `in_proj_bias`, `out_proj`)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * hidden, hidden))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * hidden))
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, query: torch.Tensor, x: torch.Tensor, batch: ModelInput) -> torch.Tensor:
        if batch.key_mask is not None:  # its own softmax over every token: it would read the masked ones
            raise ValueError("SigLIP's attention-pooling head does not support a key mask (ModelInput.key_mask)")
        hidden, n = x.shape[1], batch.num_seqs
        w, b = self.in_proj_weight, self.in_proj_bias
        q = F.linear(query.to(w.dtype), w[:hidden], b[:hidden]).view(self.heads, self.head_dim)
        k, v = F.linear(x.to(w.dtype), w[hidden:], b[hidden:]).view(-1, 2, self.heads, self.head_dim).unbind(1)
        scores = (k.float() * q.float()).sum(-1) * self.head_dim ** -0.5  # [tokens, heads]
        if len(set(batch.seq_lens)) == 1:  # every image the same length (fixed-size models): no scatter needed
            weights = scores.view(n, -1, self.heads).softmax(dim=1)
            out = torch.einsum("nlh,nlhd->nhd", weights, v.float().view(n, -1, self.heads, self.head_dim))
        else:
            seg = segment_ids(batch)
            top = scores.new_full((n, self.heads), float("-inf")).scatter_reduce(
                0, seg[:, None].expand_as(scores), scores, "amax")
            e = (scores - top[seg]).exp()
            weights = e / e.new_zeros(n, self.heads).index_add_(0, seg, e)[seg]
            out = v.new_zeros(n, self.heads, self.head_dim, dtype=torch.float32).index_add_(
                0, seg, weights[..., None] * v.float())
        return self.out_proj(out.reshape(n, hidden).to(v.dtype))


class AttentionPoolingHead(nn.Module):
    """SigLIP's `SiglipMultiheadAttentionPoolingHead`: the probe attends to the image, then LayerNorm and MLP with a
    residual: one vector per image."""

    def __init__(self, cfg: object) -> None:
        super().__init__()
        self.probe = nn.Parameter(torch.empty(1, 1, cfg.hidden_size))
        self.attention = ProbeAttention(cfg.hidden_size, cfg.num_attention_heads)
        self.layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertSelfOutput(cfg, cfg.intermediate_size, norm=False)

    def forward(self, x: torch.Tensor, batch: ModelInput) -> torch.Tensor:
        h = self.attention(self.probe.view(1, -1), x, batch)
        return self.output(self.intermediate(self.layernorm(h)), h)


class VisionTower(nn.Module):
    def __init__(self, cfg: object, backend: object, *, clip: bool, embeddings: nn.Module | None = None) -> None:
        super().__init__()
        self.embeddings = embeddings if embeddings is not None else PatchEmbeddings(cfg, class_token=clip,
                                                                                    bias=not clip)
        if clip:
            self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)  # transformers' spelling
        self.encoder = TowerEncoder(cfg, backend)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        if not clip:
            self.head = AttentionPoolingHead(cfg)


class ClipModel(PrefillModel):
    """CLIPModel: both towers and both projections; `forward` gives one projected embedding per sequence."""

    name = "clip"
    checkpoint_name_mapping = {"self_attn.out_proj": "attention.output.dense", "mlp.fc1": "intermediate.dense",
                               "mlp.fc2": "output.dense"}
    packed_modules_mapping = {
        "self_attn.q_proj": ("attention.qkv", 0),
        "self_attn.k_proj": ("attention.qkv", 1),
        "self_attn.v_proj": ("attention.qkv", 2),
    }
    default_causal = True
    """The text tower's mask (CLIP's is causal); the vision tower always attends both ways."""
    pools = True
    """`forward` returns pooled, projected embeddings [num_seqs, dim] (for the `projected` pooler), not token states."""
    model_types = ("clip",)

    def build(self, cfg: object) -> None:
        text, vision = cfg.text_config, cfg.vision_config
        for part, c in (("text_config", text), ("vision_config", vision)):
            if c.hidden_size % c.num_attention_heads:
                raise ModelLoadError(f"{part}: num_attention_heads {c.num_attention_heads} does not divide"
                                     f" hidden_size {c.hidden_size}")
        self.check_vision(vision)
        self.build_towers(cfg)

    def check_vision(self, vision: object) -> None:
        """Refuse a vision config this tower cannot take (here: an image smaller than one patch). A patch size that
        does not divide the image is taken as transformers takes it (google/siglip-so400m-patch14-384: 27 x 27
        patches of 14 pixels): the stride-`patch_size` convolution leaves out the last pixels that fill no patch."""
        if not 0 < vision.patch_size <= vision.image_size:
            raise ModelLoadError(f"vision_config: patch_size {vision.patch_size} must be between 1 and image_size"
                                 f" {vision.image_size}")

    def build_towers(self, cfg: object) -> None:
        text, vision = cfg.text_config, cfg.vision_config
        self.text_model = TextTower(text, self.attn_backend)
        self.vision_model = VisionTower(vision, self.attn_backend, clip=True)
        self.text_projection = nn.Linear(text.hidden_size, cfg.projection_dim, bias=False)
        self.visual_projection = nn.Linear(vision.hidden_size, cfg.projection_dim, bias=False)
        self.eos_token_id = int(text.eos_token_id) if text.eos_token_id is not None else None

    @property
    def embedding_size(self) -> int:
        """Width of the shared text-image embedding space."""
        return int(self.config.projection_dim)

    @property
    def hidden_size(self) -> int:
        return self.embedding_size

    def position_table_size(self, cfg: object) -> int | None:
        return int(cfg.text_config.max_position_embeddings)

    def _quantize(self, params: ModelParams, ctx: BuildContext) -> str:
        """`quantization: int8` is refused: the fidelity gate runs text probes, so the vision tower's int8 layers
        would be neither calibrated (SmoothQuant's input maxima) nor measured, and images served unchecked."""
        if params.quantization == "int8":
            raise ModelLoadError(f"quantization=int8 does not cover model {self.name!r}: its fidelity gate probes"
                                 " texts only, so the vision tower would run int8 uncalibrated and unmeasured; use"
                                 " quantization: none")
        return super()._quantize(params, ctx)

    def forward(self, batch: ModelInput) -> torch.Tensor:
        text, images = batch.by_modality()
        if images is None:
            return self.text_features(batch)
        if text is None:
            return self.image_features(batch)
        (text_index, text_batch), (image_index, image_batch) = text, images
        t, i = self.text_features(text_batch), self.image_features(image_batch)
        out = t.new_empty(batch.num_seqs, t.shape[1], dtype=torch.promote_types(t.dtype, i.dtype))
        out[torch.tensor(text_index, device=out.device)] = t.to(out.dtype)
        out[torch.tensor(image_index, device=out.device)] = i.to(out.dtype)
        return out

    # -- text tower -------------------------------------------------------------------------------------------

    def text_states(self, batch: ModelInput) -> torch.Tensor:
        meta = self.attn_backend.build_metadata(batch, self.causal)
        return self.text_model.encoder(self.text_model.embeddings(batch), meta)

    def text_features(self, batch: ModelInput) -> torch.Tensor:
        """transformers' `get_text_features(...).pooler_output` for each sequence."""
        x = self.text_states(batch)
        pooled = self.text_model.final_layer_norm(x[self.text_pool_index(batch)])
        return self.text_projection(pooled)

    def text_pool_index(self, batch: ModelInput) -> torch.Tensor:
        """The packed index of each sequence's end-of-text token: the first `eos_token_id`, or with the legacy
        `eos_token_id` 2 the (first) highest token id; a sequence without one pools its first token, as
        transformers' argmax over no match does."""
        ids, cu = batch.input_ids, batch.cu_seqlens.long()
        seg = segment_ids(batch)
        if self.eos_token_id == 2:
            top = ids.new_full((batch.num_seqs,), torch.iinfo(ids.dtype).min).scatter_reduce(0, seg, ids, "amax")
            match = ids == top[seg]
        else:
            match = ids == self.eos_token_id
        n = ids.shape[0]
        where = torch.where(match, torch.arange(n, device=ids.device), n)
        first = torch.full((batch.num_seqs,), n, dtype=where.dtype, device=ids.device).scatter_reduce(
            0, seg, where, "amin")
        return torch.where(first == n, cu[:-1], first)

    # -- vision tower -----------------------------------------------------------------------------------------

    def image_states(self, batch: ModelInput) -> torch.Tensor:
        if batch.pixel_values is None:
            raise ValueError("an image batch without pixel_values")
        x = self.vision_model.embeddings(batch.pixel_values)
        if x.shape[0] != batch.num_tokens:
            raise ValueError(f"{batch.pixel_values.shape[0]} images make {x.shape[0]} vision tokens but the batch"
                             f" packs {batch.num_tokens}")
        if hasattr(self.vision_model, "pre_layrnorm"):
            x = self.vision_model.pre_layrnorm(x)
        meta = self.attn_backend.build_metadata(batch, False)
        return self.vision_model.encoder(x, meta)

    def image_features(self, batch: ModelInput) -> torch.Tensor:
        """transformers' `get_image_features(...).pooler_output` for each image."""
        x = self.image_states(batch)
        pooled = self.vision_model.post_layernorm(x[batch.cu_seqlens[:-1].long()])
        return self.visual_projection(pooled)


class SiglipModel(ClipModel):
    """SiglipModel: bidirectional text tower pooled at its last position through `text_model.head`; vision tower
    pooled by its attention-pooling head. Both heads end in the shared space (no separate projections)."""

    name = "siglip"
    default_causal = False
    model_types = ("siglip",)

    def build_towers(self, cfg: object) -> None:
        text, vision = cfg.text_config, cfg.vision_config
        if not getattr(vision, "vision_use_head", True):
            raise ModelLoadError("vision_config.vision_use_head is false: this SigLIP vision tower has no pooling head"
                                 " and gives no image embedding")
        size = getattr(text, "projection_size", None) or text.hidden_size
        if size != vision.hidden_size:
            raise ModelLoadError(f"text_config.projection_size {size} differs from vision_config.hidden_size"
                                 f" {vision.hidden_size}: the towers do not share one space")
        self.text_model = TextTower(text, self.attn_backend, head=size)
        self.vision_model = self.vision_tower(vision)
        self._embedding_size = int(size)

    def vision_tower(self, vision: object) -> VisionTower:
        return VisionTower(vision, self.attn_backend, clip=False)

    @property
    def embedding_size(self) -> int:
        return self._embedding_size

    def text_features(self, batch: ModelInput) -> torch.Tensor:
        x = self.text_states(batch)
        pooled = self.text_model.final_layer_norm(x[batch.cu_seqlens[1:].long() - 1])
        return self.text_model.head(pooled)

    def image_features(self, batch: ModelInput) -> torch.Tensor:
        x = self.vision_model.post_layernorm(self.image_states(batch))
        return self.vision_model.head(x, batch)
