"""NaFlex image preprocessing (SigLIP 2's variable resolution): an image keeps its aspect ratio and becomes a grid
of patches whose count varies per image, up to `max_num_patches`.

transformers' `Siglip2ImageProcessor` resizes each image to the largest multiple of `patch_size` on both sides whose
patch grid fits `max_num_patches` (a binary search over one scale for both sides,
`get_image_size_for_max_num_patches`), rescales and normalizes it, cuts it into patches of `patch_size` x
`patch_size` x 3 values (row by row, each patch's values in (row, column, channel) order), and pads the patch list
to `max_num_patches` with a mask. WDE packs sequences without padding, so an image here is just its own patches: a
float32 array [h_patches, w_patches, 3 * patch_size**2] whose shape carries its grid to the model (which resizes
its position embeddings to that grid) and whose sequence length is h_patches x w_patches.

The grid depends only on the image's width and height, so admission knows an image's length from its header,
before anything is decoded: the scheduler budgets tokens before images are decoded. The search treats height and
width alike, so turning a photo upright by its EXIF orientation (which may swap them) transposes the grid but
keeps its length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from wde.components.image_input import ValueSteps, to_rgb
from wde.errors import ModelLoadError

NAFLEX_PROCESSORS = ("Siglip2ImageProcessor",)
"""Image processor classes (without their Pil / Fast suffix) whose pipeline `NaFlexPreprocessor` implements."""


def size_for_max_num_patches(height: int, width: int, patch_size: int, max_num_patches: int,
                             eps: float = 1e-5) -> tuple[int, int]:
    """transformers' `get_image_size_for_max_num_patches`, operation for operation (the float steps of its binary
    search decide the size, so any shortcut could land one patch off): the (height, width) in pixels, multiples of
    `patch_size`, at least one patch each, at most `max_num_patches` patches in all."""

    def scaled(scale: float, size: int) -> int:
        return int(max(patch_size, math.ceil(size * scale / patch_size) * patch_size))

    scale_min, scale_max = eps / 10, 100.0
    while (scale_max - scale_min) >= eps:
        scale = (scale_min + scale_max) / 2
        patches = (scaled(scale, height) / patch_size) * (scaled(scale, width) / patch_size)
        if patches <= max_num_patches:
            scale_min = scale
        else:
            scale_max = scale
    return scaled(scale_min, height), scaled(scale_min, width)


@dataclass(frozen=True)
class NaFlexPreprocessor:
    """One NaFlex model's image pipeline, read from its `preprocessor_config.json`; `__call__` turns a decoded PIL
    image into its patches [h_patches, w_patches, 3 * patch_size**2] (float32). Pure Pillow and numpy:
    thread-safe."""

    kind: str
    patch_size: int
    max_num_patches: int
    resample: int
    values: ValueSteps

    @classmethod
    def from_processor(cls, name: str, proc: Any, where: Any) -> "NaFlexPreprocessor":
        """The pipeline of transformers' `Siglip2ImageProcessor` `proc` (read from `where`)."""
        if not getattr(proc, "do_resize", True):
            raise ModelLoadError(f"{where}: do_resize is false, so images would have to come in exact multiples of"
                                 " patch_size within max_num_patches; WDE serves NaFlex models with do_resize true")
        try:
            patch, most = int(proc.patch_size), int(proc.max_num_patches)
            resample = int(proc.resample if proc.resample is not None else 2)
        except (AttributeError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{where}: patch_size, max_num_patches and resample must be integers ({e})") from None
        if patch < 1 or most < 1:
            raise ModelLoadError(f"{where}: patch_size {patch} and max_num_patches {most} must be positive")
        return cls(name, patch, most, resample, ValueSteps.from_processor(proc, where))

    @property
    def patch_dim(self) -> int:
        """Values in one patch: 3 channels x patch_size x patch_size."""
        return 3 * self.patch_size ** 2

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) in pixels an image of this size is resized to."""
        return size_for_max_num_patches(height, width, self.patch_size, self.max_num_patches)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(h_patches, w_patches) of an image of this size."""
        h, w = self.resized_size(height, width)
        return h // self.patch_size, w // self.patch_size

    def num_tokens(self, width: int, height: int) -> int:
        """Sequence length of a width x height image in the vision tower: its patches (no class token)."""
        h, w = self.grid(height, width)
        return h * w

    def __call__(self, image: Any) -> np.ndarray:
        image = to_rgb(image)
        height, width = self.resized_size(image.height, image.width)
        image = image.resize((width, height), resample=self.resample)
        pixels = np.asarray(image).transpose(2, 0, 1)  # [C, H, W] uint8
        return patchify(self.values(pixels), self.patch_size)


def patchify(pixels: np.ndarray, patch_size: int) -> np.ndarray:
    """[C, H, W] → [H / p, W / p, p * p * C] float32: transformers' `convert_image_to_patches`, each patch's values
    in (row, column, channel) order, with the grid kept as two axes."""
    channels, height, width = pixels.shape
    h, w = height // patch_size, width // patch_size
    patches = pixels.reshape(channels, h, patch_size, w, patch_size).transpose(1, 3, 2, 4, 0)
    return np.ascontiguousarray(patches.reshape(h, w, -1), dtype=np.float32)
