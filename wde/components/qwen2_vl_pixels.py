"""Qwen2-VL image preprocessing (ColQwen2's dynamic resolution): an image keeps its aspect ratio and becomes a grid
of 14-pixel patches whose size varies per image, between the processor's `min_pixels` and `max_pixels`.

transformers' `Qwen2VLImageProcessor` resizes each image with `smart_resize` (both sides multiples of
`patch_size * merge_size`, 28 pixels, the area brought within [min_pixels, max_pixels] keeping the aspect ratio),
rescales and normalizes it, and cuts it into patches of 3 x `temporal_patch_size` x 14 x 14 values (a still image is
repeated over the two temporal slots), ordered merge block by merge block (`patchify`): the vision tower merges each
2 x 2 block of patches into one language-model token, so an image of h x w patches is h * w / 4 tokens.

Here an image's patches are that same flat list reshaped to [h_patches, w_patches, values] (a reshape of
transformers' order, not a spatial layout), so its grid travels in its shape. The grid depends only on the width
and height, so admission knows an image's length from its header, before anything is decoded; `max_pixels` bounds
what one image costs. Pure Pillow and numpy: thread-safe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from wde.components.image_input import ValueSteps, to_rgb
from wde.errors import ModelLoadError

QWEN2_VL_PROCESSORS = ("Qwen2VLImageProcessor",)
"""Image processor classes (without their Pil / Fast suffix) whose pipeline `Qwen2VLPreprocessor` implements."""


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' `smart_resize`, operation for operation: (height, width), multiples of `factor`, whose area is
    within [min_pixels, max_pixels] (up to rounding), close to the image's aspect ratio."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class Qwen2VLPreprocessor:
    """One Qwen2-VL image pipeline, read from the folder's image processor; `__call__` turns a decoded PIL image
    into its patches [h_patches, w_patches, 3 * temporal_patch_size * patch_size**2] (float32)."""

    kind: str
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    resample: int
    values: ValueSteps

    @classmethod
    def from_processor(cls, name: str, proc: Any, where: Any) -> "Qwen2VLPreprocessor":
        """The pipeline of transformers' `Qwen2VLImageProcessor` `proc` (read from `where`)."""
        if not getattr(proc, "do_resize", True):
            raise ModelLoadError(f"{where}: do_resize is false, which WDE does not implement for Qwen2-VL images"
                                 " (every image would have to come in multiples of patch_size * merge_size pixels)")
        size = getattr(proc, "size", None)
        try:
            lo, hi = int(size["shortest_edge"]), int(size["longest_edge"])  # min_pixels, max_pixels
            patch, merge, temporal = int(proc.patch_size), int(proc.merge_size), int(proc.temporal_patch_size)
            resample = int(proc.resample if proc.resample is not None else 3)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ModelLoadError(f"{where}: size.shortest_edge / longest_edge (min / max pixels), patch_size,"
                                 f" merge_size, temporal_patch_size and resample must be integers ({e})") from None
        if min(lo, patch, merge, temporal) < 1 or hi < lo:
            raise ModelLoadError(f"{where}: min_pixels {lo} .. max_pixels {hi}, patch_size {patch}, merge_size {merge}"
                                 f" and temporal_patch_size {temporal} must be positive, max at least min")
        return cls(name, patch, merge, temporal, lo, hi, resample, ValueSteps.from_processor(proc, where))

    @property
    def patch_dim(self) -> int:
        """Values in one patch: 3 channels x temporal_patch_size x patch_size x patch_size."""
        return 3 * self.temporal_patch_size * self.patch_size ** 2

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) in pixels an image of this size is resized to."""
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(h_patches, w_patches) of an image of this size."""
        h, w = self.resized_size(height, width)
        return h // self.patch_size, w // self.patch_size

    def num_tokens(self, width: int, height: int) -> int:
        """Language-model tokens of a width x height image: its patches over merge_size**2 (EXIF rotation swaps
        width and height, which transposes the grid and keeps its size)."""
        h, w = self.grid(height, width)
        return h * w // self.merge_size ** 2

    def __call__(self, image: Any) -> np.ndarray:
        image = to_rgb(image)
        height, width = self.resized_size(image.height, image.width)
        image = image.resize((width, height), resample=self.resample)
        pixels = self.values(np.asarray(image).transpose(2, 0, 1))  # [C, H, W] float32
        return self.patchify(pixels)

    def patchify(self, pixels: np.ndarray) -> np.ndarray:
        """[C, H, W] → transformers' flat patch list (merge block by merge block, the still image repeated over the
        temporal slots), as [h_patches, w_patches, values]."""
        c, height, width = pixels.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = height // p, width // p
        patches = pixels.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
        return np.ascontiguousarray(patches.reshape(gh, gw, c * t * p * p), dtype=np.float32)
