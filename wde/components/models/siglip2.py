"""SigLIP 2 with NaFlex (`Siglip2Model`): SigLIP's text tower and pooling head, and a vision tower that takes each
image at its own aspect ratio as a grid of patches whose size varies per image (docs/images.md).

What differs from SigLIP (wde/components/models/clip.py) is the vision embeddings, after transformers'
`Siglip2VisionEmbeddings`: an image arrives already cut into patches ([h_patches, w_patches, 3 * p * p], by
wde/components/naflex.py), each patch is embedded by a Linear layer, and the learned position embeddings (a
sqrt(num_patches) square grid) are resized to the image's own grid with antialiased bilinear interpolation
(`resize_positional_embeddings`; how, and why not through `F.interpolate`: `antialiased_bilinear_weights`).
transformers pads every image to `max_num_patches` and masks the padding in the encoder and the pooling head with
`pixel_attention_mask`; WDE packs each image as a sequence of exactly its h x w patches through the same varlen
attention as texts, so there is no padding to mask, and the attention-pooling head attends to the image's own patches
only. The results equal transformers' `get_image_features` / `get_text_features` with the position embeddings resized
as the model was trained (tests/test_siglip2.py).

An image batch's `pixel_values` is [num_images, H, W, 3 * p * p], each image's grid at the top left (the
`packed_multimodal` builder zero-pads grids of different shapes to the largest); an image's placeholder token ids
hold its patch rows h, and its sequence length h x w gives w.
"""

from __future__ import annotations

import functools

import math

import torch
from torch import nn

from wde.components.model_input_builder import ModelInput
from wde.components.models.clip import SiglipModel, VisionTower
from wde.errors import ModelLoadError


class NaFlexEmbeddings(nn.Module):
    """Patch embedding (a Linear over each flattened patch) plus position embeddings resized to each image's grid:
    [total patches, hidden], image after image, each image's patches row by row."""

    def __init__(self, cfg: object) -> None:
        super().__init__()
        self.patch_size = int(cfg.patch_size)
        self.patch_embedding = nn.Linear(cfg.num_channels * self.patch_size ** 2, cfg.hidden_size)
        self.side = math.isqrt(int(cfg.num_patches))
        self.position_embedding = nn.Embedding(int(cfg.num_patches), cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        table = self.position_embedding.weight  # the patch Linear may be packed or cast: it casts its input itself
        height, width = pixel_values.shape[1:3]
        if all(grid == (height, width) for grid in grids):  # no padding: every image fills the tensor
            patches = pixel_values.reshape(-1, pixel_values.shape[-1])
        else:
            dev = pixel_values.device
            h = torch.tensor([g[0] for g in grids], device=dev)
            w = torch.tensor([g[1] for g in grids], device=dev)
            inside = (torch.arange(height, device=dev)[None, :, None] < h[:, None, None]) & \
                     (torch.arange(width, device=dev)[None, None, :] < w[:, None, None])
            patches = pixel_values[inside]  # [total, 3 * p * p]: image by image, row by row
        x = self.patch_embedding(patches.to(device=table.device, dtype=table.dtype))
        return x + self.positions(grids)

    def positions(self, grids: list[tuple[int, int]]) -> torch.Tensor:
        """Each image's position embeddings at its grid, concatenated: [total patches, hidden]."""
        table = self.position_embedding.weight.to(torch.float32)  # cast once per batch, not once per grid
        resized = {grid: self.resized(*grid, table) for grid in dict.fromkeys(grids)}
        return torch.cat([resized[grid] for grid in grids])

    def resized(self, height: int, width: int, table: torch.Tensor | None = None) -> torch.Tensor:
        """The square table resized to height x width (bilinear, antialiased, in float32), [height * width, hidden]
        row by row: one weight matrix per axis (`antialiased_bilinear_weights`), so [h, side] @ table @ [side, w].
        `table` is the position table already in float32 (`positions` casts it once for all of a batch's grids)."""
        weight = self.position_embedding.weight
        dim = weight.shape[-1]
        table = (weight.to(torch.float32) if table is None else table).reshape(self.side, self.side, dim)
        rows = axis_weights(self.side, height, weight.device)
        cols = axis_weights(self.side, width, weight.device)
        by_rows = (rows @ table.reshape(self.side, self.side * dim)).reshape(height, self.side, dim)
        out = torch.matmul(cols, by_rows)  # [w, side] @ [h, side, dim] -> [h, w, dim]
        return out.reshape(height * width, dim).to(weight.dtype)


@functools.lru_cache(maxsize=1024)
def axis_weights(size_in: int, size_out: int, device: torch.device) -> torch.Tensor:
    """`antialiased_bilinear_weights` on `device`, built and copied there once per (sizes, device): a grid's side
    is at most max_num_patches, so few exist, and a batch's grids no longer rebuild them on the host and copy them
    to the GPU each time. Built outside inference mode, so the cached tensor serves callers in either mode."""
    with torch.inference_mode(False):
        return antialiased_bilinear_weights(size_in, size_out).to(device)


def antialiased_bilinear_weights(size_in: int, size_out: int) -> torch.Tensor:
    """[size_out, size_in] float32 weights of antialiased bilinear resizing along one axis, as SigLIP 2 was trained:
    big_vision's NaFlex ViT resizes its position table with `jax.image.scale_and_translate(method="bilinear",
    antialias=True)`. Output i samples the input at (i + 0.5) * scale - 0.5 (scale = size_in / size_out) with a
    triangle kernel widened to `scale` input cells when shrinking, its weights normalized to sum 1; Pillow's
    BILINEAR resize, `F.interpolate(mode="bilinear", antialias=True)` and transformers >= 5.24 define the same.

    Not `F.interpolate` itself: on CPU its antialiased kernel gives a wrong result whenever the output is one column
    wide and the height changes (torch 2.13; every output row takes the first row's weights, so a 16 x 1 grid gets
    16 copies of one embedding), which SigLIP 2 meets for every tall, narrow image. transformers <= 5.23 calls it, so
    on CPU it has that defect; transformers 5.24 builds these same weights (docs/images.md, tests/test_siglip2.py)."""
    scale = size_in / size_out
    center = (torch.arange(size_out, dtype=torch.float64) + 0.5) * scale - 0.5
    source = torch.arange(size_in, dtype=torch.float64)
    weights = (1 - (source[None, :] - center[:, None]).abs() / max(scale, 1.0)).clamp(min=0)
    return (weights / weights.sum(dim=1, keepdim=True)).to(torch.float32)


class Siglip2Model(SiglipModel):
    """Siglip2Model (NaFlex): SigLIP's towers, the vision tower's embeddings replaced by `NaFlexEmbeddings`."""

    name = "siglip2"
    model_types = ("siglip2",)

    def check_vision(self, vision: object) -> None:
        patches = int(getattr(vision, "num_patches", 0) or 0)
        if patches < 1 or math.isqrt(patches) ** 2 != patches:
            raise ModelLoadError(f"vision_config.num_patches {patches} is not a square number: the position"
                                 " embeddings are a square grid")
        if not isinstance(vision.patch_size, int):
            raise ModelLoadError(f"vision_config.patch_size {vision.patch_size!r} must be one integer")

    def vision_tower(self, vision: object) -> VisionTower:
        return VisionTower(vision, self.attn_backend, clip=False, embeddings=NaFlexEmbeddings(vision))

    def image_states(self, batch: ModelInput) -> torch.Tensor:
        if batch.pixel_values is None:
            raise ValueError("an image batch without pixel_values")
        x = self.vision_model.embeddings(batch.pixel_values, self.grids(batch))
        meta = self.attn_backend.build_metadata(batch, False)
        return self.vision_model.encoder(x, meta)

    @staticmethod
    def grids(batch: ModelInput) -> list[tuple[int, int]]:
        """(h_patches, w_patches) of each image: h from its placeholder token ids (`packed_multimodal`), w from
        its sequence length."""
        pixels = batch.pixel_values
        assert pixels is not None
        if pixels.dim() != 4:
            raise ValueError(f"NaFlex pixel values must be [images, h_patches, w_patches, values], got"
                             f" {tuple(pixels.shape)}")
        rows = batch.input_ids[batch.cu_seqlens[:-1].long()].tolist()
        grids = []
        for h, n in zip(rows, batch.seq_lens):
            w = n // h if h > 0 else 0
            if h < 1 or h * w != n or h > pixels.shape[1] or w > pixels.shape[2]:
                raise ValueError(f"an image of {n} tokens and {h} patch rows does not fit pixel values of shape"
                                 f" {tuple(pixels.shape)}")
            grids.append((h, w))
        return grids
